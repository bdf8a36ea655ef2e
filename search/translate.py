"""Token ids in, translations out: the Backend interface, the live model's, and its search.

The one path from token ids to hypotheses, taken by decode.py and by the
dev-set evaluation during training:

    hyps = translate_ids(model, sources, SearchSettings(beam_size=4, alpha=0.6))
    hyps[i][0].tokens, hyps[i][0].score      # the best translation of sources[i]

A `Backend` is what decode.py (and the library's `Translator`) translates with: the
live model of a workdir (`LiveTranslator`), an exported one (backends/stablehlo.py)
or a CTranslate2 model (backends/ct2.py). The JAX ones share one batch loop
(search/stages.py): sources of any lengths in batches of one static shape per
width (data/plans.py `plan_translation`), each searched in one program: on a CPU as
a queue that a few slots work through (search/pool.py), elsewhere all at once,
shrinking as its sources finish (search/rows.py); so a job's programs depend on its
settings and widths, never on its size.

With a `sharding` of the rows (e.g. training's batch sharding over its mesh),
each batch's rows are spread over the devices. Every process passes *all*
sources and gets all results back: each fills the rows of the global batch
that its devices hold, and the outputs are gathered, so a multi-host job
evaluates its dev set with every device and no host differs.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from attention_jax import Transformer
from attention_jax.search import decoding, likelihood, pool, programs, segments
from attention_jax.search.constraints import Controls
from attention_jax.search.decoding import decode_shape
from attention_jax.search.hypothesis import Hypothesis, IdLists, Indices, PerSource, hypotheses
from attention_jax.search.rows import shrinks
from attention_jax.search.settings import Rule, SearchSettings
from attention_jax.search.stages import (
    Progress,
    Targets,
    batch_of,
    fetch,
    place,
    plan_batches,
    prepare_plan,
    rows_multiple,
    run_stages,
    stage_rooms,
)

# A batch's whole search as one program: src [B, S] -> tokens [B, n_best, L], scores [B, n_best]
WholeSearch = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


class Backend(Protocol):
    """A translation backend: token-id sources -> hypotheses, in input order.

    sources are id lists as the model was trained on (EOS-terminated, at most
    `max_len` long); an empty one gets no hypotheses. Each source gets at most
    `n_best` hypotheses, best first. The sources `skip` (indices) are not translated
    (they get none): a resumed job's journal holds them. targets: the sources'
    prefixes and constraints (search/stages.py `Targets`; a backend that cannot honour
    them raises ValueError).

    `score` takes given translations instead (EOS-terminated ids, one per source, at
    most `max_len` long) and returns per pair [its Hypothesis] with the target's tokens,
    log P(target | source) as its score and `token_log_probs` (search/likelihood.py);
    [] for an empty source or one of `skip`.
    """

    max_len: int  # the longest source, in tokens with EOS
    settings: SearchSettings  # beam, alpha, n_best, length penalty, stop, batch tokens

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
        targets: Targets | None = None,
    ) -> list[list[Hypothesis]]: ...

    def score(
        self, sources: IdLists, given: IdLists, progress: Progress | None = None, skip: Indices = ()
    ) -> PerSource: ...


def vocab_limit(tokenizer_size: int, config: Any) -> int | None:
    """The ids a model may emit: below the tokenizer's size when the model's vocabulary is
    larger (a corpus that supported fewer pieces); None = all of them."""
    return tokenizer_size if tokenizer_size < config.vocab_size else None


# --- Search over one batch --------------------------------------------------------------


_OUTPUT_LOCK = threading.Lock()  # LiveSearch.output


@dataclasses.dataclass(frozen=True)
class LiveSearch:
    """A model's search of one batch in one program (search.stages.Search)."""

    model: Transformer
    settings: SearchSettings
    vocab_limit: int | None = None  # never emit ids >= this (None: the whole vocabulary)
    call: decoding.Call = programs.call  # how its programs run (`prepare`: compiled ahead)

    @functools.cached_property
    def rule(self) -> Rule:
        """The compiled search's static settings (made once, not per batch)."""
        return self.settings.rule(self.vocab_limit)

    @functools.cached_property
    def parts(self) -> decoding.Parts:
        """The model split once for every program of this search's job."""
        return decoding.Parts.of(self.model)

    def whole(
        self, src: jax.Array, rooms: Sequence[int], controls: Controls | None = None
    ) -> tuple[jax.Array, ...]:
        """search/decoding.py `search_batch` of src [B, S] through `rooms`: tokens [B, n, C] and
        scores [B, n] (n = n_best), every source finished; with controls (prefixes and
        phrases), also met [B, n, Q]. A small search (`large_search`: a few rows) takes
        the last room at once: its stages would save little and compile a loop each."""
        return self._whole(src, rooms, controls, counted=False)

    def whole_counted(
        self, src: jax.Array, rooms: Sequence[int], controls: Controls | None = None
    ) -> tuple[jax.Array, ...]:
        """`whole`, with met [B, n, Q] always, then the steps run [] and the step at which
        each source's search ended [B] (search.stages counts beam-row steps with them)."""
        return self._whole(src, rooms, controls, counted=True)

    def _whole(
        self,
        src: jax.Array,
        rooms: Sequence[int],
        controls: Controls | None,
        counted: bool,
        call: decoding.Call | None = None,
    ) -> tuple[jax.Array, ...]:
        length, extra = decode_shape(self.parts, src, None)
        if not decoding.large_search(self.parts, src.shape[0] * self.settings.beam_size, length):
            rooms = rooms[-1:]
        return decoding.search_batch(
            self.parts,
            src,
            alpha=self.settings.alpha,
            rule=self.rule,
            length=length,
            extra=extra,
            rooms=rooms,
            controls=controls,
            call=call or self.call,
            counted=counted,
        )

    def slots(self, rows: int, width: int) -> int:
        """The slots a batch of `rows` sources of width `width` is searched in, the batch
        their queue (search/pool.py), or 0: searched as one batch, whole or in segments."""
        return pool.pool_slots(rows, width)

    def pooled(
        self,
        src: jax.Array,
        slots: int,
        controls: Controls | None = None,
        call: decoding.Call | None = None,
    ) -> tuple[jax.Array, ...]:
        """search/pool.py `pool_search` of src [B, S] in `slots` slots: tokens [B, n, C],
        scores [B, n], met [B, n, Q], the steps run [] and each source's steps [B]
        (call: how its program runs; default: this search's)."""
        length, extra = decode_shape(self.parts, src, None)
        if isinstance(src, jax.ShapeDtypeStruct):  # a program prepared from shapes alone
            output = pool.decode_output_shape(self.parts)
        else:
            output = self.output
        return pool.pool_search(
            self.parts, src, alpha=self.settings.alpha, rule=self.rule, slots=slots,
            length=length, extra=extra, controls=controls, output=output,
            call=call or self.call,
        )  # fmt: skip

    @property
    def output(self) -> Any:
        """The model's output projection as its pooled searches read it, made once: the
        searches running side by side share it (search/pool.py `decode_output`). The
        streams ask for it at once; a lock (which `functools.cached_property` no longer
        takes from Python 3.12) has the first make it and the others wait for it."""
        with _OUTPUT_LOCK:
            if "_output" not in self.__dict__:  # a frozen dataclass: its __dict__ holds it
                self.__dict__["_output"] = pool.decode_output(self.parts)
            return self.__dict__["_output"]

    def start(
        self, src: jax.Array, room: int, controls: Controls | None, until: int
    ) -> segments.Segment | None:
        """The first segment of src [B, S]'s search (search/rows.py `SegmentedSearch`)."""
        return segments.start_segment(
            self.parts, src, alpha=self.settings.alpha, rule=self.rule, room=room,
            until=until, controls=controls, call=self.call,
        )  # fmt: skip

    def grow(self, state: Any, room: int) -> Any:
        """The search `state` with room for `room` tokens (search/rows.py)."""
        return segments.grow_segment(state, room, self.call)

    def select(self, state: Any, keep: jax.Array) -> Any:
        """The search `state` of the sources `keep` alone (search/rows.py)."""
        return segments.select_segment(state, keep, self.call)

    def advance(self, state: Any, until: int) -> segments.Segment:
        """The search `state`'s next segment (search/rows.py)."""
        return segments.advance_segment(
            self.parts, state, alpha=self.settings.alpha, rule=self.rule, until=until,
            call=self.call,
        )  # fmt: skip

    def prepare(
        self, rows: int, width: int, rooms: Sequence[int], controls: Controls | None = None
    ) -> None:
        """Start compiling or loading, in the background, the programs of a batch of `rows`
        sources of width `width` (controls: as shapes): its pooled search, or every program
        of its segments (search/segments.py `prepare_segments`), or its whole search for a
        batch too small to shrink."""
        if not programs.enabled():
            return
        src = jax.ShapeDtypeStruct((rows, width), np.int32)
        slots = self.slots(rows, width)
        if slots:
            self.pooled(src, slots, controls, call=programs.prepare)
            return
        if not shrinks(self, rows):  # the program run_stages calls
            self._whole(src, rooms, controls, counted=True, call=programs.prepare)
            return
        segments.prepare_segments(
            self.parts, src, alpha=self.settings.alpha, rule=self.rule, rooms=rooms,
            controls=controls, call=programs.prepare,
            rarely=functools.partial(programs.prepare, load=False),
        )  # fmt: skip


def search_fn(
    model: Transformer, settings: SearchSettings, vocab_limit: int | None = None
) -> WholeSearch:
    """One batch's whole search as one program: src [B, S] -> tokens [B, n_best, L],
    scores [B, n_best] (L = S + 50; what backends/stablehlo.py exports for plain JAX).

    The program `LiveSearch` runs for a batch of that width, its rooms included, so
    its results are the same.
    """
    live = LiveSearch(model, settings, vocab_limit, decoding.jit_call)
    max_len = model.config.max_len
    return lambda src: live.whole(src, stage_rooms(src.shape[1], max_len))


# --- Many sources -----------------------------------------------------------------------


def translate_ids(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    settings: SearchSettings = SearchSettings(),
    *,
    vocab_limit: int | None = None,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
    skip: Collection[int] = (),
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
) -> list[list[Hypothesis]]:
    """Translate token-id sources of any lengths, in batches of static shape.

    Args:
      model: a Transformer (evaluated deterministically).
      sources: id lists as the model was trained on (EOS-terminated), each at most
        `config.max_len` long; an empty list gives no hypotheses without running
        the model. With several processes, every process passes the same list.
      settings: beam size, alpha, n_best, length penalty, stop rule, batch tokens...
        (search/settings.py).
      vocab_limit: never emit ids >= this (a tokenizer smaller than the vocabulary).
      sharding: how each batch's [B, S] rows are placed (rows split over devices);
        None = on the default device.
      progress: called after each batch with the indices of the sources it finished
        and their hypotheses (search/stages.py `Progress`).
      skip: indices of sources not to translate (they get no hypotheses); the batches
        keep the shapes they would have had (search/stages.py `run_stages`).
      prefixes: per source, the ids its translation starts with (none: any start);
        constraints: per source, the phrases (id lists) it contains, at most
        settings.max_constraints of settings.constraint_tokens tokens each.
    Returns:
      per source, in input order, its hypotheses (at most n_best; fewer when the
      beam found fewer distinct ones); with constraints, each says which it met.
    """
    return run_stages(
        LiveSearch(model, settings, vocab_limit),
        sources,
        max_len=model.config.max_len,
        batch_tokens=settings.tokens_per_batch,
        sharding=sharding,
        progress=progress,
        min_rows=settings.min_rows,
        skip=skip,
        targets=Targets.of(settings, prefixes, constraints),
    )


@dataclasses.dataclass
class LiveTranslator:
    """The `Backend` of a model in memory (e.g. restored from a training workdir)."""

    model: Transformer
    settings: SearchSettings = dataclasses.field(default_factory=SearchSettings)
    vocab_limit: int | None = None
    sharding: NamedSharding | None = None  # each batch's rows over devices (None: one)

    @property
    def max_len(self) -> int:
        return self.model.config.max_len

    def search(self) -> LiveSearch:
        return LiveSearch(self.model, self.settings, self.vocab_limit)

    def prepare(
        self,
        sources: Sequence[Sequence[int]],
        skip: Collection[int] = (),
        targets: Targets | None = None,
    ) -> None:
        """Start compiling or loading, in the background, the programs `translate` of these
        sources will run (e.g. as soon as a chunk is read, while another is translated)."""
        plan, _ = plan_batches(
            sources,
            max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch,
            multiple=rows_multiple(self.sharding),
            min_rows=self.settings.min_rows,
            skip=skip,
        )
        prepare_plan(self.search(), plan, self.max_len, self.sharding, targets)

    def score(
        self, sources: IdLists, given: IdLists, progress: Progress | None = None, skip: Indices = ()
    ) -> PerSource:
        """Given translations (EOS-terminated ids) of the sources, scored: per pair
        [Hypothesis(tokens, score, token_log_probs)] (search/likelihood.py `score_pairs`)."""
        return likelihood.score_pairs(
            likelihood.live_scorer(self.model), sources, given, max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch, sharding=self.sharding,
            progress=progress, min_rows=self.settings.min_rows, skip=skip,
        )  # fmt: skip

    def prepare_scores(
        self,
        sources: Sequence[Sequence[int]],
        given: Sequence[Sequence[int]],
        skip: Collection[int] = (),
    ) -> None:
        """Start compiling or loading, in the background, the programs `score` of these
        pairs will run."""
        if not programs.enabled() or (self.sharding is not None and self.sharding.mesh.size > 1):
            return
        plan, _ = likelihood.plan_pairs(
            sources, given, max_len=self.max_len, batch_tokens=self.settings.tokens_per_batch,
            min_rows=self.settings.min_rows, skip=skip,
        )  # fmt: skip
        for rows, width in sorted({(rows, width) for _, width, rows in plan}):
            likelihood.prepare_scorer(self.model, rows, width)

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
        targets: Targets | None = None,
    ) -> list[list[Hypothesis]]:
        return run_stages(
            self.search(),
            sources,
            max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch,
            sharding=self.sharding,
            progress=progress,
            min_rows=self.settings.min_rows,
            skip=skip,
            targets=targets,
        )


@dataclasses.dataclass
class PlanOnlyTranslator:
    """A `Backend` that plans, fills, places and reads back every batch as the real one
    does, but runs no search: each source's one hypothesis is itself (without EOS), score 0.

    decode.py --dry_run: everything but the model (reading, tokenizing, batching,
    writing), to check an input and measure that part's memory and time.
    """

    max_len: int
    settings: SearchSettings = dataclasses.field(default_factory=SearchSettings)

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
        targets: Targets | None = None,
    ) -> list[list[Hypothesis]]:
        if targets is not None:  # checked as the search would: a dry run finds bad lines
            targets.check(sources, self.max_len)
        return echo_batches(
            sources,
            max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch,
            progress=progress,
            skip=skip,
        )

    def score(
        self, sources: IdLists, given: IdLists, progress: Progress | None = None, skip: Indices = ()
    ) -> PerSource:
        """`LiveTranslator.score`'s batches with every log-probability 0."""
        zeros = lambda src, tgt: jax.numpy.zeros(tgt.shape, np.float32)
        return likelihood.score_pairs(
            zeros, sources, given, max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch, progress=progress, skip=skip,
        )  # fmt: skip


def echo_batches(
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    progress: Progress | None = None,
    skip: Collection[int] = (),
) -> list[list[Hypothesis]]:
    """`run_stages`'s batches (planned, filled, placed on the device, read back) with each
    source 'translated' into itself, score 0: everything but the search. The sources
    `skip` get no hypotheses and are not reported to `progress`, as in `run_stages`."""
    plan, nonempty = plan_batches(sources, max_len=max_len, batch_tokens=batch_tokens, skip=skip)
    results: list[list[Hypothesis]] = [[] for _ in sources]
    for chunk, width, rows in plan:
        src = batch_of(sources, [nonempty[j] for j in chunk], rows, width)
        tokens = fetch(place(src, None))[:, None, :]  # [B, S] -> [B, 1, S]
        for r, j in enumerate(chunk):
            results[nonempty[j]] = hypotheses(tokens[r], np.zeros(1, np.float32))
        if progress is not None:
            progress([nonempty[j] for j in chunk], [results[nonempty[j]] for j in chunk])
    return results

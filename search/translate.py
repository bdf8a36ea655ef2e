"""Token ids in, translations out: the Translator interface, the live model's, and its search.

The one path from token ids to hypotheses, taken by decode.py and by the
dev-set evaluation during training:

    hyps = translate_ids(model, sources, SearchSettings(beam_size=4, alpha=0.6))
    hyps[i][0].tokens, hyps[i][0].score      # the best translation of sources[i]

A `Translator` is what decode.py translates with: the live model of a workdir
(`LiveTranslator`), an exported one (inference/export.py) or a CTranslate2
model (inference/ct2.py). The JAX ones share one batch loop
(search/stages.py): sources of any lengths in batches of a few static
shapes (data/plans.py `plan_translation`), each searched in stages of growing
room (model/beam.py; greedy search for beam 1), so a file of any size compiles
a handful of search programs, not one per batch.

With a `sharding` of the rows (e.g. training's batch sharding over its mesh),
each batch's rows are spread over the devices. Every process passes *all*
sources and gets all results back: each fills the rows of the global batch
that its devices hold, and the outputs are gathered, so a multi-host job
evaluates its dev set with every device and no host differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from data.plans import plan_translation
from model import Transformer, beam
from model.scoring import decode_shape
from search import programs
from search.hypothesis import Hypothesis, hypotheses
from search.settings import SearchSettings
from search.stages import (
    Progress,
    batch_of,
    check_lengths,
    fetch,
    place,
    run_stages,
    stage_rooms,
    without_sources,
)

# A batch's whole search as one program: src [B, S] -> tokens [B, n_best, L], scores [B, n_best]
WholeSearch = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


class Translator(Protocol):
    """A translation backend: token-id sources -> hypotheses, in input order.

    sources are id lists as the model was trained on (EOS-terminated, at most
    `max_len` long); an empty one gets no hypotheses. Each source gets at most
    `n_best` hypotheses, best first. The sources `skip` (indices) are not translated
    (they get none): a resumed job's journal holds them.
    """

    max_len: int  # the longest source, in tokens with EOS
    settings: SearchSettings  # beam, alpha, n_best, length penalty, stop, batch tokens

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
    ) -> list[list[Hypothesis]]: ...


def vocab_limit(tokenizer_size: int, config: Any) -> int | None:
    """The ids a model may emit: below the tokenizer's size when the model's vocabulary is
    larger (a corpus that supported fewer pieces); None = all of them."""
    return tokenizer_size if tokenizer_size < config.vocab_size else None


# --- Search over one batch --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LiveSearch:
    """A model's search in stages (search.stages.Search)."""

    model: Transformer
    rule: beam.Rule
    alpha: float
    call: beam.Call = programs.call  # how its programs run (`prepare`: compiled ahead)

    @property
    def n_best(self) -> int:
        return self.rule.n_best

    @property
    def beam_size(self) -> int:
        return self.rule.beam_size

    @property
    def program_key(self) -> tuple[int, beam.Rule]:
        """Searches of the same model and rule run the same compiled programs."""
        return id(self.model), self.rule

    def start(
        self, src: jax.Array, room: int, keep: int = 0, until: int = 0, more: tuple = ()
    ) -> tuple[beam.BeamState, jax.Array]:
        """model/beam.py `start` with this search's model, rule and alpha."""
        length, extra = decode_shape(self.model, src, None)
        args = dict(alpha=self.alpha, rule=self.rule, length=length, extra=extra)
        return beam.start(
            self.model,
            src,
            capacity=room,
            keep=keep,
            until=until,
            more=more,
            call=self.call,
            **args,
        )

    def whole(self, src: jax.Array, rooms: list[int]) -> tuple[beam.BeamState, jax.Array]:
        """The search through each of `rooms` in turn, in one program (every source done)."""
        return self.start(src, rooms[0], more=tuple(rooms[1:]))

    def prepare(self, rows: int, width: int, rooms: list[int] | None = None) -> None:
        """Start compiling, in the background, the program that starts a batch of `rows`
        sources of width `width`: with room for rooms[0] tokens (`start`), or with
        `rooms`, through each of them (`whole`)."""
        ahead = dataclasses.replace(self, call=programs.prepare)
        src = jax.ShapeDtypeStruct((rows, width), np.int32)
        if rooms is None:
            ahead.start(src, stage_rooms(width, self.model.config.max_len)[0])
        else:
            ahead.whole(src, rooms)

    def resume(
        self, state: beam.BeamState, room: int, keep: int = 0, until: int = 0
    ) -> tuple[beam.BeamState, jax.Array]:
        return beam.resume(
            self.model,
            state,
            alpha=self.alpha,
            rule=self.rule,
            capacity=room,
            keep=keep,
            until=until,
            call=self.call,
        )


def search_fn(
    model: Transformer, settings: SearchSettings, vocab_limit: int | None = None
) -> WholeSearch:
    """One batch's whole search as one program: src [B, S] -> tokens [B, n_best, L],
    scores [B, n_best] (L = S + 50; what inference/export.py exports for plain JAX).

    The same search as `LiveSearch`, its stages in one program (model/beam.py `search`).
    """
    rule, alpha, n_best = settings.rule(vocab_limit), settings.alpha, settings.n_best

    def search(src: jax.Array) -> tuple[jax.Array, jax.Array]:
        length, extra = decode_shape(model, src, None)
        state = beam.search(model, src, alpha=alpha, rule=rule, length=length, extra=extra)
        tokens, scores = beam.results(state)  # [B, K, L], [B, K]
        return tokens[:, :n_best], scores[:, :n_best]

    return search


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
    Returns:
      per source, in input order, its hypotheses (at most n_best; fewer when the
      beam found fewer distinct ones).
    """
    return run_stages(
        LiveSearch(model, settings.rule(vocab_limit), settings.alpha),
        sources,
        max_len=model.config.max_len,
        batch_tokens=settings.batch_tokens,
        sharding=sharding,
        progress=progress,
        min_rows=settings.min_rows,
        carry=settings.carry,
        skip=skip,
    )


@dataclasses.dataclass
class LiveTranslator:
    """The `Translator` of a model in memory (e.g. restored from a training workdir)."""

    model: Transformer
    settings: SearchSettings = dataclasses.field(default_factory=SearchSettings)
    vocab_limit: int | None = None
    sharding: NamedSharding | None = None  # each batch's rows over devices (None: one)

    @property
    def max_len(self) -> int:
        return self.model.config.max_len

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
    ) -> list[list[Hypothesis]]:
        return translate_ids(
            self.model,
            sources,
            self.settings,
            vocab_limit=self.vocab_limit,
            sharding=self.sharding,
            progress=progress,
            skip=skip,
        )


@dataclasses.dataclass
class PlanOnlyTranslator:
    """A `Translator` that plans, fills, places and reads back every batch as the real one
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
    ) -> list[list[Hypothesis]]:
        return echo_batches(
            sources,
            max_len=self.max_len,
            batch_tokens=self.settings.batch_tokens,
            progress=progress,
            skip=skip,
        )


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
    check_lengths(sources, max_len)
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    plan = plan_translation(
        [len(sources[i]) for i in nonempty], batch_tokens=batch_tokens, max_len=max_len
    )
    plan = without_sources(plan, nonempty, skip)
    results: list[list[Hypothesis]] = [[] for _ in sources]
    for chunk, width, rows in plan:
        src = batch_of(sources, [nonempty[j] for j in chunk], rows, width)
        tokens = fetch(place(src, None))[:, None, :]  # [B, S] -> [B, 1, S]
        for r, j in enumerate(chunk):
            results[nonempty[j]] = hypotheses(tokens[r], np.zeros(1, np.float32))
        if progress is not None:
            progress([nonempty[j] for j in chunk], [results[nonempty[j]] for j in chunk])
    return results

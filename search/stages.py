"""The batch loop every JAX backend shares: plan batches, search them on a few threads.

    results = run_stages(search, sources, max_len=256, batch_tokens=4096)

Sources are cut into batches of a few static shapes (data/plans.py
`plan_translation`): per source width, full batches and, for a width's last few
sources, one small batch. So the programs a job runs are a function of its
settings and of the widths present, never of its size, its chunks, its order or a
resume, and a warm job compiles nothing. A batch's search grows its room for tokens
in stages (`stage_rooms`), so attention reads caches about as long as what was
decoded, and its rows shrink as its sources finish (search/rows.py); a batch of a
few rows, one split over devices, or an exported search, runs whole in one program
(`Search.whole`). A source's results do not depend on the batch it is in
(search/beam.py); filler rows (`batch_of`) are finished before the first step.

The programs of a plan's shapes are prepared (compiled or loaded, side by side)
before its first batch runs, and batches search on several threads
(`search_streams`), so that the host's work overlaps the device's and a CPU's
cores each run one. With a `sharding` of the rows, each batch's rows are spread
over its devices; every process passes all sources and gets all results.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from attention_jax.data import plan_translation
from attention_jax.runtime.cpus import usable_cpus
from attention_jax.runtime.errors import UserError
from attention_jax.search import timing
from attention_jax.search.constraints import Controls
from attention_jax.search.hypothesis import hypotheses
from attention_jax.search.rows import Found, RowCounts, pooled_slots, shrinking, shrinks
from attention_jax.search.scoring import FILLER, output_limit, prefix_room, rooms
from attention_jax.search.settings import DEFAULTS, SearchSettings

# progress(indices, hypotheses) after each batch: which sources (indices into the list
# translated) it finished, and their hypotheses
Progress = Callable[[Sequence[int], Sequence[list[Any]]], None]


@dataclasses.dataclass(frozen=True)
class Targets:
    """What the translations of some sources must hold (None: nothing of that kind in the
    job): prefixes[i], the ids translation i starts with (empty: any start);
    constraints[i], the phrases (id lists) it contains. Each batch carries them as
    arrays of one size per width (search/constraints.py `Controls`): the prefix room is
    the batch's output length, the phrases at most `max_phrases` of `max_tokens`."""

    prefixes: Sequence[Sequence[int]] | None = None
    constraints: Sequence[Sequence[Sequence[int]]] | None = None
    max_phrases: int = DEFAULTS.max_constraints
    max_tokens: int = DEFAULTS.constraint_tokens

    @classmethod
    def of(
        cls,
        settings: SearchSettings,
        prefixes: Sequence[Sequence[int]] | None = None,
        constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> Targets | None:
        """The prefixes and constraints of some sources, sized by `settings` (None:
        neither)."""
        if prefixes is None and constraints is None:
            return None
        return cls(prefixes, constraints, settings.max_constraints, settings.constraint_tokens)

    def sizes(self, width: int, max_len: int) -> tuple[int, int, int]:
        """(P, Q, T): a batch's prefix room, phrases and tokens per phrase."""
        p = prefix_room(width, max_len) if self.prefixes is not None else 0
        q, t = (self.max_phrases, self.max_tokens) if self.constraints is not None else (0, 0)
        return p, q, t

    def batch(self, picked: Sequence[int], rows: int, width: int, max_len: int) -> Controls:
        """The Controls of a batch of the sources `picked` (indices), filler rows last."""
        p, q, t = self.sizes(width, max_len)
        return Controls.of(
            [self.prefixes[i] for i in picked] if self.prefixes is not None else [],
            [self.constraints[i] for i in picked] if self.constraints is not None else [],
            rows=rows,
            prefix_len=p,
            max_phrases=q,
            max_tokens=t,
        )

    def abstract(self, rows: int, width: int, max_len: int) -> Controls:
        """A batch's Controls as shapes (to compile its program ahead)."""
        p, q, t = self.sizes(width, max_len)
        shape = lambda *dims: jax.ShapeDtypeStruct(dims, np.int32)
        return Controls(shape(rows, p), shape(rows, q, t), shape(rows, q, t))

    def check(self, sources: Sequence[Sequence[int]], max_len: int) -> None:
        """UserError naming the first source whose prefix leaves no room (its output
        may have min(len + 50, max_len) tokens, EOS included) or whose phrases exceed
        the limits (decode.py checks its files before; this is for other callers)."""
        for i, source in enumerate(sources):
            room = prefix_room(len(source), max_len)
            if self.prefixes is not None and source and len(self.prefixes[i]) > room:
                raise UserError(
                    f"source #{i}: its prefix has {len(self.prefixes[i])} tokens, more than "
                    f"the {room} its translation may have"
                )
            if self.constraints is not None and source:
                try:
                    Controls.of(
                        [], [self.constraints[i]], rows=1, prefix_len=0,
                        max_phrases=self.max_phrases, max_tokens=self.max_tokens,
                    )  # fmt: skip
                except ValueError as e:
                    raise UserError(f"source #{i}: {e}") from e


# (indices into the non-empty sources, width S, rows B) per batch
Plan = list[tuple[np.ndarray, int, int]]


def output_tokens(found: Sequence[list[Any]]) -> int:
    """Tokens of the best hypotheses, EOS counted (what the progress meter shows)."""
    return sum(len(hyps[0].tokens) + 1 for hyps in found if hyps)


def stage_rooms(width: int, max_len: int) -> list[int]:
    """Tokens a batch of source width `width` has room for, stage by stage: width + 16,
    doubled, up to L = min(width + 50, max_len) (every source's limit; search/scoring.py
    `rooms`)."""
    return rooms(width, output_limit(width, max_len))


class Search(Protocol):
    """One batch's whole search: the live model's program, or an exported one.

    whole(src [B, S], rooms, controls) searches through each of `rooms` in turn until
    every source is finished, and returns tokens [B, n_best, C] (EOS-terminated, 0
    after) and scores [B, n_best] (-inf: a slot never filled), best first; with
    controls (each source's prefix and phrases), also met [B, n_best, Q] bool. A search
    may also have `prepare(rows, width, rooms, controls)` (controls as shapes): start
    compiling or loading the program of that shape in the background;
    `whole_counted`, run instead of `whole`: the same, with met always, then the steps
    it ran [] and the step at which each source's search ended [B], for `--stats`; and
    `slots(rows, width)` with `pooled(src, slots, controls)`: a batch searched as a
    queue in that many slots (search/pool.py), counted as `whole_counted`.
    """

    def whole(
        self, src: jax.Array, rooms: list[int], controls: Controls | None = None
    ) -> tuple[jax.Array, ...]: ...


# --- devices <-> host -------------------------------------------------------------------


def check_lengths(sources: Sequence[Sequence[int]], max_len: int) -> None:
    """ValueError naming how many sources (and the first) are longer than max_len."""
    too_long = [i for i, s in enumerate(sources) if len(s) > max_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} source(s) exceed max_len {max_len} (first: #{too_long[0]})"
        )


def batch_of(
    sources: Sequence[Sequence[int]], picked: Sequence[int], rows: int, width: int
) -> np.ndarray:
    """sources[picked] as one [rows, width] int32 batch (0-padded). Filler rows hold
    search/scoring.py `FILLER` (a lone EOS where the width is 1): they encode as a short
    source and are finished before the first step; their output is dropped."""
    src = np.zeros((rows, width), np.int32)  # [B, S]
    filler = FILLER[:width]
    src[len(picked) :, : len(filler)] = filler
    for r, i in enumerate(picked):
        src[r, : len(sources[i])] = sources[i]
    return src


def rows_multiple(sharding: NamedSharding | None) -> int:
    """How many devices the rows are split over (every batch's rows are a multiple)."""
    if sharding is None:
        return 1
    axes = sharding.spec[0] if sharding.spec else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(sharding.mesh.shape[a] for a in axes)


def place(x: Any, sharding: NamedSharding | None) -> Any:
    """numpy arrays (the whole batch, on every process) -> device arrays, rows sharded."""
    if sharding is None:
        return jax.device_put(x)

    def one(a: np.ndarray) -> jax.Array:
        where = sharding if a.ndim else NamedSharding(sharding.mesh, PartitionSpec())
        return jax.make_array_from_callback(a.shape, where, lambda index: a[index])

    return jax.tree.map(one, x)


def fetch(x: Any) -> Any:
    """(Possibly multi-process) device arrays -> the whole arrays on this host (numpy)."""

    def one(a: jax.Array) -> np.ndarray:
        if a.is_fully_addressable:
            return np.asarray(a)
        if a.ndim == 0:  # replicated
            return np.asarray(a.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(one, x)


# --- the plan ---------------------------------------------------------------------------


def plan_batches(
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    multiple: int = 1,
    min_rows: int = DEFAULTS.min_rows,
    skip: Collection[int] = (),
    beside: Sequence[Sequence[int]] | None = None,
) -> tuple[Plan, list[int]]:
    """(the batches, the indices of the non-empty sources the plan's indices point into).

    Empty sources are in no batch; the sources `skip` (indices into `sources`, e.g. those
    a killed run's journal holds) leave their rows to filler: every batch keeps the
    shape it has with them (`without_sources`). beside: per source, a sequence padded
    to its batch's width too (given translations, search/likelihood.py): a source goes
    by the wider of the two.
    """
    check_lengths(sources, max_len)
    if beside is not None:
        check_lengths(beside, max_len)
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    other = sources if beside is None else beside
    plan = plan_translation(
        [max(len(sources[i]), len(other[i])) for i in nonempty],
        batch_tokens=batch_tokens,
        max_len=max_len,
        rows_multiple=multiple,
        min_rows=min_rows,
    )
    return without_sources(plan, nonempty, skip), nonempty


def without_sources(plan: Plan, nonempty: Sequence[int], skip: Collection[int]) -> Plan:
    """The plan of the sources `nonempty` without the sources `skip` (both indices into
    all sources): every batch keeps its shape, skipped rows are filler, so a resumed
    chunk runs the programs the uninterrupted one ran."""
    if not skip:
        return plan
    skipped = set(skip)
    drop = {j for j, i in enumerate(nonempty) if i in skipped}  # positions in the plan
    plan = [(np.array([j for j in c if j not in drop], int), w, r) for c, w, r in plan]
    return [(c, w, r) for c, w, r in plan if c.size]


def prepare_plan(
    search: Any, plan: Plan, max_len: int, sharding: Any = None, targets: Targets | None = None
) -> None:
    """Start preparing the program of each shape of `plan` (a search with `prepare`, on
    one device: a mesh's programs are compiled by their first call)."""
    prepare = getattr(search, "prepare", None)
    if prepare is None or sharding is not None:
        return
    for width, rows in dict.fromkeys((width, rows) for _, width, rows in plan):
        controls = None if targets is None else targets.abstract(rows, width, max_len)
        prepare(rows, width, stage_rooms(width, max_len), controls)


# --- the loop -------------------------------------------------------------------------------


def run_stages(
    search: Search,
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
    min_rows: int = DEFAULTS.min_rows,
    skip: Collection[int] = (),
    targets: Targets | None = None,
    streams: int | None = None,
) -> list[list[Any]]:
    """Per source, in input order, its hypotheses (search.hypothesis.Hypothesis).

    sources: EOS-terminated id lists of at most max_len tokens; an empty one gets
    no hypotheses without running the model. min_rows: the rows of a width's small
    batch (data.plans.plan_translation). skip: sources not to translate (they get no
    hypotheses), e.g. those a killed run's journal holds; the batches keep the shapes
    they have with them. targets: the prefixes and constraints of the sources.
    streams: how many batches search at once (None: `search_streams`).
    """
    if targets is not None:
        targets.check(sources, max_len)
    plan, nonempty = plan_batches(
        sources,
        max_len=max_len,
        batch_tokens=batch_tokens,
        multiple=rows_multiple(sharding),
        min_rows=min_rows,
        skip=skip,
    )
    prepare_plan(search, plan, max_len, sharding, targets)
    results: list[list[Any]] = [[] for _ in sources]
    multiple = rows_multiple(sharding)
    put = lambda x: place(x, sharding)

    def search_one(picked: list[int], width: int, rows: int) -> Found:
        """A batch's search, on a search thread: its results, read back."""
        src = batch_of(sources, picked, rows, width)
        controls = None
        if targets is not None:
            controls = put(targets.batch(picked, rows, width, max_len))
        rooms = stage_rooms(width, max_len)
        slots = pooled_slots(search, rows, width, multiple)
        if slots:
            with timing.search_call() as call:
                out = search.pooled(put(src), slots, controls)
                call.dispatched(out)
            return _read_back(out, slots, picked, search.settings.beam_size, controls)
        if shrinks(search, rows, multiple):
            return shrinking(
                search, src, rooms, controls=controls, place=put, fetch=fetch,
                beam_size=search.settings.beam_size, sources=len(picked),
            )  # fmt: skip
        counted = getattr(search, "whole_counted", None)  # a live model's search counts
        with timing.search_call() as call:
            out = (counted or search.whole)(put(src), rooms, controls)
            call.dispatched(out)
        if counted is not None:
            return _read_back(out, rows, picked, search.settings.beam_size, controls)
        with timing.phase("fetch"):
            tokens, scores, *met = fetch(out)  # [B, n, C], [B, n], ([B, n, Q])
        return tokens, scores, met[0] if met else None, None

    def finish(found: Found, indices: list[int]) -> None:
        tokens, scores, met, counts = found
        if counts is not None:
            timing.count("beam_row_steps_run", counts.run)
            timing.count("beam_row_steps_needed", counts.needed)
        if met is not None and targets is not None and targets.constraints is not None:
            count = [len(targets.constraints[i]) for i in indices]
            hyps = [hypotheses(tokens[r], scores[r], met[r], n) for r, n in enumerate(count)]
        else:
            hyps = [hypotheses(tokens[r], scores[r]) for r in range(len(indices))]
        for i, h in zip(indices, hyps, strict=True):
            results[i] = h
        if progress is not None:
            progress(indices, hyps)

    streams = search_streams(sharding) if streams is None else streams
    run_batches(plan, nonempty, search_one, finish, streams, "search")
    return results


def _read_back(
    out: tuple[jax.Array, ...], rows: int, picked: list[int], k: int, controls: Any
) -> Found:
    """A counted search's results on the host: tokens [B, n, C], scores [B, n], met [B, n, Q]
    (None without controls), and its beam-row steps, of `rows` rows (a batch's, or a
    pool's slots) for the steps it ran."""
    with timing.phase("fetch"):
        tokens, scores, met, steps, took = fetch(out)  # ..., [], [B]
    counts = RowCounts(run=rows * int(steps) * k, needed=int(took[: len(picked)].sum()) * k)
    return tokens, scores, met if controls is not None else None, counts


def run_batches(
    plan: Plan,
    nonempty: Sequence[int],
    work: Callable[[list[int], int, int], Any],
    finish: Callable[[Any, list[int]], None],
    streams: int,
    name: str,
) -> None:
    """work(picked, width, rows) for each batch of `plan` (picked: its indices into all
    sources) on `streams` threads, a few more queued; finish(result, picked) on this
    thread as each ends (one thread: in the plan's order)."""
    with concurrent.futures.ThreadPoolExecutor(streams, thread_name_prefix=name) as pool:
        running: dict[concurrent.futures.Future, list[int]] = {}
        for chunk, width, rows in plan:
            picked = [nonempty[j] for j in chunk]
            running[pool.submit(work, picked, width, rows)] = picked
            while len(running) > streams:
                _collect(running, finish, concurrent.futures.FIRST_COMPLETED)
        while running:
            _collect(running, finish, concurrent.futures.ALL_COMPLETED)


def _collect(running: dict, finish: Callable, when: str) -> None:
    """Wait for some of the `running` batches (`when`), and finish those that ended."""
    ended, _ = concurrent.futures.wait(running, return_when=when)
    for future in ended:
        finish(future.result(), running.pop(future))


def search_streams(sharding: NamedSharding | None) -> int:
    """How many batches search at once: on one device, two (a GPU computes one while the
    host reads the other back), or one per core on a CPU, where one small step barely
    uses a second core; one when the rows are split over devices, whose programs every
    device must run in the same order."""
    if sharding is not None and sharding.mesh.size > 1:
        return 1
    device = jax.devices()[0] if sharding is None else sharding.mesh.devices.flat[0]
    return min(usable_cpus(), 4) if device.platform == "cpu" else 2

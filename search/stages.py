"""The batch loop every JAX backend shares: plan batches, search them in stages, carry over.

    results = run_stages(search, sources, max_len=256, batch_tokens=4096)

Sources are cut into batches of a few static shapes (data/plans.py
`plan_translation`). Each batch starts with room for a few tokens more than
its width (`stage_rooms`), which most of its sources need; a source that is
not done when the room is full waits in a pool with the others of its width
and room, and those go on together, from any batches, with twice the room
(model/carry.py `take_sources`, `join_sources`). So attention and the cache
reorder read caches about as long as what was decoded, and one slow source no
longer keeps a whole batch computing. Within a stage, once half of a batch's
sources are finished, the others go on at once in half the rows (when that
saves enough steps to pay for a program of a new shape: MIN_SAVED_ROW_STEPS),
so finished sources stop costing steps. A source's results do not depend on
the stage or batch it finishes in (model/beam.py).

Searches are dispatched before the previous one is read back, so the host work
overlaps the device's. With a `sharding` of the rows, each batch's rows (and a
carried-over state's) are spread over its devices; every process passes all
sources and gets all results.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from data.plans import MIN_ROWS, plan_translation
from model.beam import BeamState
from model.carry import join_sources, take_sources
from model.scoring import EXTRA_DECODE_LEN, FILLER, rooms
from search import timing
from search.hypothesis import hypotheses

# progress(indices, hypotheses) after each batch: which sources (indices into the list
# translated) it finished, and their hypotheses
Progress = Callable[[Sequence[int], Sequence[list[Any]]], None]


def output_tokens(found: Sequence[list[Any]]) -> int:
    """Tokens of the best hypotheses, EOS counted (what the progress meter shows)."""
    return sum(len(hyps[0].tokens) + 1 for hyps in found if hyps)


def stage_rooms(width: int, max_len: int) -> list[int]:
    """Tokens a batch of source width `width` has room for, stage by stage: width + 16,
    doubled, up to L = min(width + 50, max_len) (every source's limit; model/scoring.py
    `rooms`)."""
    return rooms(width, min(width + EXTRA_DECODE_LEN, max_len))


class Search(Protocol):
    """One batch's search in stages: model/beam.py's programs, or exported ones.

    start(src [B, S], room, keep, until) and resume(state, room, keep, until) search
    until every source is finished or the room is full, or at most `keep` are not
    before step `until` (model/beam.py `run`), and return the state and [B] bool,
    the sources that are finished. A search may also have `whole(src, rooms)`: the
    search through each of `rooms` in turn in one program, every source finished.
    A done source's `fin_seqs[b, :n]`, `fin_scores[b, :n]` are its n best hypotheses,
    best first (-inf: a slot never filled).
    """

    n_best: int
    beam_size: int

    def start(
        self, src: jax.Array, room: int, keep: int, until: int
    ) -> tuple[BeamState, jax.Array]: ...

    def resume(
        self, state: BeamState, room: int, keep: int, until: int
    ) -> tuple[BeamState, jax.Array]: ...


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
    model/scoring.py `FILLER` (a lone EOS where the width is 1): they encode as a short
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


# --- the loop -------------------------------------------------------------------------------

# A batch goes on in half its rows once half of its sources are finished, only if the
# rows it leaves behind would otherwise have computed at least this many beam-row steps
# in its room: a smaller batch of a shape this process has not run yet is a new
# program, and tracing and loading one costs ~0.3 s on the 2-core box, ~6,000
# beam-row steps of the tiny model there (shared by the batches of that width in the
# call); one it has run costs a copy of the state.
MIN_SAVED_ROW_STEPS = {"new": 8192, "known": 512}
# (search, rows, width, room) of the searches this process has run
_SHAPES_RUN: set[tuple[Any, int, int, int]] = set()

# One search of a batch on its way: (its output, the sources it holds, width, room, rows).
_Job = tuple[tuple[BeamState, jax.Array], np.ndarray, int, int, int]


class _Stages:
    """The state of one `run_stages` call: results so far and the pools of carried sources."""

    def __init__(self, search: Search, sources, nonempty, max_len, progress, sharding, min_rows):
        self.search, self.sources, self.nonempty = search, sources, nonempty
        self.max_len, self.progress = max_len, progress
        self.sharding, self.multiple = sharding, rows_multiple(sharding)
        self.min_rows = min_rows
        # what identifies the search's compiled programs within this process
        self.key = getattr(search, "program_key", id(search))
        self.batches: dict[int, int] = {}  # fresh batches of each width in this call
        self.results: list[list[Any]] = [[] for _ in sources]
        # (width, room) -> [(indices into nonempty, their states)]
        self.pools: dict[tuple[int, int], list[tuple[np.ndarray, BeamState]]] = {}

    def early(self, rows: int, width: int, room: int) -> tuple[int, int]:
        """(keep, until) for a search of `rows` rows with room for `room` tokens: it stops
        when at most half its sources are unfinished, so they go on in half the rows, if
        that happens early enough for the rows left behind to save MIN_SAVED_ROW_STEPS
        beam-row steps of its room; (0, 0): it runs until all are finished."""
        half = rows // 2
        fewer = _round_rows(half, rows, self.multiple, self.min_rows)
        if fewer >= rows:
            return 0, 0
        if (self.key, fewer, width, room) in _SHAPES_RUN:
            least = MIN_SAVED_ROW_STEPS["known"]
        else:  # a new program, run by about as many batches as this call has of the width
            least = max(MIN_SAVED_ROW_STEPS["new"] // self.batches.get(width, 1), 1)
        freed = (rows - fewer) * self.search.beam_size  # beam rows no longer computed
        until = room - -(-least // freed)
        return (half, until) if until > 0 else (0, 0)

    def launch(self, chunk: np.ndarray, state: BeamState, width: int, room: int) -> _Job:
        rows = state.live_seqs.shape[0]
        _SHAPES_RUN.add((self.key, rows, width, room))
        early = self.early(rows, width, room)
        out = self.search.resume(place(state, self.sharding), room, *early)
        timing.dispatched(out)
        return out, chunk, width, room, rows

    def finish(self, job: _Job) -> _Job | None:
        """Read a search back: the results of its finished sources; the others go on now in
        fewer rows (returned) if it stopped early, or wait in a pool for the next room."""
        (state, done), chunk, width, room, rows = job
        n = self.search.n_best
        with timing.phase("fetch"):
            done, step = fetch((done, state.step))
            # Sliced on the host: a slice on the device is a small program per shape, each
            # traced, lowered and loaded in every process (~0.1 s).
            tokens, scores = (x[:, :n] for x in fetch((state.fin_seqs, state.fin_scores)))
        indices, found = [], []
        for r, j in enumerate(chunk):
            if done[r]:
                hyps = hypotheses(tokens[r], scores[r])
                self.results[self.nonempty[j]] = hyps
                indices.append(self.nonempty[j])
                found.append(hyps)
        carried = np.flatnonzero(~done[: len(chunk)])
        if self.progress is not None and indices:
            self.progress(indices, found)
        if not carried.size:
            return None
        kept = take_sources(fetch(state), carried)
        if int(step) < room:  # stopped at `keep`: the rest go on at once, in fewer rows
            fewer = _round_rows(carried.size, rows, self.multiple, self.min_rows)
            return self.launch(chunk[carried], join_sources([kept], width, fewer), width, room)
        self.pools.setdefault((width, room), []).append((chunk[carried], kept))
        return None

    def drain(self, jobs: Iterator[Callable[[], _Job]]) -> None:
        """Run jobs with one more queued behind the one read back, so the device never
        waits for the host; a job's continuation goes to the back of the queue."""
        queue: collections.deque[_Job] = collections.deque()
        for launch in jobs:
            queue.append(launch())
            while len(queue) > 1:
                more = self.finish(queue.popleft())
                if more is not None:
                    queue.append(more)
        while queue:
            more = self.finish(queue.popleft())
            if more is not None:
                queue.append(more)

    def carried_batches(self, full_rows: Callable[[int], int]) -> Iterator[Callable[[], _Job]]:
        """Launchers of the pooled sources' searches, earliest stage first, in batches of at
        most full_rows(width) rows, with the next room."""
        while self.pools:
            width, room = min(self.pools, key=lambda key: (key[1], key[0]))
            parts = self.pools.pop((width, room))
            schedule = stage_rooms(width, self.max_len)
            next_room = schedule[schedule.index(room) + 1]
            chunks = np.concatenate([c for c, _ in parts])
            state = parts[0][1] if len(parts) == 1 else None
            limit = full_rows(width)
            for lo in range(0, len(chunks), limit):
                pick = np.arange(lo, min(lo + limit, len(chunks)))
                rows = _round_rows(len(pick), limit, self.multiple, self.min_rows)
                picked = _pick(parts, pick) if state is None else [take_sources(state, pick)]
                joined = join_sources(picked, width, rows, next_room)
                yield functools.partial(self.launch, chunks[pick], joined, width, next_room)


def _round_rows(n: int, limit: int, multiple: int, min_rows: int = MIN_ROWS) -> int:
    """Rows for n carried sources: a power of two >= n (at least `min_rows`), at most
    `limit`, a multiple of `multiple`."""
    rows = min(max(min_rows, 1 << (n - 1).bit_length()), max(limit, n))
    return -(-rows // multiple) * multiple


def without_sources(plan: list, nonempty: Sequence[int], skip: Collection[int]) -> list:
    """The plan of the sources `nonempty` without the sources `skip` (both indices into
    all sources): every batch keeps its shape, skipped rows are filler. A source's last
    bits may depend on the width and rows of the batch it starts in, and a new shape is
    a new program."""
    if not skip:
        return plan
    skipped = set(skip)
    drop = {j for j, i in enumerate(nonempty) if i in skipped}  # positions in the plan
    plan = [(np.array([j for j in c if j not in drop], int), w, r) for c, w, r in plan]
    return [(c, w, r) for c, w, r in plan if c.size]


def _pick(parts: list[tuple[np.ndarray, BeamState]], pick: np.ndarray) -> list[BeamState]:
    """The states of positions `pick` of the concatenated parts."""
    out, base = [], 0
    for chunk, state in parts:
        mine = pick[(pick >= base) & (pick < base + len(chunk))] - base
        if mine.size:
            out.append(take_sources(state, mine))
        base += len(chunk)
    return out


def carries_over(platform: str | None = None) -> bool:
    """Whether batches carry their unfinished sources over to smaller batches (the
    default of `run_stages`'s `carry`): on a CPU, where a step's time grows with its
    rows and a program compiles in a second or two; not on a GPU or TPU, where a
    step costs about the same with half the rows and a program of base's size takes
    ~10-15 s to compile (an H200's in-training evaluation of 500 sentences spent
    most of 145 s compiling 10-20 staged programs)."""
    return (platform or jax.default_backend()) == "cpu"


def run_stages(
    search: Search,
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
    min_rows: int = MIN_ROWS,
    carry: bool | None = None,
    skip: Collection[int] = (),
) -> list[list[Any]]:
    """Per source, in input order, its hypotheses (search.hypothesis.Hypothesis).

    sources: EOS-terminated id lists of at most max_len tokens; an empty one gets
    no hypotheses without running the model. min_rows: the fewest rows of a batch
    (data.plans.plan_translation): 1 for a dev set translated at every evaluation.
    carry: carry unfinished sources over to batches of their own with more room (and
    stop a batch early once half its sources are done); False: each batch runs its
    whole search, every room, in one program (a search without `whole` always
    carries). None: `carries_over()` for this platform. The results are the same.
    skip: sources not to translate (they get no hypotheses), e.g. those a killed run's
    journal holds; the batches keep the shapes they have with them (`without_sources`).
    """
    check_lengths(sources, max_len)
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if carry is None:
        carry = carries_over()
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    multiple = rows_multiple(sharding)
    plan = plan_translation(
        [len(sources[i]) for i in nonempty],
        batch_tokens=batch_tokens,
        max_len=max_len,
        rows_multiple=multiple,
        min_rows=min_rows,
    )
    stages = _Stages(search, sources, nonempty, max_len, progress, sharding, min_rows)
    stages.batches = collections.Counter(width for _, width, _ in plan)
    plan = without_sources(plan, nonempty, skip)
    whole = None if carry else getattr(search, "whole", None)
    prepare = getattr(search, "prepare", None)
    if prepare is not None and sharding is None:  # every fresh batch's program, side by side
        for width, rows in dict.fromkeys((width, rows) for _, width, rows in plan):
            prepare(rows, width, stage_rooms(width, max_len) if whole is not None else None)

    def fresh(chunk: np.ndarray, width: int, rows: int) -> _Job:
        src = batch_of(sources, [nonempty[j] for j in chunk], rows, width)
        rooms = stage_rooms(width, max_len)
        if whole is not None:  # every room in one program: all finished at its end
            out = whole(place(src, sharding), rooms)
            timing.dispatched(out)
            return out, chunk, width, rooms[-1], rows
        room = rooms[0]
        out = search.start(place(src, sharding), room, *stages.early(rows, width, room))
        timing.dispatched(out)
        return out, chunk, width, room, rows

    stages.drain(lambda c=c, w=w, r=r: fresh(c, w, r) for c, w, r in plan)
    full_rows = lambda width: max(1 << (max(batch_tokens // width, 1).bit_length() - 1), min_rows)
    while stages.pools:  # a search still running when the pools ran dry may fill one again
        stages.drain(stages.carried_batches(full_rows))
    return stages.results

"""The batch loop every JAX backend shares: plan batches, search them in stages, carry over.

    results = run_stages(search, sources, max_len=256, batch_tokens=4096)

Sources are cut into batches of a few static shapes (data/plans.py
`plan_translation`). Each batch starts with room for a few tokens more than
its width (`stage_rooms`), which most of its sources need; a source that is
not done when the room is full waits in a pool with the others of its width
and room, and those go on together, from any batches, with twice the room
(model/beam.py `take_sources`, `join_sources`). So attention and the cache
reorder read caches about as long as what was decoded, and one slow source no
longer keeps a whole batch computing. A source's results do not depend on the
stage or batch it finishes in (model/beam.py).

Batches are dispatched before the previous one is read back, so the host work
overlaps the device's. With a `sharding` of the rows, each batch's rows (and a
carried-over state's) are spread over its devices; every process passes all
sources and gets all results.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from data.plans import MIN_ROWS, plan_translation
from inference.hypothesis import hypotheses
from model import EOS_ID
from model.beam import BeamState, join_sources, take_sources
from model.scoring import EXTRA_DECODE_LEN

# progress(sentences, output tokens) after each batch
Progress = Callable[[int, int], None]
# The first stage's room, beyond the batch's source width: on the Ding test set
# (beam 4, n_best 1) 89% of the sources are done by then.
FIRST_EXTRA = 16


def stage_rooms(width: int, max_len: int) -> list[int]:
    """Tokens a batch of source width `width` has room for, stage by stage: width + 16,
    doubled, up to L = min(width + 50, max_len) (every source's limit)."""
    length = min(width + EXTRA_DECODE_LEN, max_len)
    rooms = [min(width + FIRST_EXTRA, length)]
    while rooms[-1] < length:
        rooms.append(min(2 * rooms[-1], length))
    return rooms


class Search(Protocol):
    """One batch's search in stages: model/beam.py's programs, or exported ones.

    start(src [B, S], room) and resume(state, room) return the state and [B] bool,
    the sources that are done. A done source's `fin_seqs[b, :n]`, `fin_scores[b, :n]`
    are its n best hypotheses, best first (-inf: a slot never filled).
    """

    n_best: int

    def start(self, src: jax.Array, room: int) -> tuple[BeamState, jax.Array]: ...

    def resume(self, state: BeamState, room: int) -> tuple[BeamState, jax.Array]: ...


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
    """sources[picked] as one [rows, width] int32 batch (0-padded). Filler rows hold a lone
    EOS: a valid, cheap source whose output is dropped."""
    src = np.zeros((rows, width), np.int32)  # [B, S]
    src[len(picked) :, 0] = EOS_ID
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


class _Stages:
    """The state of one `run_stages` call: results so far and the pools of carried sources."""

    def __init__(self, search: Search, sources, nonempty, max_len, progress):
        self.search, self.sources, self.nonempty = search, sources, nonempty
        self.max_len, self.progress = max_len, progress
        self.results: list[list[Any]] = [[] for _ in sources]
        # (width, room) -> [(indices into nonempty, their states)]
        self.pools: dict[tuple[int, int], list[tuple[np.ndarray, BeamState]]] = {}

    def finish(self, out: tuple[BeamState, jax.Array], chunk: np.ndarray, width: int) -> None:
        """Read a batch back: results of its done sources, the others into a pool."""
        state, done = out
        n = self.search.n_best
        done, tokens, scores = fetch((done, state.fin_seqs[:, :n], state.fin_scores[:, :n]))
        count = 0
        for r, j in enumerate(chunk):
            if done[r]:
                hyps = hypotheses(tokens[r], scores[r])
                self.results[self.nonempty[j]] = hyps
                count += len(hyps[0].tokens) + 1 if hyps else 0
        carried = np.flatnonzero(~done[: len(chunk)])
        if carried.size:
            room = state.live_seqs.shape[2]
            kept = take_sources(fetch(state), carried)
            self.pools.setdefault((width, room), []).append((chunk[carried], kept))
        if self.progress is not None:
            self.progress(len(chunk) - carried.size, count)

    def carried_batches(
        self, full_rows: Callable[[int], int], multiple: int, min_rows: int = MIN_ROWS
    ):
        """(sources, joined state, width, next room) of the pooled sources, earliest stage
        first, in batches of at most full_rows(width) rows."""
        while self.pools:
            width, room = min(self.pools, key=lambda key: (key[1], key[0]))
            parts = self.pools.pop((width, room))
            rooms = stage_rooms(width, self.max_len)
            next_room = rooms[rooms.index(room) + 1]
            chunks = np.concatenate([c for c, _ in parts])
            state = parts[0][1] if len(parts) == 1 else None
            limit = full_rows(width)
            for lo in range(0, len(chunks), limit):
                pick = np.arange(lo, min(lo + limit, len(chunks)))
                rows = _round_rows(len(pick), limit, multiple, min_rows)
                picked = _pick(parts, pick) if state is None else [take_sources(state, pick)]
                yield chunks[pick], join_sources(picked, width, rows), width, next_room


def _round_rows(n: int, limit: int, multiple: int, min_rows: int = MIN_ROWS) -> int:
    """Rows for n carried sources: a power of two >= n (at least `min_rows`), at most
    `limit`, a multiple of `multiple`."""
    rows = min(max(min_rows, 1 << (n - 1).bit_length()), max(limit, n))
    return -(-rows // multiple) * multiple


def _pick(parts: list[tuple[np.ndarray, BeamState]], pick: np.ndarray) -> list[BeamState]:
    """The states of positions `pick` of the concatenated parts."""
    out, base = [], 0
    for chunk, state in parts:
        mine = pick[(pick >= base) & (pick < base + len(chunk))] - base
        if mine.size:
            out.append(take_sources(state, mine))
        base += len(chunk)
    return out


def run_stages(
    search: Search,
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
    min_rows: int = MIN_ROWS,
) -> list[list[Any]]:
    """Per source, in input order, its hypotheses (inference.hypothesis.Hypothesis).

    sources: EOS-terminated id lists of at most max_len tokens; an empty one gets
    no hypotheses without running the model. min_rows: the fewest rows of a batch
    (data.plans.plan_translation): 1 for a dev set translated at every evaluation.
    """
    check_lengths(sources, max_len)
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    multiple = rows_multiple(sharding)
    plan = plan_translation(
        [len(sources[i]) for i in nonempty],
        batch_tokens=batch_tokens,
        max_len=max_len,
        rows_multiple=multiple,
        min_rows=min_rows,
    )
    stages = _Stages(search, sources, nonempty, max_len, progress)
    pending = None
    for chunk, width, rows in plan:
        src = batch_of(sources, [nonempty[j] for j in chunk], rows, width)
        out = search.start(place(src, sharding), stage_rooms(width, max_len)[0])
        # Dispatch is asynchronous: the next batch is queued before this one is read.
        if pending is not None:
            stages.finish(*pending)
        pending = (out, chunk, width)
    if pending is not None:
        stages.finish(*pending)
    full_rows = lambda width: max(1 << (max(batch_tokens // width, 1).bit_length() - 1), min_rows)
    for chunk, state, width, room in stages.carried_batches(full_rows, multiple, min_rows):
        stages.finish(search.resume(place(state, sharding), room), chunk, width)
    return stages.results

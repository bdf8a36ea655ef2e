"""A batch's beam search in segments, its rows shrinking as its sources finish.

    row_ladder(64)                                        # [64, 32, 16, 8, 4]
    tokens, scores, met, counts = shrinking(search, src, rooms, beam_size=4, ...)

A batch of B sources runs until all of them are finished, but most finish long
before the slowest (on Ding, 89% within the first 16 steps past the width). So the
search runs in segments: each ends as soon as the unfinished sources fit the next
row count of a fixed ladder (`row_ladder`: B, B/2, ..., 4), or when the room for
tokens is full; the next segment goes on with the unfinished sources alone, in
that many rows (search/beam.py `select`), grown to the next room if it was full.
A source's results do not depend on the others in its batch, so the results are
the batch's as one program would give them, while the beam-row steps run stay
close to those the sources need. The programs are one per (rows, room) reached,
fixed by the batch's shape: a warm job compiles nothing. A batch of fewer than
`SHRINK_FROM` rows (a request of a few lines) runs whole, in one program.

Each segment's end is read by the host (which sources are left: a few bytes), so a
batch's search holds its thread; search/stages.py runs batches on several threads,
so that one batch computes while the host reads another's (and on a CPU, where one
small step barely uses a second core, batches run side by side on the cores).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from attention_jax.search import timing
from attention_jax.search.constraints import Controls
from attention_jax.search.settings import SearchSettings


class SegmentedSearch(Protocol):
    """A search run in segments (search/translate.py `LiveSearch`), with its `settings`.

    start(src [B, S], room, controls, until) -> (state, report) and
    resume(state, keep [B'], room, until) -> (state, report): the search from its first
    step, or of the sources `keep` of `state` alone (grown to `room`), until at most
    `until` sources are unfinished or `room` tokens are decoded. report: (left [B] bool,
    step [], tokens [B, n, C], scores [B, n], met [B, n, Q], ended [B] int32)
    (search/decoding.py `segment_results`).
    """

    settings: SearchSettings

    def start(
        self, src: jax.Array, room: int, controls: Controls | None, until: int
    ) -> tuple[Any, tuple[jax.Array, ...]]: ...

    def resume(
        self, state: Any, keep: jax.Array, room: int, until: int
    ) -> tuple[Any, tuple[jax.Array, ...]]: ...


# The fewest rows a batch shrinks to. Each row count is a program to compile, and below
# a few sources a step costs about what it does with a few (its fixed cost dominates).
FEWEST_ROWS = 4
# A batch of fewer rows (a request of a few lines) runs its whole search in one program
# (search/stages.py): it has too few rows to gain back what more programs cost to compile.
SHRINK_FROM = 16


def shrinks(search: Any, rows: int) -> bool:
    """Whether a batch of `rows` sources searches in segments with `search` (one that can:
    `SegmentedSearch`), or whole, in one program."""
    return hasattr(search, "start") and rows >= SHRINK_FROM


def row_ladder(rows: int, multiple: int = 1) -> list[int]:
    """The row counts a batch of `rows` sources shrinks through: halving, each a multiple
    of `multiple` (the devices its rows are split over), down to `FEWEST_ROWS` (or the
    multiple, if larger)."""
    floor = max(FEWEST_ROWS, multiple)
    ladder = [rows]
    while ladder[-1] > floor:
        half = max(-(-ladder[-1] // 2 // multiple) * multiple, floor)  # rounded up
        if half >= ladder[-1]:
            break
        ladder.append(half)
    return ladder


@dataclasses.dataclass
class RowCounts:
    """Beam-row steps of a search: run (rows x steps, each row K beams), and needed (each
    source's K beams for the steps until its search ended)."""

    run: int = 0
    needed: int = 0


# Per batch: tokens [B, n, L], scores [B, n], met [B, n, Q] (None without phrases), counts
Found = tuple[np.ndarray, np.ndarray, np.ndarray | None, RowCounts]


def shrinking(
    search: SegmentedSearch,
    src: Any,
    rooms: Sequence[int],
    *,
    controls: Any = None,
    multiple: int = 1,
    beam_size: int,
    place: Callable[[Any], Any],
    fetch: Callable[[Any], Any],
    sources: int | None = None,
) -> Found:
    """One batch's search: src [B, S] (numpy) through `rooms` (search/stages.py
    `stage_rooms`), controls (placed) the sources' prefixes and phrases. place: numpy ->
    device arrays (the rows split over `multiple` devices); fetch: the reverse. sources:
    how many of the B rows are real (the rest are filler: they count in the steps run,
    not in those needed)."""
    rows = src.shape[0]
    ladder = row_ladder(rows, multiple)
    below = lambda r: next((x for x in ladder if x < r), 0)  # the next row count down
    length, room = rooms[-1], 0  # room: index into rooms
    holder = np.arange(rows)  # batch row of each state row (-1: a row kept as filler)
    counts, real = RowCounts(), rows if sources is None else sources
    pieces: list[tuple[np.ndarray, tuple[np.ndarray, ...]]] = []  # (batch rows, results)
    with timing.search_call() as call:
        state, report = search.start(place(src), rooms[0], controls, below(rows))
        call.dispatched(report)
    before = 0
    while True:
        with timing.phase("fetch"):
            left, step = fetch(report[:2])
        step = int(step)
        counts.run += len(holder) * (step - before) * beam_size
        before, n = step, int(left.sum())
        shrink = n <= below(len(holder))
        if n == 0 or shrink:  # the finished rows leave: keep their results
            *out, ended = fetch(report[2:])
            going = ~left & (holder >= 0)
            pieces.append((holder[going], tuple(x[going] for x in out)))
            counts.needed += int(np.sum(ended[going & (holder < real)])) * beam_size
        if n == 0:
            break
        target = len(holder)
        if shrink:
            target = min(r for r in ladder if r >= n)
            stay = np.flatnonzero(left)
            filler = np.flatnonzero(~left)[: target - n]
            keep = np.concatenate([stay, filler]).astype(np.int32)
            holder = np.concatenate([holder[stay], np.full(len(filler), -1)])
        else:
            keep = np.arange(target, dtype=np.int32)
        if step >= rooms[room]:
            room += 1
        with timing.search_call() as call:
            state, report = search.resume(state, place(keep), rooms[room], below(target))
            call.dispatched(report)
    return (*_assemble(pieces, rows, length), counts)


def _assemble(
    pieces: list[tuple[np.ndarray, tuple[np.ndarray, ...]]], rows: int, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The batch's tokens, scores and met in row order, tokens padded to `length`
    columns, from (batch rows, their results) pieces."""
    _, (tokens, scores, met) = pieces[0]
    n, q = scores.shape[1], met.shape[2]
    all_tokens = np.zeros((rows, n, length), tokens.dtype)
    all_scores = np.full((rows, n), -np.inf, scores.dtype)
    all_met = np.zeros((rows, n, q), bool)
    for where, (tokens, scores, met) in pieces:
        all_tokens[where, :, : tokens.shape[2]] = tokens
        all_scores[where], all_met[where] = scores, met
    return all_tokens, all_scores, all_met if q else None

"""A batch's beam search in segments, its rows shrinking as its sources finish.

    row_ladder(256)                                       # [256, 64, 16, 4]
    row_ladder(2048)                                      # [2048, 1024, 512, 256, 64, 16, 4]
    tokens, scores, met, counts = shrinking(search, src, rooms, beam_size=4, ...)

A batch of B sources runs until all of them are finished, but most finish long
before the slowest (on Ding, most within 16 steps past the width). Where batches are
not pooled (search/pool.py: on a GPU or TPU, or across devices), the search
runs in segments, down a fixed ladder of row counts (`row_ladder`: halves down to
256 rows, then quarters down to 4). The first segment has room for rooms[0] tokens;
it ends when the unfinished sources fit the next rung, or when its room is full, and
the search is then grown to its last room, the length every source ends by. Each
later segment ends when the unfinished sources fit the next rung; its rows then go
down the ladder, a rung at a time (search/beam.py `select`: the unfinished sources
first, then filler), and the next segment goes on with them. A source's results do
not depend on the others in its batch, so the results are the batch's as one program
would give them, while the beam-row steps run stay close to those the sources need.

The programs of a batch shape are fixed: its start, the growth, and a step loop and a
selection per rung, whichever of them a batch happens to reach, so `prepare` compiles
them all (search/segments.py `prepare_segments`) and a warm job compiles nothing. A
batch of fewer than `SHRINK_FROM` rows (a request of a few lines), and one whose rows
are split over several devices (all of them must run the same programs in the same
order), runs whole, in one program. `pooled_slots` and `shrinks` say which way a batch
goes (search/stages.py).

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

    start(src [B, S], room, controls, until): the search from its first step, with room
    for `room` tokens; grow(state, room): the same search with more room;
    select(state, keep [B']): the search of the sources `keep` alone; advance(state,
    until): the search on. A segment (start, advance) runs until at most `until` sources
    are unfinished or its room is full, and returns (state, report). report: (left [B]
    bool, step [], tokens [B, n, C], scores [B, n], met [B, n, Q], ended [B] int32)
    (search/segments.py `segment_results`).
    """

    settings: SearchSettings

    def start(
        self, src: jax.Array, room: int, controls: Controls | None, until: int
    ) -> tuple[Any, tuple[jax.Array, ...]]: ...

    def grow(self, state: Any, room: int) -> Any: ...

    def select(self, state: Any, keep: jax.Array) -> Any: ...

    def advance(self, state: Any, until: int) -> tuple[Any, tuple[jax.Array, ...]]: ...


# The fewest rows a batch shrinks to. Each row count is a program to compile, and below
# a few sources a step costs about what it does with a few (its fixed cost dominates).
FEWEST_ROWS = 4
# Each rung of the ladder has this many times fewer rows than the one above: quarters
# run about as fast as halves (at most four times the rows needed, but for fewer steps)
# with half the rungs, each a step loop to compile (docs/searching.md).
RUNG_RATIO = 4
# Above this many rows a rung has half the rows of the one above instead: a big batch
# (an accelerator's) spends most of its steps with many sources left, so the rows that
# halves save there pay for their extra programs (docs/searching.md: the beam-row steps
# at --batch_tokens=32768). Smaller batches go down in quarters.
HALVE_ABOVE = 256
# A batch of fewer rows (a request of a few lines) runs its whole search in one program
# (search/stages.py): it has too few rows to gain back what more programs cost to compile.
SHRINK_FROM = 16


def pooled_slots(search: Any, rows: int, width: int, devices: int = 1) -> int:
    """The slots in which a batch of `rows` sources of width `width`, split over
    `devices`, is searched as a queue with `search` (one that can: `slots` and `pooled`,
    search/pool.py), or 0: searched whole or in segments."""
    return search.slots(rows, width) if hasattr(search, "slots") and devices == 1 else 0


def shrinks(search: Any, rows: int, devices: int = 1) -> bool:
    """Whether a batch of `rows` sources, split over `devices`, searches in segments with
    `search` (one that can: `SegmentedSearch`), or whole, in one program."""
    return hasattr(search, "start") and rows >= SHRINK_FROM and devices == 1


def row_ladder(rows: int) -> list[int]:
    """The row counts a batch of `rows` sources shrinks through: each half the one above
    while that has more than `HALVE_ABOVE`, else `RUNG_RATIO` times fewer (rounded up),
    down to `FEWEST_ROWS`."""
    ladder = [rows]
    while ladder[-1] > FEWEST_ROWS:
        ratio = 2 if ladder[-1] > HALVE_ABOVE else RUNG_RATIO
        ladder.append(max(-(-ladder[-1] // ratio), FEWEST_ROWS))
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
    beam_size: int,
    place: Callable[[Any], Any],
    fetch: Callable[[Any], Any],
    sources: int | None = None,
) -> Found:
    """One batch's search: src [B, S] (numpy) through `rooms` (search/stages.py
    `stage_rooms`: its first and last are used), controls (placed) the sources' prefixes
    and phrases. place: numpy -> device arrays; fetch: the reverse. sources: how many of
    the B rows are real (the rest are filler: they count in the steps run, not in those
    needed)."""
    rows = src.shape[0]
    ladder = row_ladder(rows)
    rung = 0  # the ladder's row count the state has
    below = lambda: ladder[rung + 1] if rung + 1 < len(ladder) else 0  # a segment's end
    holder = np.arange(rows)  # batch row of each state row (-1: a row kept as filler)
    counts, real = RowCounts(), rows if sources is None else sources
    pieces: list[tuple[np.ndarray, tuple[np.ndarray, ...]]] = []  # (batch rows, results)
    grown = len(rooms) == 1
    with timing.search_call() as call:
        state, report = search.start(place(src), rooms[0], controls, below())
        call.dispatched(report)
    before = 0
    while True:
        with timing.phase("fetch"):
            left, step = fetch(report[:2])
        step = int(step)
        counts.run += len(holder) * (step - before) * beam_size
        before, n = step, int(left.sum())
        if n == 0 or n <= below():  # the finished rows leave: keep their results
            *out, ended = fetch(report[2:])
            going = ~left & (holder >= 0)
            pieces.append((holder[going], tuple(x[going] for x in out)))
            counts.needed += int(np.sum(ended[going & (holder < real)])) * beam_size
        if n == 0:
            break
        with timing.search_call() as call:
            if not grown:  # the first segment's end: room for every source's last token
                state, grown = search.grow(state, rooms[-1]), True
            if n <= below():  # the unfinished first, then filler; a rung at a time
                keep = np.concatenate([np.flatnonzero(left), np.flatnonzero(~left)])
                holder = np.where(left, holder, -1)[keep]
                while n <= below():
                    rung += 1
                    keep, holder = keep[: ladder[rung]], holder[: ladder[rung]]
                    state = search.select(state, place(keep.astype(np.int32)))
                    keep = np.arange(ladder[rung])
            state, report = search.advance(state, below())
            call.dispatched(report)
    return (*_assemble(pieces, rows, rooms[-1]), counts)


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

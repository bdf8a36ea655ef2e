"""Packed epoch plans: shuffled pairs packed first-fit into rows of `max_length` tokens per side.

    plan = plan_packed(src_len, tgt_len, max_length, rows, rng)          # in memory
    for members, row_sizes in packed_rows(src_len, tgt_len, max_length, rng):
        ...                                                              # or streamed

Part of the batch planner (data/plans.py has the length buckets): a pure
function of the lengths and the seeded generator. The rows come out in order,
chunk after chunk, as soon as no later pair can join them, so a plan can be
written to disk as it is made (data/plan_cache.py): besides the permutation
of the pairs (4 bytes each), planning holds only a chunk of pairs at a time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

# Open rows considered by the packer for each pair (first fit among the newest).
_PACK_WINDOW = 16
# Pairs handed to the packer's Python loop at a time (bounds its list memory).
_PACK_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """An epoch's packed batches: batch j holds rows j*rows_per_batch, ...; row r holds
    the examples `members[row_start[r]:row_start[r + 1]]`."""

    members: np.ndarray  # local example indices, row after row (int32; may be a memmap)
    row_start: np.ndarray  # int64 [num_rows + 1]
    rows_per_batch: int
    num_batches: int

    def __len__(self) -> int:
        return self.num_batches

    def with_batches(self, num_batches: int) -> PackedPlan:
        """This plan with `num_batches` batches (at least its own), the extra ones empty:
        the count the shards of one global batch agreed on."""
        return dataclasses.replace(self, num_batches=max(self.num_batches, int(num_batches)))

    def __getitem__(self, j: int) -> list[list[int]]:
        """Batch j's rows, each a list of local example indices (fewer rows at the end)."""
        num_rows = len(self.row_start) - 1
        first, last = j * self.rows_per_batch, min((j + 1) * self.rows_per_batch, num_rows)
        rs = self.row_start
        return [self.members[rs[r] : rs[r + 1]].tolist() for r in range(first, last)]


def shuffled(n: int, rng: np.random.Generator) -> np.ndarray:
    """A seeded permutation of range(n), int32 when it fits (half of int64's memory).

    The same values as `rng.permutation(n)`: a shuffle's draws depend on n alone.
    """
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    rng.shuffle(order)
    return order


def _first_fit(src_len: list[int], tgt_len: list[int], length: int, state: list[Any]) -> list[int]:
    """Row id of each pair, first fit among the newest _PACK_WINDOW open rows.

    `state` = [open rows' free source tokens, free target tokens, ids, rows so
    far] carries over between chunks; the open rows' ids are always the newest
    ones, consecutive. A plain loop: each pair depends on where the ones before
    it went (free room, not used tokens, saves an addition per row looked at).
    """
    room_s, room_t, ids, num_rows = state
    out = [0] * len(src_len)
    for k, (ls, lt) in enumerate(zip(src_len, tgt_len, strict=True)):
        for w, rs in enumerate(room_s):
            if rs >= ls and room_t[w] >= lt:
                room_s[w] = rs - ls
                room_t[w] -= lt
                out[k] = ids[w]
                break
        else:
            room_s.append(length - ls)
            room_t.append(length - lt)
            ids.append(num_rows)
            out[k] = num_rows
            num_rows += 1
            if len(ids) > _PACK_WINDOW:
                del room_s[0], room_t[0], ids[0]
    state[3] = num_rows
    return out


def packed_rows(
    src_len: np.ndarray, tgt_len: np.ndarray, length: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The packed rows of one epoch, in order, a chunk of pairs at a time.

    `src_len`/`tgt_len` [n] include EOS (each <= length). The pairs are taken in
    a seeded shuffled order and placed first fit among the newest open rows.
    Yields (members, sizes): the example indices of the rows that no later pair
    can join any more, row after row (each row's pairs in the order they were
    placed), and each of those rows' pair count [rows]. Memory besides the
    permutation: one chunk of pairs and the open rows' pairs.
    """
    order = shuffled(len(src_len), rng)
    state: list[Any] = [[], [], [], 0]
    # Pairs placed in rows that may still grow: (example indices, row ids).
    open_members, open_rows = order[:0], np.zeros(0, np.int64)
    done = 0  # rows below this id have been yielded
    for lo in range(0, len(order), _PACK_CHUNK):
        idx = order[lo : lo + _PACK_CHUNK]
        placed = _first_fit(src_len[idx].tolist(), tgt_len[idx].tolist(), length, state)
        members = np.concatenate([open_members, idx])
        rows = np.concatenate([open_rows, np.array(placed, np.int64)])
        last = lo + len(idx) == len(order)
        # The open rows are the newest len(state[2]) ones; the rest are full for good.
        closed_below = state[3] if last else state[3] - len(state[2])
        closed = rows < closed_below
        local = rows[closed] - done  # row ids from 0 for the rows closed now
        by_row = np.argsort(local, kind="stable")  # a chunk's worth, not the epoch's
        yield members[closed][by_row], np.bincount(local, minlength=closed_below - done)
        open_members, open_rows = members[~closed], rows[~closed]
        done = closed_below


def plan_packed(
    src_len: np.ndarray,
    tgt_len: np.ndarray,
    length: int,
    rows: int,
    rng: np.random.Generator,
) -> PackedPlan:
    """Packs shuffled examples into rows of `length` tokens per side (in memory).

    `src_len`/`tgt_len` include EOS. First fit among the newest open rows keeps
    it linear in the corpus size while filling rows well.
    """
    n = len(src_len)
    members = np.empty(n, np.int32 if n < 2**31 else np.int64)  # every pair is in one row
    pos, sizes = 0, [np.zeros(0, np.int64)]
    for m, s in packed_rows(src_len, tgt_len, length, rng):
        members[pos : pos + len(m)] = m
        pos += len(m)
        sizes.append(s)
    row_sizes = np.concatenate(sizes)
    row_start = np.zeros(len(row_sizes) + 1, np.int64)
    np.cumsum(row_sizes, out=row_start[1:])
    return PackedPlan(members, row_start, rows, math.ceil(len(row_sizes) / rows))

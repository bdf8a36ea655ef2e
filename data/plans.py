"""The batch planner: which examples go into which batch, from their lengths alone.

Training and the dev loss (token-budget batches in length buckets, or packed rows):

    buckets = fit_buckets(histogram, rows, count)           # widths fitted to the corpus
    buckets = length_buckets(max_length, widths)            # or given ones (eval: a rule)
    plan = plan_bucketed(None, bucket_of, rows, rng)        # batch j -> (bucket, example indices)
    plan = plan_packed(src_len, tgt_len, max_length, rows, rng)   # data/packing.py

Translation and alignment (batches of a few static shapes, so that a file of any
size compiles a handful of programs):

    for indices, width, rows in plan_translation(lengths, batch_tokens=4096, max_len=256): ...
    for indices, key, rows in plan_static(keys, full_rows=lambda key: 32): ...

A plan is a pure function of the lengths and the seeded generator, so an
epoch's batches can be recomputed exactly on resume; it holds a few bytes per
example (int32 indices), never the tokens. Both kinds of training plans come
out piece by piece (`bucket_members`, `data.packing.packed_rows`), so that an
epoch's plan can be written to disk as it is made and mapped back at a restart
(data/plan_cache.py). Nothing here talks to other
processes: shards that must plan the same number of batches (every process of
a job) agree on their counts first and pass them in (`min_counts`; for packed
plans `PackedPlan.with_batches`), as training/input.py does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from attention_jax.runtime.errors import UserError

# The narrowest bucket, and the step between bucket widths up to 12 steps wide
# (48 tokens); from there the step doubles whenever the width doubles.
_MIN_BUCKET = 8
_BUCKET_STEP = 4


def length_buckets(max_length: int, buckets: Sequence[int] = ()) -> np.ndarray:
    """Padded lengths: `buckets` below max_length, plus max_length.

    Default: 8, 12, ..., 48 (steps of 4), then 56, ..., 96 (8), 112, ..., 192
    (16), 224, 256, ... (32): from 24 tokens on each width is at most 1/6 above
    the one before, so the longer side of a pair pads under 1/7 of its width. 13
    shapes for max_length 64, 25 for 256; a WMT-like corpus pads far fewer of its
    slots than with powers of two (docs/data.md compares schemes).
    """
    if buckets:
        b = sorted({int(x) for x in buckets if int(x) < max_length})
    else:
        b, width, step = [], _MIN_BUCKET, _BUCKET_STEP
        while width < max_length:
            b.append(width)
            if width >= 12 * step:
                step *= 2
            width += step
    return np.array([*b, max_length], np.int64)


def fit_buckets(histogram: np.ndarray, rows: np.ndarray, count: int) -> np.ndarray:
    """At most `count` widths whose batches use the fewest slots in an epoch.

    histogram[w]: pairs whose longer side (EOS/BOS included) is w tokens; rows[w]:
    rows of a batch of width w. Each pair goes to the narrowest width that holds
    it, and a width's n pairs fill ceil(n / rows[w]) batches of rows[w] * w
    slots: the sum over widths is minimized exactly by dynamic programming over
    the widths from the shortest pair's length to the longest's (which is the
    widest). A width that saves less than its partly filled last batch costs is
    left out, so a small corpus gets few shapes. Integer arithmetic and
    first-minimum ties: every process fitting the same histogram gets the same
    widths. O(count * L^2) for L candidate widths: a fraction of a second at 256.
    """
    h = np.asarray(histogram, np.int64)
    if not h.any() or count < 1:
        raise UserError("cannot fit length buckets: no lengths, or count < 1")
    # Candidate widths: every length from the shortest pair to the longest (a width
    # that holds no pair is never chosen: it costs nothing and saves nothing).
    cand = np.arange(np.flatnonzero(h)[0], np.flatnonzero(h)[-1] + 1)
    covered = np.cumsum(h)[cand]  # pairs whose longer side is <= cand[i]

    def slots(i: int, n: Any) -> Any:  # of n pairs in batches of width cand[i]
        r = int(rows[cand[i]])
        return -(-n // r) * r * cand[i]

    m, k_max = len(cand), min(int(count), len(cand))
    # best[i]: fewest slots for the pairs up to cand[i] with at most k widths, the
    # widest being cand[i]; prev[k, i]: index of the width below it (-1: none,
    # -2: the best with k - 1 widths, which a k-th width does not beat).
    best = np.array([slots(i, covered[i]) for i in range(m)], np.int64)
    prev = np.full((k_max + 1, m), -2, np.int64)
    prev[1] = -1
    for k in range(2, k_max + 1):
        new = best.copy()
        for i in range(k - 1, m):
            cost = best[:i] + slots(i, covered[i] - covered[:i])
            j = int(np.argmin(cost))
            if cost[j] < new[i]:
                new[i], prev[k, i] = cost[j], j
        best = new
    widths, k, i = [], k_max, m - 1
    while i >= 0:
        if prev[k, i] == -2:
            k -= 1
            continue
        widths.append(int(cand[i]))
        i, k = int(prev[k, i]), k - 1
    return np.array(widths[::-1], np.int64)


def bucket_of(buckets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Index of the narrowest bucket that holds each length, as uint8 (a lookup table:
    no int64 temporary the size of the corpus)."""
    table = np.searchsorted(buckets, np.arange(int(buckets[-1]) + 1))
    return table.astype(np.min_scalar_type(len(buckets)))[lengths]


def rows_per_batch(budget: int, length: int, multiple: int) -> int:
    """Rows of `length` tokens that fit `budget`, rounded down to a multiple of `multiple`."""
    rows = (budget // length) // multiple * multiple
    if rows < multiple:
        raise UserError(
            f"batch_tokens per process ({budget}) cannot hold {multiple} rows of "
            f"{length} tokens: raise batch_tokens or lower max_length"
        )
    return rows


def epoch_rng(seed: int, shuffle_seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, shuffle_seed, epoch, stream])


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """An epoch's bucketed batches: batch j is `members[start[j]:stop[j]]` in bucket[j]."""

    bucket: np.ndarray  # int64 [num_batches]
    start: np.ndarray  # int64 [num_batches]
    stop: np.ndarray  # int64 [num_batches]
    members: np.ndarray  # local example indices, batch after batch

    def __len__(self) -> int:
        return len(self.bucket)

    def __getitem__(self, j: int) -> tuple[int, np.ndarray]:
        """(bucket, local example indices) of batch j (empty for a filler batch)."""
        return int(self.bucket[j]), self.members[self.start[j] : self.stop[j]]

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        return (self[j] for j in range(len(self)))


def bucket_batches(
    bucket_sizes: np.ndarray, rows: Sequence[int], carry_over: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(pairs batched in each bucket, batches of each bucket) for buckets holding
    `bucket_sizes` pairs: with `carry_over`, what a bucket's full batches leave
    over moves to the next wider one (see `plan_bucketed`). A function of the
    sizes alone, so other shards' batch counts can be known without their plans.
    """
    rows_k = np.asarray(rows, np.int64)
    batched = np.asarray(bucket_sizes, np.int64).copy()
    if carry_over:
        carried = 0
        for k in range(len(batched) - 1):
            total = carried + batched[k]
            batched[k], carried = total // rows_k[k] * rows_k[k], total % rows_k[k]
        batched[-1] += carried
    return batched, -(-batched // rows_k)


def bucket_members(
    lengths: np.ndarray | None,
    bucket_of: np.ndarray,
    sizes: np.ndarray,
    rng: np.random.Generator | None,
) -> Iterator[np.ndarray]:
    """The batched members of each bucket in turn: the pieces of `BucketPlan.members`.

    Bucket k's pairs (with those carried over from narrower buckets first) are
    shuffled with `rng` (None: sorted by `lengths`, for eval); its first
    `sizes[k]` (see `bucket_batches`) are yielded, int32 [sizes[k]], and the
    rest carry over to bucket k + 1. Memory: one bucket's pairs at a time.
    """
    dtype = np.int32 if len(bucket_of) < 2**31 else np.int64
    carried = np.zeros(0, dtype)
    for k in range(len(sizes)):
        m = np.concatenate([carried, np.flatnonzero(bucket_of == k).astype(dtype)])
        if rng is not None:
            rng.shuffle(m)
        else:
            m = m[np.argsort(lengths[m], kind="stable")]
        yield m[: sizes[k]]
        carried = m[sizes[k] :]


def bucket_table(
    members: np.ndarray, sizes: np.ndarray, counts: np.ndarray, rows: Sequence[int]
) -> BucketPlan:
    """The batches of `members` (bucket after bucket, `sizes[k]` pairs in bucket k) cut
    into `counts[k]` batches of `rows[k]` rows per bucket; batches beyond a bucket's
    pairs are empty (filler batches). Per-batch arrays only: cheap to recompute."""
    rows_k, sizes = np.asarray(rows, np.int64), np.asarray(sizes, np.int64)
    counts = np.asarray(counts, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    bucket = np.repeat(np.arange(len(rows_k)), counts)
    j = np.arange(len(bucket)) - np.repeat(np.cumsum(counts) - counts, counts)
    size_b, rows_b, off_b = sizes[bucket], rows_k[bucket], offsets[bucket]
    start = off_b + np.minimum(j * rows_b, size_b)
    stop = off_b + np.minimum((j + 1) * rows_b, size_b)
    return BucketPlan(bucket, start, stop, members)


def plan_bucketed(
    lengths: np.ndarray | None,
    bucket_of: np.ndarray,
    rows: Sequence[int],
    rng: np.random.Generator | None,
    carry_over: bool = False,
    min_counts: np.ndarray | None = None,
) -> BucketPlan:
    """Cuts examples into (bucket, local example indices) batches, in bucket order.

    Each bucket's members are shuffled with `rng` before they are cut (None:
    sorted by `lengths`, for eval). With `carry_over`, the pairs left over
    after a bucket's full batches join the next wider bucket instead of a
    partly filled batch, so only the widest bucket has one (a wider row holds
    them; without it, each bucket's last batch is padded with all-zero rows).
    Each bucket gets at least `min_counts` batches (the counts the shards of
    one global batch agreed on; see `bucket_batches`): the extra ones are empty
    filler batches. Memory: 4 bytes per example (int32 members) and a
    bucket-sized temporary, whatever the corpus size.
    """
    n, num_buckets = len(bucket_of), len(rows)
    sizes, counts = bucket_batches(np.bincount(bucket_of, minlength=num_buckets), rows, carry_over)
    members = np.empty(n, np.int32 if n < 2**31 else np.int64)
    pos = 0
    for m in bucket_members(lengths, bucket_of, sizes, rng):
        members[pos : pos + len(m)] = m
        pos += len(m)
    if min_counts is not None:
        counts = np.maximum(counts, min_counts)
    return bucket_table(members, sizes, counts, rows)


# --- Static shapes for inference ---------------------------------------------------------

# Padded source widths for translation, powers of two: padding a source costs encoder
# work and a slightly longer cache (a batch's first room is its width + 16), while
# every width is more programs that every process compiles or loads (each a slow
# compile on a GPU). Against widths ~1.5x apart (8, 12, 16, 24, ...), a
# process's first call on the Ding test is faster (fewer programs to load), and on
# lines of three Ding sentences the two run about as fast (docs/PERFORMANCE.md).
# Same tokens; scores differ slightly (more padding).
INFERENCE_WIDTHS = (8, 16, 32, 64, 128, 256, 512, 1024)
# The rows of the batches of a small input (at most this many sources in all: a
# one-line request), which would otherwise run full batches of filler rows; every
# other batch is full.
MIN_ROWS = 8


def inference_width(n: int, max_len: int) -> int:
    """The padded width of n tokens: the smallest INFERENCE_WIDTHS >= n, at most max_len."""
    return min(next((w for w in INFERENCE_WIDTHS if w >= n), max_len), max_len)


def inference_widths(max_len: int) -> list[int]:
    """Every width `inference_width` gives for a model of `max_len` positions."""
    return [w for w in INFERENCE_WIDTHS if w < max_len] + [max_len]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_static(
    keys: Sequence[Any],
    *,
    full_rows: Callable[[Any], int],
    rows_multiple: int = 1,
    order: Sequence[int] | None = None,
    widest_first: bool = False,
    min_rows: int = MIN_ROWS,
) -> list[tuple[np.ndarray, Any, int]]:
    """Batches of static shapes: items grouped by shape, each shape's batches of two sizes.

    Args:
      keys: per item, its padded shape (a width, or a tuple of widths).
      full_rows: rows B of a full batch of that shape (a multiple of `rows_multiple`).
      rows_multiple: every batch's row count is a multiple of this (the devices of
        a mesh's batch axes).
      order: the items in the order they fill batches (default: input order).
      widest_first: shapes in decreasing order (default: increasing).
      min_rows: the rows of every batch of a small input (see below).
    Returns:
      (item indices [n] int64, shape, rows B) per batch, n <= B. Every batch of a shape
      has full_rows(shape) rows (a last one filled up with filler rows), whatever the
      number of items: the programs a stream of items needs depend on the shapes
      present, never on how many items there are or how the stream is cut into calls.
      Only an input of at most `min_rows` items in all (a one-line request) has batches
      of `min_rows` rows (rounded up to `rows_multiple`; at most the full rows).
    """
    groups: dict[Any, list[int]] = {}
    for i in range(len(keys)) if order is None else order:
        groups.setdefault(keys[i], []).append(int(i))
    small = _round_up(max(min_rows, 1), rows_multiple)
    few = sum(len(items) for items in groups.values()) <= small
    batches = []
    for key in sorted(groups, reverse=widest_first):
        items, full = np.asarray(groups[key], np.int64), full_rows(key)
        rows = min(small, full) if few else full
        for start in range(0, len(items), full):
            batches.append((items[start : start + full], key, rows))
    return batches


def plan_translation(
    lengths: Sequence[int],
    *,
    batch_tokens: int,
    max_len: int,
    rows_multiple: int = 1,
    min_rows: int = MIN_ROWS,
) -> list[tuple[np.ndarray, int, int]]:
    """Sources to translate in batches of static shape; longest first.

    Args:
      lengths: tokens per source (EOS included); all in [1, max_len].
      batch_tokens: budget of padded source tokens per batch (rows * width).
      max_len: the model's longest position.
      rows_multiple: every batch's row count is a multiple of this.
      min_rows: the rows of the batches of an input of at most this many sources (a
        one-line request runs MIN_ROWS rows, not a full batch).
    Returns:
      (indices into `lengths`, width S, rows B) per batch, with len(indices) <= B.
      Full batches have B = the largest power of two with B * S <= batch_tokens
      (at least `rows_multiple`); a width's last batch has those rows too, and
      every batch of a small input `min_rows` (`plan_static`). Equal lengths keep
      their input order.
    """
    lengths = np.asarray(lengths, np.int64)

    def full_rows(width: int) -> int:
        fit = 1 << (max(batch_tokens // width, 1).bit_length() - 1)  # power of two <= budget
        return _round_up(fit, rows_multiple)

    return plan_static(
        [inference_width(int(n), max_len) for n in lengths],
        full_rows=full_rows,
        rows_multiple=rows_multiple,
        order=np.argsort(-lengths, kind="stable"),
        widest_first=True,
        min_rows=min_rows,
    )

"""Batch assembly: padded numpy batches gathered from a tokenized shard by index arithmetic.

    batch = assemble_bucketed(tc, example_indices, num_rows, width)    # [B, L] per key
    batch = assemble_packed(tc, rows_of_example_indices, num_rows, max_length)

The batch format is described in data/pipeline.py. Only numpy: reading a batch
touches the few pages of the memory-mapped cache that hold its pairs.
"""

from __future__ import annotations

import numpy as np

from attention_jax.data.tokenized import TokenizedCorpus
from attention_jax.tokens import BOS_ID, EOS_ID


def _gather(
    flat: np.ndarray, start: np.ndarray, n: np.ndarray, length: int, prefix: int, suffix: int
) -> np.ndarray:
    """[B, length] rows: optional prefix token, the first n[b] ids, optional suffix, zeros.

    prefix/suffix are a token id or -1 for none. Rows with n < 0 are all padding.
    """
    j = np.arange(length)[None, :]
    shift = 1 if prefix >= 0 else 0
    body = j - shift
    in_body = (body >= 0) & (body < n[:, None])
    pos = np.clip(start[:, None] + body, 0, max(len(flat) - 1, 0))
    out = np.where(in_body, flat[pos] if len(flat) else 0, 0)
    real = n[:, None] >= 0
    if prefix >= 0:
        out = np.where((j == 0) & real, prefix, out)
    if suffix >= 0:
        out = np.where((body == n[:, None]) & real, suffix, out)
    return out.astype(np.int32)


def assemble_bucketed(
    tc: TokenizedCorpus, rows_idx: np.ndarray, num_rows: int, length: int
) -> dict[str, np.ndarray]:
    """A padded batch [num_rows, length] of examples `rows_idx` (local indices)."""
    idx = np.full(num_rows, -1, np.int64)
    idx[: len(rows_idx)] = rows_idx
    safe = np.maximum(idx, 0)
    valid = idx >= 0
    # Truncation is implicit: at most length - 1 ids leave room for EOS/BOS.
    ns = np.where(valid, np.minimum(tc.src_len[safe], length - 1), -1)
    nt = np.where(valid, np.minimum(tc.tgt_len[safe], length - 1), -1)
    return {
        "src": _gather(tc.src_flat, tc.src_start[safe], ns, length, -1, EOS_ID),
        "tgt_in": _gather(tc.tgt_flat, tc.tgt_start[safe], nt, length, BOS_ID, -1),
        "tgt_out": _gather(tc.tgt_flat, tc.tgt_start[safe], nt, length, -1, EOS_ID),
    }


def _take(flat: np.ndarray, at: np.ndarray) -> np.ndarray:
    """flat[at], positions clipped into flat (zeros if it is empty): the slots that read
    past a pair's ids (its EOS or BOS) are overwritten by the caller."""
    if not len(flat):
        return np.zeros(len(at), np.int32)
    return flat[np.clip(at, 0, len(flat) - 1)]


def _spans(lengths: np.ndarray, rows: np.ndarray, num_rows: int):
    """Where each pair's tokens go in its row: (row, column, pair, position) per token.

    lengths [P] tokens of each pair, rows [P] its row (pairs of a row consecutive, in
    order) -> four [N] arrays, N = lengths.sum(): a pair's tokens follow the earlier
    pairs of its row, position = index within the pair.
    """
    ends = np.cumsum(lengths)  # [P]
    row_first = np.searchsorted(rows, np.arange(num_rows))  # [R] first pair of each row
    before = np.concatenate([[0], ends])[row_first]  # [R] tokens of earlier rows
    pair = np.repeat(np.arange(len(lengths)), lengths)  # [N]
    position = np.arange(lengths.sum()) - (ends - lengths)[pair]
    column = (ends - lengths)[pair] - before[rows[pair]] + position
    return rows[pair], column, pair, position


def assemble_packed(tc: TokenizedCorpus, rows: list[list[int]], num_rows: int, length: int):
    """A packed batch: several pairs per row with segment ids and positions.

    rows: per row, the local indices of its pairs (fitting in `length` tokens each
    side, EOS and BOS included) -> [num_rows, length] int32 per key. Gathered with
    index arithmetic (one read of the cache per array): a Python loop over the
    pairs of a packed batch took the host many times longer per step.
    """
    keys = ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments", "src_positions",
            "tgt_positions")  # fmt: skip
    out = {k: np.zeros((num_rows, length), np.int32) for k in keys}
    sizes = [len(m) for m in rows]
    idx = np.fromiter((i for m in rows for i in m), np.int64, sum(sizes))  # [P] pairs
    row_of = np.repeat(np.arange(len(rows)), sizes)  # [P]
    segment = np.arange(len(idx)) - np.repeat(np.cumsum(sizes) - sizes, sizes) + 1  # [P]
    for side, flat, start, n in (
        ("src", tc.src_flat, tc.src_start, tc.src_len),
        ("tgt", tc.tgt_flat, tc.tgt_start, tc.tgt_len),
    ):
        ids_len = np.minimum(np.asarray(n[idx], np.int64), length - 1)  # [P] ids kept
        r, c, pair, pos = _spans(ids_len + 1, row_of, num_rows)  # +1: EOS or BOS
        first = np.asarray(start[idx], np.int64)[pair]  # [N] the pair's first id
        last = pos == ids_len[pair]  # [N] the extra slot: EOS after src / tgt_out
        body = _take(flat, first + pos)  # the EOS slot reads a neighbour, replaced below
        out[f"{side}_segments"][r, c] = segment[pair]
        out[f"{side}_positions"][r, c] = pos
        if side == "src":
            out["src"][r, c] = np.where(last, EOS_ID, body)
            continue
        out["tgt_out"][r, c] = np.where(last, EOS_ID, body)
        shifted = _take(flat, first + pos - 1)  # the BOS slot likewise
        out["tgt_in"][r, c] = np.where(pos == 0, BOS_ID, shifted)
    return out

"""Batch assembly: padded numpy batches gathered from a tokenized shard by index arithmetic.

    batch = assemble_bucketed(tc, example_indices, num_rows, width)    # [B, L] per key
    batch = assemble_packed(tc, rows_of_example_indices, num_rows, max_length)

The batch format is described in data/pipeline.py. Only numpy: reading a batch
touches the few pages of the memory-mapped cache that hold its pairs.
"""

from __future__ import annotations

import numpy as np

from data.tokenized import TokenizedCorpus
from model.tokens import BOS_ID, EOS_ID


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


def assemble_packed(tc: TokenizedCorpus, rows: list[list[int]], num_rows: int, length: int):
    """A packed batch: several pairs per row with segment ids and positions."""
    out = {
        k: np.zeros((num_rows, length), np.int32)
        for k in (
            "src",
            "tgt_in",
            "tgt_out",
            "src_segments",
            "tgt_segments",
            "src_positions",
            "tgt_positions",
        )
    }
    for r, members in enumerate(rows):
        ps = pt = 0
        for seg, i in enumerate(members, start=1):
            s = tc.src_flat[tc.src_start[i] : tc.src_start[i] + min(tc.src_len[i], length - 1)]
            t = tc.tgt_flat[tc.tgt_start[i] : tc.tgt_start[i] + min(tc.tgt_len[i], length - 1)]
            ls, lt = len(s) + 1, len(t) + 1
            out["src"][r, ps : ps + ls - 1] = s
            out["src"][r, ps + ls - 1] = EOS_ID
            out["tgt_in"][r, pt] = BOS_ID
            out["tgt_in"][r, pt + 1 : pt + lt] = t
            out["tgt_out"][r, pt : pt + lt - 1] = t
            out["tgt_out"][r, pt + lt - 1] = EOS_ID
            out["src_segments"][r, ps : ps + ls] = seg
            out["tgt_segments"][r, pt : pt + lt] = seg
            out["src_positions"][r, ps : ps + ls] = np.arange(ls)
            out["tgt_positions"][r, pt : pt + lt] = np.arange(lt)
            ps, pt = ps + ls, pt + lt
    return out

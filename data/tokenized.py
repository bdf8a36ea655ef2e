"""A tokenized corpus shard as flat arrays, and the chunk encoder that produces it.

    chunk = encode_chunk(pairs, indices, tokenizer, max_length=64, long_pairs="drop")
    tc = concat_chunks([chunk, ...])      # or written to disk and memory-mapped (data/cache.py)

The layout is the one the cache stores and the batch assembly reads (example
i's source ids are `src_flat[src_start[i] : src_start[i] + src_len[i]]`), so
batches built from a cache are the batches built without one. The
`long_pairs` policy is applied here, once: dropped pairs are not stored and
truncated ones keep their first `max_length - 1` ids (room for EOS/BOS).
This module imports only numpy: the cache's worker processes import it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from attention_jax.data.files import drop_mapped_pages
from attention_jax.runtime.errors import UserError

# Arrays of a tokenized corpus, in the order of TokenizedCorpus's fields.
FIELDS = ("src_flat", "src_start", "src_len", "tgt_flat", "tgt_start", "tgt_len", "index")


@dataclasses.dataclass(frozen=True)
class TokenizedCorpus:
    """Token ids of a corpus shard, stored flat (no EOS/BOS).

    Example i's source ids are `src_flat[src_start[i] : src_start[i] + src_len[i]]`;
    `index[i]` is its position in the original corpus. Arrays may be numpy
    memory maps (a cached shard) or in memory.
    """

    src_flat: np.ndarray  # uint16 (vocab <= 65536) or int32 [total source tokens]
    src_start: np.ndarray  # int64 [n]
    src_len: np.ndarray  # int16 (max_length < 32768) or int32 [n]
    tgt_flat: np.ndarray
    tgt_start: np.ndarray
    tgt_len: np.ndarray
    index: np.ndarray  # int64 [n]
    num_dropped: int = 0  # pairs of the shard left out by long_pairs="drop"
    # The cache directory the arrays are mapped from (None: in memory); epoch plans
    # are stored beside them (data/plan_cache.py).
    directory: str | None = None

    def __len__(self) -> int:
        return len(self.index)


def id_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and page cache of int32)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def len_dtype(max_length: int) -> np.dtype:
    return np.dtype(np.int16 if max_length < 1 << 15 else np.int32)


def _flat(seqs: Sequence[Sequence[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flat ids, lengths) of a list of id lists."""
    lens = np.fromiter((len(s) for s in seqs), np.int64, count=len(seqs))
    try:
        flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype, count=int(lens.sum()))
    except OverflowError as e:  # an id the chosen dtype cannot hold
        raise UserError(f"token id out of range for {dtype}: {e}") from e
    return flat, lens


def _starts(lens: np.ndarray, offset: int = 0) -> np.ndarray:
    starts = np.empty(len(lens), np.int64)
    starts[:1] = offset
    np.cumsum(lens[:-1], out=starts[1:])
    starts[1:] += offset
    return starts


def encode_chunk(
    pairs: Sequence[tuple[str, str]],
    indices: np.ndarray,
    tokenizer: Any,
    *,
    max_length: int,
    long_pairs: str,
    ids: np.dtype,
) -> dict[str, Any]:
    """Tokenizes `pairs` (corpus positions `indices`) and applies `long_pairs`.

    Returns {"src": ids, "src_len", "tgt", "tgt_len", "index", "dropped"}:
    flat id arrays of dtype `ids`, lengths (without EOS) and the kept pairs'
    corpus positions.
    """
    src = tokenizer.encode_batch([p[0] for p in pairs])
    tgt = tokenizer.encode_target_batch([p[1] for p in pairs])
    cap = max_length - 1  # EOS (source) or BOS (target input) takes the last slot
    index = np.asarray(indices, np.int64)
    dropped = 0
    if long_pairs == "drop":
        keep = [
            i for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if max(len(s), len(t)) <= cap
        ]
        dropped = len(src) - len(keep)
        if dropped:
            src, tgt, index = [src[i] for i in keep], [tgt[i] for i in keep], index[keep]
    else:  # truncate
        src, tgt = [s[:cap] for s in src], [t[:cap] for t in tgt]
    lens = len_dtype(max_length)
    src_flat, src_len = _flat(src, ids)
    tgt_flat, tgt_len = _flat(tgt, ids)
    return {
        "src": src_flat,
        "src_len": src_len.astype(lens),
        "tgt": tgt_flat,
        "tgt_len": tgt_len.astype(lens),
        "index": index,
        "dropped": dropped,
    }


def concat_chunks(
    chunks: Sequence[dict[str, Any]], ids: np.dtype, lens: np.dtype
) -> TokenizedCorpus:
    """The in-memory TokenizedCorpus of encoded chunks, in order."""

    def cat(key: str, dtype: Any) -> np.ndarray:
        return np.concatenate([c[key] for c in chunks] or [np.zeros(0, dtype)]).astype(dtype)

    src_len, tgt_len = cat("src_len", lens), cat("tgt_len", lens)
    return TokenizedCorpus(
        cat("src", ids),
        _starts(src_len.astype(np.int64)),
        src_len,
        cat("tgt", ids),
        _starts(tgt_len.astype(np.int64)),
        tgt_len,
        cat("index", np.int64),
        num_dropped=sum(int(c["dropped"]) for c in chunks),
    )


def chunk_starts(lens: np.ndarray, offset: int) -> np.ndarray:
    """Start offsets of a chunk's sequences that follow `offset` earlier ids."""
    return _starts(lens.astype(np.int64), offset)


def apply_long_pairs(tc: TokenizedCorpus, max_length: int, long_pairs: str) -> TokenizedCorpus:
    """The policy applied to a corpus tokenized without it (e.g. bench/train.py's synthetic one).

    Dropping selects rows (views into the same flat arrays); truncation is
    implicit in the batch assembly, which reads at most max_length - 1 ids.
    """
    # A memory-mapped shard comes from the cache, which applied the policy when it was
    # built: reading its lengths through the map again would only page them in.
    if long_pairs != "drop" or isinstance(tc.src_len, np.memmap):
        return tc
    too_long = (np.asarray(tc.src_len) >= max_length) | (np.asarray(tc.tgt_len) >= max_length)
    if not too_long.any():
        return tc
    keep = np.flatnonzero(~too_long)
    return TokenizedCorpus(
        tc.src_flat,
        tc.src_start[keep],
        tc.src_len[keep],
        tc.tgt_flat,
        tc.tgt_start[keep],
        tc.tgt_len[keep],
        tc.index[keep],
        num_dropped=tc.num_dropped + len(tc) - len(keep),
    )


def mapped_rss() -> int | None:
    """Bytes of this process's RSS that are pages of mapped files (Linux; else None)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("RssFile:"))
    except (OSError, StopIteration, ValueError):
        return None


def release_pages(tc: TokenizedCorpus) -> None:
    """Unmap from this process the pages of a cached shard that reading has mapped in.

    Batches of random pairs touch pages all over the shard's files, and a process's
    RSS counts every page it has mapped, until it holds the whole cache (gigabytes
    for a large corpus) though none of it is the process's own memory. MADV_DONTNEED on
    these read-only file maps drops the pages from the process, not from the page
    cache: the next read maps them again from memory, the data unchanged.
    """
    drop_mapped_pages(tc.src_flat, tc.src_start, tc.src_len, tc.tgt_flat, tc.tgt_start, tc.tgt_len)


# --- Lengths, as the batch plans see them ----------------------------------------------


def effective_lengths(
    tc: TokenizedCorpus, max_length: int, lo: int = 0, hi: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-side lengths with EOS, capped at max_length (truncation), of pairs lo..hi-1.

    A cached shard's lengths are read from its files rather than through the
    map, so that a pass over them leaves no mapped pages behind.
    """
    hi = len(tc) if hi is None else hi

    def read(a: np.ndarray) -> np.ndarray:
        if isinstance(a, np.memmap) and hi > lo:
            offset = a.offset + lo * a.itemsize
            a = np.fromfile(a.filename, a.dtype, count=hi - lo, offset=offset)
        else:
            a = np.asarray(a[lo:hi])
        return np.minimum(a + 1, max_length)

    return read(tc.src_len), read(tc.tgt_len)


def length_chunks(
    tc: TokenizedCorpus, max_length: int, chunk: int = 1 << 22
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(first pair, source lengths, target lengths) of `effective_lengths`, `chunk` pairs
    at a time: a pass over a shard of any size in bounded memory."""
    for lo in range(0, len(tc), chunk):
        yield lo, *effective_lengths(tc, max_length, lo, lo + chunk)

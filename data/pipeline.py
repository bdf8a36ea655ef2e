"""Batches for the train and eval steps: grain source -> token ids -> bucketed batches.

The corpus is tokenized once (through a grain `MapDataset`, optionally
threaded) into flat numpy arrays. Each epoch then has a *batch plan*: a
seeded shuffle of the examples, cut into batches by token budget within a
few fixed length buckets (or packed into rows of `max_length`). A batch is
assembled from the flat arrays by index arithmetic, so the pipeline is cheap
and its state is just `(epoch, position in the epoch's plan)`.

Batch format (all np.int32; 0 is padding everywhere):
    src      [B, S]  source ids + EOS
    tgt_in   [B, T]  BOS + target ids        (decoder input)
    tgt_out  [B, T]  target ids + EOS        (labels; loss weights = tgt_out != 0)
  with `config.packing`, also
    src_segments, tgt_segments    [B, S] / [B, T]  1, 2, ... per packed pair, 0 on padding
    src_positions, tgt_positions  [B, S] / [B, T]  0-based position within each pair
In a non-packed batch S == T == the bucket length; packed rows use max_length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from data.corpora import DataError
from data.tokenizer import BOS_ID, EOS_ID, Tokenizer

# Pairs per grain element when tokenizing (SentencePiece encodes lists faster).
_ENCODE_CHUNK = 1024
# Open rows considered by the packer for each pair (first fit among the newest).
_PACK_WINDOW = 16
_MIN_BUCKET = 8


# --- Tokenized corpus ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenizedCorpus:
    """Token ids of a corpus shard, stored flat (no EOS/BOS).

    Example i's source ids are `src_flat[src_start[i] : src_start[i] + src_len[i]]`;
    `index[i]` is its position in the original corpus.
    """

    src_flat: np.ndarray  # int32 [total source tokens]
    src_start: np.ndarray  # int64 [n]
    src_len: np.ndarray  # int32 [n]
    tgt_flat: np.ndarray
    tgt_start: np.ndarray
    tgt_len: np.ndarray
    index: np.ndarray  # int64 [n]

    def __len__(self) -> int:
        return len(self.index)


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
    starts = np.zeros(len(seqs), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(lens.sum()))
    return flat, starts, lens


def tokenize_corpus(
    corpus: Any,
    tokenizer: Tokenizer,
    indices: np.ndarray,
    num_threads: int = 0,
) -> TokenizedCorpus:
    """Tokenizes `corpus[i]` for i in `indices` (this process's shard) with grain."""
    indices = np.asarray(indices, np.int64)
    source = grain.MapDataset.source(corpus)
    ds = grain.MapDataset.source(indices).map(lambda i: source[int(i)])
    ds = ds.batch(_ENCODE_CHUNK, batch_fn=list)

    def encode(pairs: list[tuple[str, str]]) -> tuple[list[list[int]], list[list[int]]]:
        return (
            tokenizer.encode_batch([p[0] for p in pairs]),
            tokenizer.encode_batch([p[1] for p in pairs]),
        )

    ds = ds.map(encode)
    if num_threads > 0:
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=8))
    else:
        it = ds
    src, tgt = [], []
    for s, t in it:
        src.extend(s)
        tgt.extend(t)
    return TokenizedCorpus(*_flatten(src), *_flatten(tgt), index=indices)


# --- Buckets and plans -------------------------------------------------------------


def length_buckets(max_length: int, buckets: Sequence[int] = ()) -> np.ndarray:
    """Padded lengths: `buckets`, or powers of two from 8 below max_length, plus max_length."""
    if buckets:
        b = sorted({int(x) for x in buckets if int(x) < max_length})
    else:
        b, x = [], _MIN_BUCKET
        while x < max_length:
            b.append(x)
            x *= 2
    return np.array([*b, max_length], np.int64)


def shard_indices(n: int, process_index: int, process_count: int) -> np.ndarray:
    """The corpus indices this process reads: a strided slice, disjoint across processes."""
    return np.arange(process_index, n, process_count, dtype=np.int64)


def rows_per_batch(budget: int, length: int, multiple: int) -> int:
    """Rows of `length` tokens that fit `budget`, rounded down to a multiple of `multiple`."""
    rows = (budget // length) // multiple * multiple
    if rows < multiple:
        raise DataError(
            f"batch_tokens per process ({budget}) cannot hold {multiple} rows of "
            f"{length} tokens: raise batch_tokens or lower max_length"
        )
    return rows


def _epoch_rng(seed: int, shuffle_seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, shuffle_seed, epoch, stream])


def _global_max(counts: np.ndarray, process_count: int) -> np.ndarray:
    """Element-wise max over processes, so every process runs the same batch shapes."""
    if process_count > 1 and jax.process_count() == process_count:
        from jax.experimental import multihost_utils

        return np.max(multihost_utils.process_allgather(counts), axis=0)
    return counts


def plan_bucketed(
    lengths: np.ndarray,
    bucket_of: np.ndarray,
    rows: Sequence[int],
    rng: np.random.Generator | None,
    process_count: int = 1,
) -> list[tuple[int, np.ndarray]]:
    """Cuts examples into (bucket, local example indices) batches, in bucket order.

    `rng` shuffles examples before they are cut (None keeps them sorted by
    length, for eval). Every process gets the same number of batches per bucket
    (the max over processes); the extra ones are empty filler batches.
    """
    n = len(lengths)
    order = rng.permutation(n) if rng is not None else np.argsort(lengths, kind="stable")
    member_bucket = bucket_of[order]
    per_bucket = [order[member_bucket == k] for k in range(len(rows))]
    counts = np.array(
        [math.ceil(len(m) / r) for m, r in zip(per_bucket, rows, strict=True)], np.int64
    )
    counts = _global_max(counts, process_count)
    plan = []
    for k, (members, r) in enumerate(zip(per_bucket, rows, strict=True)):
        for j in range(int(counts[k])):
            plan.append((k, members[j * r : (j + 1) * r]))
    return plan


def plan_packed(
    src_len: np.ndarray,
    tgt_len: np.ndarray,
    length: int,
    rows: int,
    rng: np.random.Generator,
    process_count: int = 1,
) -> list[list[list[int]]]:
    """Packs shuffled examples into rows of `length` tokens per side.

    `src_len`/`tgt_len` include EOS. Returns batches of `rows` rows, each row a
    list of local example indices. First fit among the newest open rows keeps
    it linear in the corpus size while filling rows well.
    """
    packed: list[list[int]] = []
    used: list[tuple[int, int]] = []
    for i in rng.permutation(len(src_len)).tolist():
        ls, lt = int(src_len[i]), int(tgt_len[i])
        for r in range(max(0, len(packed) - _PACK_WINDOW), len(packed)):
            us, ut = used[r]
            if us + ls <= length and ut + lt <= length:
                packed[r].append(i)
                used[r] = (us + ls, ut + lt)
                break
        else:
            packed.append([i])
            used.append((ls, lt))
    count = math.ceil(len(packed) / rows)
    count = int(_global_max(np.array([count], np.int64), process_count)[0])
    return [packed[j * rows : (j + 1) * rows] for j in range(count)]


# --- Batch assembly ------------------------------------------------------------------


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


def padding_fraction(batch: dict[str, np.ndarray]) -> float:
    """Fraction of padding slots in src and tgt_out together."""
    total = batch["src"].size + batch["tgt_out"].size
    real = np.count_nonzero(batch["src"]) + np.count_nonzero(batch["tgt_out"])
    return 1.0 - real / max(total, 1)


# --- Training iterator ---------------------------------------------------------------


def _resolve_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    pc = jax.process_count() if process_count is None else int(process_count)
    pi = jax.process_index() if process_index is None else int(process_index)
    if not 0 <= pi < pc:
        raise ValueError(f"process_index {pi} not in [0, {pc})")
    return pi, pc


def _effective_lengths(tc: TokenizedCorpus, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-side lengths with EOS, capped at max_length (truncation)."""
    return (
        np.minimum(tc.src_len + 1, max_length).astype(np.int64),
        np.minimum(tc.tgt_len + 1, max_length).astype(np.int64),
    )


class TrainIterator:
    """Infinite iterator over this process's training batches; checkpointable.

    The order of batches in epoch e is a pure function of (config.seed,
    config.shuffle_seed, e), so `get_state()` = {epoch, position} is enough to
    resume exactly at the next batch.
    """

    def __init__(
        self,
        config: Any,
        tokenizer: Tokenizer,
        corpus: Any,
        *,
        batch_multiple: int = 1,
        process_index: int | None = None,
        process_count: int | None = None,
        tokenized: TokenizedCorpus | None = None,
    ):
        self.process_index, self.process_count = _resolve_process(process_index, process_count)
        self.max_length = int(config.max_length)
        self.packing = bool(config.packing)
        self.seed, self.shuffle_seed = int(config.seed), int(config.shuffle_seed)
        if config.long_pairs not in ("drop", "truncate"):
            raise DataError(f"long_pairs must be 'drop' or 'truncate', got {config.long_pairs!r}")
        if tokenized is None:
            shard = shard_indices(len(corpus), self.process_index, self.process_count)
            tokenized = tokenize_corpus(corpus, tokenizer, shard, int(config.data_workers))
        src_len, tgt_len = tokenized.src_len + 1, tokenized.tgt_len + 1
        keep = np.ones(len(tokenized), bool)
        if config.long_pairs == "drop":
            keep = (src_len <= self.max_length) & (tgt_len <= self.max_length)
        self.num_dropped = int((~keep).sum())
        self._tc = _select(tokenized, np.flatnonzero(keep))
        if len(self._tc) == 0:
            raise DataError("no training pairs left after dropping pairs longer than max_length")
        self.src_len, self.tgt_len = _effective_lengths(self._tc, self.max_length)
        self.budget = int(config.batch_tokens) // self.process_count
        self.buckets = length_buckets(self.max_length, tuple(config.length_buckets))
        if self.packing:
            self.rows = [rows_per_batch(self.budget, self.max_length, batch_multiple)]
        else:
            self.rows = [rows_per_batch(self.budget, int(b), batch_multiple) for b in self.buckets]
        self._bucket_of = np.searchsorted(self.buckets, np.maximum(self.src_len, self.tgt_len))
        self.epoch, self.position = 0, 0
        self._real_tokens = self._slots = 0
        self._load_epoch(0)

    # The epoch's batches as a grain MapDataset: random access by position.
    def _load_epoch(self, epoch: int) -> None:
        if self.packing:
            plan = plan_packed(
                self.src_len,
                self.tgt_len,
                self.max_length,
                self.rows[0],
                _epoch_rng(self.seed, self.shuffle_seed, epoch, 0),
                self.process_count,
            )
            make = lambda rows: assemble_packed(self._tc, rows, self.rows[0], self.max_length)
        else:
            plan = plan_bucketed(
                np.maximum(self.src_len, self.tgt_len),
                self._bucket_of,
                self.rows,
                _epoch_rng(self.seed, self.shuffle_seed, epoch, 0),
                self.process_count,
            )
            make = lambda kb: assemble_bucketed(
                self._tc, kb[1], self.rows[kb[0]], int(self.buckets[kb[0]])
            )
        # The plan is in bucket order; shuffle the batches (same seed on every
        # process, and the same number of batches, so shapes agree across hosts).
        order_seed = int(_epoch_rng(self.seed, self.shuffle_seed, epoch, 1).integers(2**31))
        self._epoch_ds = grain.MapDataset.source(plan).shuffle(seed=order_seed).map(make)
        self.epoch = epoch

    @property
    def batches_per_epoch(self) -> int:
        return len(self._epoch_ds)

    @property
    def num_examples(self) -> int:
        """Training pairs in this process's shard (after dropping long ones)."""
        return len(self._tc)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The fixed set of [B, L] batch shapes this iterator produces."""
        if self.packing:
            return [(self.rows[0], self.max_length)]
        return [(r, int(b)) for r, b in zip(self.rows, self.buckets, strict=True)]

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.position >= len(self._epoch_ds):
            self._load_epoch(self.epoch + 1)
            self.position = 0
        batch = self._epoch_ds[self.position]
        self.position += 1
        self._real_tokens += np.count_nonzero(batch["src"]) + np.count_nonzero(batch["tgt_out"])
        self._slots += batch["src"].size + batch["tgt_out"].size
        return batch

    def get_state(self) -> dict[str, int]:
        """JSON-serializable position of the next batch."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle_seed": self.shuffle_seed,
            "num_examples": self.num_examples,
        }

    def set_state(self, state: dict[str, int]) -> None:
        """Resumes so that the next batch is the one after the saved position."""
        if state.get("num_examples", self.num_examples) != self.num_examples:
            raise DataError(
                f"data state was saved for {state['num_examples']} examples, this corpus "
                f"shard has {self.num_examples}: the dataset or its config changed"
            )
        self._load_epoch(int(state["epoch"]))
        self.position = int(state["position"])

    @property
    def padding_fraction(self) -> float:
        """Padding share of the source and target slots of the batches served so far."""
        return float(1.0 - self._real_tokens / self._slots) if self._slots else 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches_per_epoch": self.batches_per_epoch,
            "num_examples": self.num_examples,
            "num_dropped": self.num_dropped,
            "padding_fraction": self.padding_fraction,
            "tokens_served": int(self._real_tokens),
            "shapes": self.shapes,
        }


def _select(tc: TokenizedCorpus, keep: np.ndarray) -> TokenizedCorpus:
    """The examples `keep` (views into the same flat arrays)."""
    return TokenizedCorpus(
        tc.src_flat,
        tc.src_start[keep],
        tc.src_len[keep],
        tc.tgt_flat,
        tc.tgt_start[keep],
        tc.tgt_len[keep],
        tc.index[keep],
    )


def train_iterator(
    config: Any,
    tokenizer: Tokenizer,
    corpus: Any,
    *,
    batch_multiple: int = 1,
    process_index: int | None = None,
    process_count: int | None = None,
) -> TrainIterator:
    """Infinite, checkpointable iterator over this process's training batches.

    Each process reads corpus indices `process_index::process_count` and gets
    about `config.batch_tokens / process_count` tokens per side per batch
    (padding included; never more). B is a multiple of `batch_multiple`.
    """
    return TrainIterator(
        config,
        tokenizer,
        corpus,
        batch_multiple=batch_multiple,
        process_index=process_index,
        process_count=process_count,
    )


# --- Eval -----------------------------------------------------------------------------


def eval_batches(
    config: Any,
    tokenizer: Tokenizer,
    corpus: Any,
    *,
    batch_multiple: int = 1,
    batch_tokens: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Every example of this process's shard exactly once, as (batch, corpus indices).

    Examples longer than max_length are truncated, never dropped. Batches are
    sorted by length (little padding); the indices ([B] int64, -1 for filler
    rows) let the caller put results back in corpus order.
    """
    pi, pc = _resolve_process(process_index, process_count)
    max_length = int(config.max_length)
    tc = tokenize_corpus(corpus, tokenizer, shard_indices(len(corpus), pi, pc))
    src_len, tgt_len = _effective_lengths(tc, max_length)
    lengths = np.maximum(src_len, tgt_len)
    buckets = length_buckets(max_length, tuple(config.length_buckets))
    budget = int(batch_tokens or config.batch_tokens) // pc
    rows = [rows_per_batch(budget, int(b), batch_multiple) for b in buckets]
    plan = plan_bucketed(lengths, np.searchsorted(buckets, lengths), rows, None, pc)
    for k, members in plan:
        batch = assemble_bucketed(tc, members, rows[k], int(buckets[k]))
        index = np.full(rows[k], -1, np.int64)
        index[: len(members)] = tc.index[members]
        yield batch, index


# --- Global arrays ----------------------------------------------------------------------


def to_global_batch(
    batch: dict[str, np.ndarray], mesh: Mesh, batch_axes: Sequence[str] = ("data", "fsdp")
) -> dict[str, jax.Array]:
    """Per-process batches -> global jax.Arrays sharded along dim 0 over `batch_axes`.

    Every process must pass arrays of the same shape; the global batch has
    process_count times as many rows.
    """
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    sharding = NamedSharding(mesh, PartitionSpec(axes if axes else None))
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}

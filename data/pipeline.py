"""Batches for the train and eval steps: tokenized shard -> batch plan -> padded batches.

Each process's shard of the corpus is tokenized once into flat arrays,
memory-mapped from a cache on disk (data/cache.py; built on the first run).
Each epoch then has a *batch plan*, computed from the length arrays alone: a
seeded shuffle of the examples, cut into batches by token budget within a
fixed set of length buckets (or packed into rows of `max_length`). It is made
when the epoch's first batch is asked for, stored beside the cache and mapped
back at later starts (data/plan_cache.py), and the next epoch's is prepared
halfway through this one. A batch is assembled from the flat arrays by index
arithmetic (data/batches.py), so the pipeline is cheap and its state is just
`(epoch, position in the epoch's plan)`.

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

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from attention_jax.data.batches import assemble_bucketed, assemble_packed
from attention_jax.data.cache import ShardSpec, tokenized_shard
from attention_jax.data.plan_cache import EpochPlans, PlanSpec
from attention_jax.data.plans import (
    bucket_batches,
    bucket_of,
    bucket_table,
    epoch_rng,
    fit_buckets,
    length_buckets,
    plan_bucketed,
    rows_per_batch,
)
from attention_jax.data.tokenized import (
    TokenizedCorpus,
    apply_long_pairs,
    effective_lengths,
    length_chunks,
    mapped_rss,
    release_pages,
)
from attention_jax.data.tokenizer import Tokenizer
from attention_jax.runtime.errors import UserError

# grain is imported where it is used, and JAX never: the cache's worker processes
# import this package and need neither (each would cost them start-up time and memory).

# Batch counts -> the counts that every shard of one global batch plans (e.g. the
# max over the job's processes: training/input.py makes it). None: this shard's own.
AgreeCounts = Callable[[np.ndarray], np.ndarray] | None

_log = logging.getLogger(__name__)
# With config.mapped_cache_gb, every this many batches the process's mapped-file RSS
# is read (cheap: one small /proc file), and a cached shard's pages unmapped if it is
# over (data.tokenized.release_pages). Reads map up to 64 KB around each page they
# fault in, so a few batches can map a lot: checked more rarely, the mapped pages
# overshoot the limit by far more (docs/results.md has the measurement).
RELEASE_EVERY = 8


# --- Training iterator ---------------------------------------------------------------


def _check_shard(shard: int, num_shards: int) -> tuple[int, int]:
    if not 0 <= int(shard) < int(num_shards):
        raise ValueError(f"shard {shard} not in [0, {num_shards})")
    return int(shard), int(num_shards)


def length_histogram(tc: TokenizedCorpus, max_length: int) -> np.ndarray:
    """[max_length + 1] int64: how many pairs have a longer side (with EOS) of each length."""
    out = np.zeros(max_length + 1, np.int64)
    for _, src, tgt in length_chunks(tc, max_length):
        out += np.bincount(np.maximum(src, tgt), minlength=max_length + 1)
    return out


def fit_widths(
    config: Any, histogram: np.ndarray, budget: int, batch_multiple: int, num_shards: int
) -> np.ndarray:
    """At most config.num_length_buckets widths fitted to `histogram` (all shards' pairs by
    longer side), for batches of `budget` tokens per shard."""
    # Rows of a global batch of each width (index 0 is never used: no pair is empty).
    rows = [1] + [
        rows_per_batch(budget, w, batch_multiple) * num_shards
        for w in range(1, int(config.max_length) + 1)
    ]
    return fit_buckets(histogram, np.array(rows), int(config.num_length_buckets))


def train_shard(
    config: Any, tokenizer: Tokenizer, corpus: Any, index: int, count: int, cache_dir: str | None
) -> TokenizedCorpus:
    """Training shard `index` of `count`, tokenized with long_pairs applied: mapped from
    `cache_dir` (built there first if needed), or in memory when it is None."""
    spec = ShardSpec(index, count, int(config.max_length), config.long_pairs)
    return tokenized_shard(
        corpus, tokenizer, spec, cache_dir=cache_dir, workers=int(config.data_workers)
    )


def _bucket_sizes_and_tokens(
    tc: TokenizedCorpus, max_length: int, buckets: np.ndarray
) -> tuple[np.ndarray, int]:
    """(pairs in each bucket [K] int64, source + target tokens with EOS), in one pass over
    the lengths in chunks: what an epoch's batch counts and padding follow from."""
    sizes, tokens = np.zeros(len(buckets), np.int64), 0
    for _, src, tgt in length_chunks(tc, max_length):
        sizes += np.bincount(bucket_of(buckets, np.maximum(src, tgt)), minlength=len(buckets))
        tokens += int(src.sum(dtype=np.int64) + tgt.sum(dtype=np.int64))
    return sizes, tokens


class TrainIterator:
    """Infinite iterator over the training batches of one data shard; checkpointable.

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
        shard: int = 0,
        num_shards: int = 1,
        tokenized: TokenizedCorpus | None = None,
        cache_dir: str | None = None,
        widths: Any = None,
        agree: AgreeCounts = None,
    ):
        """Shard `shard` of `num_shards`: corpus indices shard, shard + num_shards, ...

        `cache_dir`: where the tokenized shard is cached (None = tokenize in memory);
        its epoch plans are stored beside it (a `tokenized` shard mapped from the
        cache has its directory too).
        `tokenized` skips tokenization (e.g. bench/train.py's synthetic corpus);
        `config.long_pairs` is still applied to it. `widths`: the bucket widths
        (e.g. fitted to every shard's lengths); None = config.length_buckets, else
        fitted to this shard's. `agree`: how the shards of one global batch agree on
        their batch counts (the other shards plan in other processes).
        """
        self.shard, self.num_shards = _check_shard(shard, num_shards)
        self._agree = agree
        self.max_length = int(config.max_length)
        self._mapped_limit = float(getattr(config, "mapped_cache_gb", 0.0)) * 2**30  # bytes
        self.packing = bool(config.packing)
        self.seed, self.shuffle_seed = int(config.seed), int(config.shuffle_seed)
        if tokenized is None:
            self._tc = train_shard(config, tokenizer, corpus, shard, num_shards, cache_dir)
        else:
            self._tc = apply_long_pairs(tokenized, self.max_length, config.long_pairs)
        self.num_dropped = self._tc.num_dropped
        if len(self._tc) == 0:
            raise UserError("no training pairs left after dropping pairs longer than max_length")
        self.budget = int(config.batch_tokens) // self.num_shards
        # What an epoch's batch counts and padding follow from, in one pass over the lengths
        # (the plans read them again when they are made, not at a restart that maps them).
        if self.packing:
            self.buckets = np.array([self.max_length], np.int64)
        else:
            self.buckets = self._widths(config, batch_multiple, widths)
        self._bucket_sizes, self._tokens = _bucket_sizes_and_tokens(
            self._tc, self.max_length, self.buckets
        )
        self.rows = [rows_per_batch(self.budget, int(b), batch_multiple) for b in self.buckets]
        spec = PlanSpec(
            self.packing,
            self.seed,
            self.shuffle_seed,
            self.max_length,
            tuple(self.rows),
            tuple(int(b) for b in self.buckets),
        )
        self._plans = EpochPlans(self._tc, spec)
        self.epoch, self.position = 0, 0
        self._real_tokens = self._slots = 0
        self._min_counts = None
        if agree is not None and not self.packing:  # bucketed counts are the same every epoch
            self._min_counts = agree(self.bucket_batch_counts())
        # An epoch is planned when its first batch is asked for (a restart goes straight
        # to the saved epoch), and the next one is prepared halfway through.
        self._epoch_ds: Any = None
        _log.info(
            f"shard {self.shard}/{self.num_shards}: {self.num_examples:,} pairs "
            f"({self.num_dropped:,} longer than max_length dropped), "
            + (
                f"packed into rows of {self.max_length} tokens"
                if self.packing
                else f"{sum(self._counts()):,} batches/epoch in {len(self.shapes)} shape(s); "
                f"widths {','.join(map(str, self.buckets))}"
            )
        )

    def _widths(self, config: Any, batch_multiple: int, widths: Any) -> np.ndarray:
        """The bucket widths: `widths`, else config.length_buckets, else widths fitted to
        this shard's length histogram."""
        if widths is not None:
            return np.asarray(widths, np.int64)
        if config.length_buckets:
            return length_buckets(self.max_length, tuple(config.length_buckets))
        histogram = length_histogram(self._tc, self.max_length)
        return fit_widths(config, histogram, self.budget, batch_multiple, self.num_shards)

    def _counts(self) -> np.ndarray:
        """Batches of each bucket in every epoch (bucketed): this shard's, or those agreed on."""
        counts = self.bucket_batch_counts()
        return counts if self._min_counts is None else np.maximum(counts, self._min_counts)

    # The epoch's batches as a grain MapDataset: random access by position.
    def _load_epoch(self, epoch: int) -> None:
        import grain

        plan: Any = self._plans.get(epoch)
        if self.packing:
            if self._agree is not None:  # packed batch counts differ from epoch to epoch
                plan = plan.with_batches(int(self._agree(np.array([len(plan)], np.int64))[0]))
            make = lambda j: assemble_packed(self._tc, plan[j], self.rows[0], self.max_length)
            slots = len(plan) * self.rows[0] * self.max_length
        else:
            sizes = bucket_batches(self._bucket_sizes, self.rows, carry_over=True)[0]
            plan = bucket_table(plan, sizes, self._counts(), self.rows)
            rows, widths = np.asarray(self.rows), self.buckets
            make = lambda j: assemble_bucketed(
                self._tc, plan[j][1], int(rows[plan.bucket[j]]), int(widths[plan.bucket[j]])
            )
            slots = int((rows[plan.bucket] * widths[plan.bucket]).sum())
        self._planned_padding = 1.0 - self._tokens / max(2 * slots, 1)
        # The plan is in bucket order; shuffle the batches (same seed on every
        # shard, and the same number of batches, so shapes agree across hosts).
        order_seed = int(epoch_rng(self.seed, self.shuffle_seed, epoch, 1).integers(2**31))
        self._epoch_ds = (
            grain.MapDataset.source(range(len(plan))).shuffle(seed=order_seed).map(make)
        )
        self.epoch = epoch
        _log.info(
            f"shard {self.shard}/{self.num_shards} epoch {epoch}: {len(plan):,} batches, "
            f"padding {self._planned_padding:.1%} of the batch slots "
            f"(plan {self._plans.last_source})"
        )

    def _epoch(self) -> Any:
        """This epoch's batches, planned (or mapped) if they are not yet."""
        if self._epoch_ds is None:
            self._load_epoch(self.epoch)
        return self._epoch_ds

    def bucket_batch_counts(self) -> np.ndarray:
        """Batches of each bucket in an epoch of this shard alone (the same every epoch)."""
        return bucket_batches(self._bucket_sizes, self.rows, carry_over=True)[1]

    def share_batch_counts(self, counts: np.ndarray) -> None:
        """Plan at least `counts` batches per bucket from now on (filler batches make up
        the difference): shards read by one process agree as the job's processes do."""
        self._min_counts = np.asarray(counts, np.int64)
        self._epoch_ds = None  # the plan's batches are cut again when next needed

    @property
    def batches_per_epoch(self) -> int:
        return len(self._epoch())

    @property
    def num_examples(self) -> int:
        """Training pairs in this shard (after dropping long ones)."""
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
        if self.position >= len(self._epoch()):
            self._load_epoch(self.epoch + 1)
            self.position = 0
        if 2 * self.position >= len(self._epoch_ds):  # half of the epoch is behind us
            self._plans.prefetch(self.epoch + 1)
        batch = self._epoch_ds[self.position]
        self.position += 1
        due = self._mapped_limit and self.position % RELEASE_EVERY == 0
        if due and (mapped_rss() or 0) > self._mapped_limit:
            release_pages(self._tc)
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
            raise UserError(
                f"data state was saved for {state['num_examples']} examples, this corpus "
                f"shard has {self.num_examples}: the dataset or its config changed"
            )
        if int(state["epoch"]) != self.epoch:
            self.epoch, self._epoch_ds = int(state["epoch"]), None  # planned when first needed
        self.position = int(state["position"])

    @property
    def padding_fraction(self) -> float:
        """Padding share of the source and target slots of the batches served so far."""
        return float(1.0 - self._real_tokens / self._slots) if self._slots else 0.0

    @property
    def planned_padding_fraction(self) -> float:
        """Padding share of the source and target slots of this epoch's plan."""
        self._epoch()
        return self._planned_padding

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batches_per_epoch": self.batches_per_epoch,
            "num_examples": self.num_examples,
            "num_dropped": self.num_dropped,
            "padding_fraction": self.padding_fraction,
            "planned_padding_fraction": self.planned_padding_fraction,
            "tokens_served": int(self._real_tokens),
            "shapes": self.shapes,
        }


# --- Eval -----------------------------------------------------------------------------


def eval_batches(
    config: Any,
    tokenizer: Tokenizer,
    corpus: Any,
    *,
    batch_multiple: int = 1,
    batch_tokens: int | None = None,
    shard: int = 0,
    num_shards: int = 1,
    agree: AgreeCounts = None,
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Every example of shard `shard` of `num_shards` exactly once, as (batch, corpus indices).

    Examples longer than max_length are truncated, never dropped. Batches are
    sorted by length (little padding); the indices ([B] int64, -1 for filler
    rows) let the caller put results back in corpus order. A bucket's batches
    hold `batch_tokens` each, except its last, which has only the rows its pairs
    need (a power of two, `_last_batch_rows`). Dev sets are small: they are
    tokenized in memory at each call, not cached. `agree`: as for
    `TrainIterator` (every process of a job must run the same eval steps).
    """
    shard, num_shards = _check_shard(shard, num_shards)
    max_length = int(config.max_length)
    spec = ShardSpec(shard, num_shards, max_length, "truncate")
    tc = tokenized_shard(corpus, tokenizer, spec, cache_dir=None, workers=1)
    src_len, tgt_len = effective_lengths(tc, max_length)
    lengths = np.maximum(src_len, tgt_len)
    buckets = length_buckets(max_length, tuple(config.length_buckets))
    budget = int(batch_tokens or config.batch_tokens) // num_shards
    rows = [rows_per_batch(budget, int(b), batch_multiple) for b in buckets]
    own = bucket_of(buckets, lengths)
    counts, last = _eval_counts(np.bincount(own, minlength=len(rows)), rows, agree)
    plan = plan_bucketed(lengths, own, rows, None, min_counts=counts)
    for j, (k, members) in enumerate(plan):
        num_rows = rows[k]
        if j + 1 == len(plan) or plan.bucket[j + 1] != k:  # the bucket's last batch
            num_rows = _last_batch_rows(int(last[k]), rows[k], batch_multiple)
        batch = assemble_bucketed(tc, members, num_rows, int(buckets[k]))
        index = np.full(num_rows, -1, np.int64)
        index[: len(members)] = tc.index[members]
        yield batch, index


def _eval_counts(
    sizes: np.ndarray, rows: list[int], agree: AgreeCounts
) -> tuple[np.ndarray, np.ndarray]:
    """(batches of each bucket, pairs in its last batch) of the dev loss, agreed on by the
    shards: the most batches, and the fullest last batch among the shards that have that
    many (the others' last batch is a filler), in one collective: the max of
    count * (R + 1) + last orders first by count, then by last."""
    rows_k = np.asarray(rows, np.int64)
    counts = bucket_batches(sizes, rows, False)[1]
    last = np.where(counts > 0, sizes - (counts - 1) * rows_k, 0)
    if agree is None:
        return counts, last
    scale = int(rows_k.max()) + 1
    agreed = np.asarray(agree(counts * scale + last), np.int64)
    return agreed // scale, agreed % scale


def _last_batch_rows(pairs: int, full: int, multiple: int) -> int:
    """Rows of a bucket's last dev-loss batch: a power of two that holds `pairs`, rounded up
    to `multiple`, at most a full batch. A dev set of a few pairs then runs a few small
    steps (each shape compiles once) instead of full token-budget batches of padding."""
    pow2 = 1 << (max(pairs, 1) - 1).bit_length()
    return min(full, -(-pow2 // multiple) * multiple)

"""This process's training and dev batches: data shards, agreed on across processes.

    inputs = ShardedInput(config, tokenizer, corpus, global_multiple=rows_multiple)
    batch = next(inputs)              # numpy rows of this process
    state = inputs.get_state()        # [iterator state of each of this process's shards]
    for batch, _ in process_eval_batches(config, tokenizer, dev, global_multiple=rows_multiple): ...

The corpus is cut into `num_shards` strided shards (data/pipeline.py); shard s
holds examples s, s + n, s + 2n, ... and its own batch plan with 1/n of the
token budget. Normally there is one shard per process. A single process can
also read several shards and concatenate their rows: with a fixed
`config.data_shards`, bucketed global batches are the same on 1 or n
processes (the shards agree on widths and batch counts as processes do).
Packed rows are planned per shard, so several shards on one process may
differ in row counts; each step then pads to the largest.
Each shard is tokenized once into the cache (`data_cache_dir(config, workdir)`)
and memory-mapped from it at every later start.

The batch planner (data/plans.py) is pure; this module is where the shards of
one global batch agree, with one small collective each: on the length
histogram the bucket widths are fitted to (`agreed_widths`) and on the batch
counts of every epoch (`agree_counts`), so that every process runs the same
compiled steps the same number of times.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import jax
import numpy as np

from attention_jax import data
from attention_jax.data import (
    AgreeCounts,
    TokenizedCorpus,
    fit_widths,
    length_histogram,
    train_shard,
)
from attention_jax.runtime import distributed

_log = logging.getLogger(__name__)


def num_shards(config: Any) -> int:
    """config.data_shards, 0 meaning one per process (`training.config.validate` checks it)."""
    return config.data_shards or jax.process_count()


def data_cache_dir(config: Any, workdir: str | None) -> str | None:
    """config.data_cache_dir, else WORKDIR/data_cache (None: no workdir, tokenize in memory)."""
    if config.data_cache_dir:
        return os.path.expanduser(config.data_cache_dir)
    return os.path.join(workdir, "data_cache") if workdir else None


def _over_processes(x: np.ndarray, reduce: Any) -> np.ndarray:
    """`reduce` (element-wise) of every process's `x` (one collective; all must call it)."""
    from jax.experimental import multihost_utils

    return reduce(multihost_utils.process_allgather(np.asarray(x, np.int64)), axis=0)


def max_over_processes(counts: np.ndarray) -> np.ndarray:
    """The element-wise max of every process's batch counts."""
    return _over_processes(counts, np.max)


def agree_counts() -> AgreeCounts:
    """How this job's processes agree on batch counts: the max over them (None: one process)."""
    return max_over_processes if jax.process_count() > 1 else None


def agreed_widths(
    config: Any, shards: list[TokenizedCorpus], num_shards: int, multiple: int
) -> np.ndarray:
    """Bucket widths fitted to the lengths of every shard of the job: this process's
    `shards` and, through one collective, the other processes' ones."""
    histogram = sum(length_histogram(tc, config.max_length) for tc in shards)
    if jax.process_count() > 1:
        histogram = _over_processes(histogram, np.sum)
    budget = config.batch_tokens // num_shards
    return fit_widths(config, histogram, budget, multiple, num_shards)


def shard_multiple(global_multiple: int, num_shards: int) -> int:
    """Rows of one shard's batches are a multiple of this, so that `num_shards` equal
    shares make global batches whose rows are a multiple of `global_multiple`."""
    return global_multiple // math.gcd(global_multiple, num_shards)


def process_eval_batches(
    config: Any, tokenizer: data.Tokenizer, corpus: Any, *, global_multiple: int
):
    """`data.eval_batches` of this process's shard of `corpus`, with the batch counts that
    every process agrees on (so all run the same eval steps). `global_multiple`: the
    global batch's rows must be a multiple of it (each process gives its share)."""
    return data.eval_batches(
        config,
        tokenizer,
        corpus,
        batch_multiple=shard_multiple(global_multiple, jax.process_count()),
        shard=jax.process_index(),
        num_shards=jax.process_count(),
        agree=agree_counts(),
    )


def _pad_to(x: np.ndarray, rows: int, length: int) -> np.ndarray:
    return np.pad(x, ((0, rows - x.shape[0]), (0, length - x.shape[1])))


class ShardedInput:
    """Iterator over this process's batches: its data shards' rows, concatenated."""

    def __init__(
        self,
        config: Any,
        tokenizer: data.Tokenizer,
        corpus: Any,
        *,
        global_multiple: int,
        workdir: str | None = None,
    ):
        """`global_multiple`: the global batch's rows must be a multiple of it;
        `workdir`: holds the tokenized cache unless config.data_cache_dir is set."""
        self.num_shards = num_shards(config)
        per_process = self.num_shards // jax.process_count()
        first = jax.process_index() * per_process
        self.shard_ids = list(range(first, first + per_process))
        multiple = shard_multiple(global_multiple, self.num_shards)
        # Each shard is tokenized (or mapped from the cache) once, here.
        cache = data_cache_dir(config, workdir)
        shards = [
            train_shard(config, tokenizer, corpus, s, self.num_shards, cache)
            for s in self.shard_ids
        ]
        widths = None
        if not (config.packing or config.length_buckets):
            widths = agreed_widths(config, shards, self.num_shards, multiple)
        # Several processes: one shard each (`validate` checks it), their counts agreed on.
        agree = agree_counts()
        self.iterators = [
            data.TrainIterator(
                config,
                tokenizer,
                corpus,
                batch_multiple=multiple,
                shard=s,
                num_shards=self.num_shards,
                tokenized=tc,
                widths=widths,
                agree=agree,
            )
            for s, tc in zip(self.shard_ids, shards, strict=True)
        ]
        if len(self.iterators) > 1 and not config.packing:
            # As processes agree on batch counts per bucket, so do the shards of one
            # process: the same global batches as one shard per process.
            counts = np.max([it.bucket_batch_counts() for it in self.iterators], axis=0)
            for it in self.iterators:
                it.share_batch_counts(counts)
        elif len(self.iterators) > 1:
            _log.warning(
                f"packed batches from {len(self.iterators)} data shards in one process: each "
                "shard packs its own rows, so the global batches differ from a run with one "
                "process per shard (bucketed batches do not)"
            )

    def __iter__(self) -> ShardedInput:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(it) for it in self.iterators]
        if len(parts) == 1:
            return parts[0]
        # Shards planned without each other may pick different buckets for the same
        # step: pad to the largest (all-zero rows and columns are padding).
        rows = max(p["src"].shape[0] for p in parts)
        length = {k: max(p[k].shape[1] for p in parts) for k in parts[0]}
        return {
            k: np.concatenate([_pad_to(p[k], rows, length[k]) for p in parts]) for k in parts[0]
        }

    def get_state(self) -> list[dict[str, Any]]:
        """This process's shards' iterator states, in shard order."""
        return [it.get_state() for it in self.iterators]

    def global_state(self) -> list[dict[str, Any]]:
        """Every shard's state (one collective across processes; all must call it)."""
        return [s for states in distributed.allgather_json(self.get_state()) for s in states]

    def set_global_state(self, states: list[dict[str, Any]]) -> bool:
        """Resume from `global_state()` of an earlier run; True if exactly, False if not.

        The same shard count resumes exactly. Another one (e.g. a 2-process
        run resumed on 1 process without config.data_shards=2) cannot: every
        shard then continues at the epoch and position of the first saved one.
        """
        if len(states) == self.num_shards:
            for s, it in zip(self.shard_ids, self.iterators, strict=True):
                it.set_state(states[s])
            return True
        epoch, position = int(states[0]["epoch"]), int(states[0]["position"])
        for it in self.iterators:
            it.set_state({"epoch": epoch, "position": 0})
            it.position = min(position, it.batches_per_epoch)
        return False

    def stats(self) -> dict[str, Any]:
        return self.iterators[0].stats()

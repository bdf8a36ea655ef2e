"""The tokenized-corpus cache: each shard is tokenized once, then memory-mapped at every start.

    spec = ShardSpec(index=0, count=1, max_length=256, long_pairs="drop")
    tc = tokenized_shard(corpus, tokenizer, spec, cache_dir="WORKDIR/data_cache", workers=0)

One directory per (corpus fingerprint, tokenizer, max_length, long_pairs,
shard, format version), named `CORPUS-KEYHASH-sIIIIIofNNNNN`:

    src.bin, tgt.bin               token ids, flat: uint16 if the vocabulary fits, else int32
    src_start.bin, tgt_start.bin   int64 offset of each pair's ids
    src_len.bin, tgt_len.bin       int16 lengths (EOS not included; long_pairs applied)
    index.bin                      int64 position of each pair in the corpus
    manifest.json                  the key, counts and dtypes; written last
    plans/                         epoch plans, added when they are first made
                                   (data/plan_cache.py; not part of the build)

Plain little-endian arrays, so `np.memmap` maps them with no parsing and no
copy, and the batch plans read only the two length arrays. The build streams
the shard in chunks of 8192 pairs through worker processes (one per core by
default, each with its own SentencePiece model) into a private temporary
directory that is renamed into place when complete (data/files.py): a build
killed midway is never used, and the next run starts it again. Processes of
a multi-host job each build only their own shard, under names that differ.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_jax.data import files
from attention_jax.data.corpora import read_pairs
from attention_jax.data.tokenized import (
    TokenizedCorpus,
    chunk_starts,
    concat_chunks,
    encode_chunk,
    id_dtype,
    len_dtype,
)
from attention_jax.runtime.cpus import usable_cpus

# Bump when the layout or the tokenization rules change: every cache is keyed on it.
CACHE_VERSION = 1
# Pairs per task: big enough that a task outweighs its messaging, small enough to stream.
CHUNK_PAIRS = 8192
# Below this many pairs the shard is tokenized in this process: starting workers
# (a fresh interpreter each) would cost more than they save.
PARALLEL_MIN_PAIRS = 100_000
# Without a terminal, progress is a log line this often (seconds).
_LOG_EVERY_S = 30.0

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Which pairs (corpus positions index, index + count, ...) and how they are cut."""

    index: int
    count: int
    max_length: int
    long_pairs: str  # 'drop' or 'truncate'

    def size(self, n: int) -> int:
        """Pairs of an n-pair corpus in this shard."""
        return len(range(self.index, n, self.count))

    def positions(self, lo: int, hi: int) -> np.ndarray:
        """Corpus positions of the shard's pairs lo..hi-1."""
        return self.index + self.count * np.arange(lo, hi, dtype=np.int64)


def _encode_range(corpus, tokenizer, spec: ShardSpec, ids: np.dtype, lo: int, hi: int) -> dict:
    positions = spec.positions(lo, hi)
    return encode_chunk(
        read_pairs(corpus, positions),
        positions,
        tokenizer,
        max_length=spec.max_length,
        long_pairs=spec.long_pairs,
        ids=ids,
    )


# --- Worker processes --------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(corpus: Any, files: dict[str, bytes], spec: ShardSpec, ids: np.dtype) -> None:
    from attention_jax.data.tokenizer import from_files

    # One core per worker: SentencePiece's own threads would only compete with the others.
    tokenizer = from_files(files, num_threads=1)
    _WORKER.update(corpus=corpus, tokenizer=tokenizer, spec=spec, ids=ids)


def _work(lo: int, hi: int) -> dict:
    w = _WORKER
    return _encode_range(w["corpus"], w["tokenizer"], w["spec"], w["ids"], lo, hi)


def resolve_workers(workers: int) -> int:
    """config.data_workers: 0 = one per CPU core this process may use."""
    return workers if workers > 0 else usable_cpus()


class _Progress:
    """A tqdm bar with pairs/s on a terminal; otherwise a log line every 30 s.

    Quiet for shards that take seconds (under PARALLEL_MIN_PAIRS: Ding, dev sets).
    """

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0
        self.start = self.last_log = time.time()
        self.enabled = total >= PARALLEL_MIN_PAIRS
        self._bar = None
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="pair", unit_scale=True, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.time() - self.last_log >= _LOG_EVERY_S:
            self.last_log = time.time()
            rate = self.done / max(self.last_log - self.start, 1e-9)
            _log.info(
                f"{self.desc}: {self.done:,}/{self.total:,} pairs "
                f"({self.done / max(self.total, 1):.0%}), {rate:,.0f} pairs/s"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def encode_shard(
    corpus: Any,
    tokenizer: Any,
    spec: ShardSpec,
    consume: Callable[[dict], None],
    *,
    workers: int,
    desc: str = "tokenizing",
) -> None:
    """Tokenizes the shard chunk by chunk and hands the chunks to `consume`, in order.

    With several workers, at most 2 chunks per worker are in flight, so memory
    stays bounded whatever the corpus size; the chunks (and so the result)
    do not depend on the number of workers.
    """
    ids = id_dtype(tokenizer.vocab_size)
    n = spec.size(len(corpus))
    bounds = [(lo, min(lo + CHUNK_PAIRS, n)) for lo in range(0, n, CHUNK_PAIRS)]
    workers = min(resolve_workers(workers), len(bounds))
    progress = _Progress(n, desc)
    try:
        # Workers rebuild the tokenizer from its files; a stand-in without them runs here.
        if workers <= 1 or n < PARALLEL_MIN_PAIRS or not hasattr(tokenizer, "files"):
            for lo, hi in bounds:
                consume(_encode_range(corpus, tokenizer, spec, ids, lo, hi))
                progress.update(hi - lo)
            return
        # "spawn": forking a process that runs JAX's threads can deadlock the child.
        pool = concurrent.futures.ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(corpus, tokenizer.files(), spec, ids),
        )
        try:
            todo, pending = iter(bounds), collections.deque()
            for lo, hi in todo:
                pending.append((hi - lo, pool.submit(_work, lo, hi)))
                if len(pending) >= 2 * workers:
                    break
            while pending:
                size, future = pending.popleft()
                chunk = future.result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt[1] - nxt[0], pool.submit(_work, *nxt)))
                consume(chunk)
                progress.update(size)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        progress.close()


# --- Files ---------------------------------------------------------------------------------

_FILES = {  # TokenizedCorpus field -> file
    "src_flat": "src.bin",
    "src_start": "src_start.bin",
    "src_len": "src_len.bin",
    "tgt_flat": "tgt.bin",
    "tgt_start": "tgt_start.bin",
    "tgt_len": "tgt_len.bin",
    "index": "index.bin",
}


class _FileSink:
    """Appends encoded chunks to the shard's files, with running offsets."""

    def __init__(self, directory: str):
        self._files = contextlib.ExitStack()  # closes them all in close()
        self._f = {
            k: self._files.enter_context(open(os.path.join(directory, name), "wb"))  # noqa: SIM115
            for k, name in _FILES.items()
        }
        self.pairs = self.dropped = self.src_tokens = self.tgt_tokens = 0

    def __call__(self, chunk: dict) -> None:
        f = self._f
        chunk["src"].tofile(f["src_flat"])
        chunk["tgt"].tofile(f["tgt_flat"])
        chunk_starts(chunk["src_len"], self.src_tokens).tofile(f["src_start"])
        chunk_starts(chunk["tgt_len"], self.tgt_tokens).tofile(f["tgt_start"])
        chunk["src_len"].tofile(f["src_len"])
        chunk["tgt_len"].tofile(f["tgt_len"])
        chunk["index"].tofile(f["index"])
        self.pairs += len(chunk["index"])
        self.dropped += int(chunk["dropped"])
        self.src_tokens += len(chunk["src"])
        self.tgt_tokens += len(chunk["tgt"])

    def close(self) -> None:
        self._files.close()


def _shapes(m: dict[str, Any]) -> dict[str, tuple[np.dtype, int]]:
    """Field -> (dtype, count) from a manifest."""
    ids, lens = np.dtype(m["id_dtype"]), np.dtype(m["len_dtype"])
    n = m["pairs"]
    return {
        "src_flat": (ids, m["src_tokens"]),
        "src_start": (np.dtype(np.int64), n),
        "src_len": (lens, n),
        "tgt_flat": (ids, m["tgt_tokens"]),
        "tgt_start": (np.dtype(np.int64), n),
        "tgt_len": (lens, n),
        "index": (np.dtype(np.int64), n),
    }


def open_shard(directory: str, key: dict[str, Any]) -> TokenizedCorpus | None:
    """The cached shard in `directory` memory-mapped, or None if absent or not for `key`.

    A directory whose manifest matches but whose files have the wrong sizes
    (damaged by hand or by a full disk) is moved aside, to be rebuilt.
    """
    manifest = files.read_manifest(directory)
    if manifest is None or manifest.get("key") != key:
        return None
    arrays = {}
    for field, (dtype, count) in _shapes(manifest).items():
        path = os.path.join(directory, _FILES[field])
        if not os.path.isfile(path) or os.path.getsize(path) != dtype.itemsize * count:
            files.move_aside(directory)
            return None
        arrays[field] = (
            np.memmap(path, dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
        )
    return TokenizedCorpus(**arrays, num_dropped=manifest["dropped"], directory=directory)


# --- The cache ---------------------------------------------------------------------------------


def cache_key(corpus: Any, tokenizer: Any, spec: ShardSpec) -> dict[str, Any] | None:
    """Everything the shard's content depends on, or None if the corpus or tokenizer
    cannot say what it is (then the shard is tokenized in memory, uncached)."""
    fingerprint = getattr(corpus, "fingerprint", None)
    tokenizer_fp = getattr(tokenizer, "fingerprint", None)
    if fingerprint is None or tokenizer_fp is None:
        return None
    key = {
        "version": CACHE_VERSION,
        "corpus": fingerprint(),
        "tokenizer": tokenizer_fp,
        "max_length": spec.max_length,
        "long_pairs": spec.long_pairs,
        "shard": [spec.index, spec.count],
    }
    return json.loads(json.dumps(key))  # as it reads back from the manifest


def shard_dir(root: str, corpus_name: str, key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._]+", "_", corpus_name).strip("_")[-48:] or "corpus"
    index, count = key["shard"]
    return os.path.join(root, f"{stem}-{digest}-s{index:05d}of{count:05d}")


def _build(corpus, tokenizer, spec: ShardSpec, key: dict, tmp: str, workers: int, desc: str):
    t0 = time.time()
    sink = _FileSink(tmp)
    try:
        encode_shard(corpus, tokenizer, spec, sink, workers=workers, desc=desc)
    finally:
        sink.close()
    seconds = time.time() - t0
    files.write_manifest(
        tmp,
        {
            "key": key,
            "corpus_name": getattr(corpus, "name", ""),
            "pairs": sink.pairs,
            "dropped": sink.dropped,
            "src_tokens": sink.src_tokens,
            "tgt_tokens": sink.tgt_tokens,
            "id_dtype": id_dtype(tokenizer.vocab_size).name,
            "len_dtype": len_dtype(spec.max_length).name,
            "build_seconds": seconds,
            "built_by": f"{socket.gethostname()}:{os.getpid()}",
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    return sink, seconds


def tokenized_shard(
    corpus: Any,
    tokenizer: Any,
    spec: ShardSpec,
    *,
    cache_dir: str | None,
    workers: int = 0,
) -> TokenizedCorpus:
    """This shard's tokenized pairs: memory-mapped from the cache, built into it once,
    or (no cache_dir, or a corpus/tokenizer without a fingerprint) built in memory."""
    name = getattr(corpus, "name", "") or "corpus"
    desc = f"tokenizing {name} shard {spec.index}/{spec.count}"
    key = cache_key(corpus, tokenizer, spec) if cache_dir else None
    if key is None:
        chunks: list[dict] = []
        encode_shard(corpus, tokenizer, spec, chunks.append, workers=workers, desc=desc)
        return concat_chunks(chunks, id_dtype(tokenizer.vocab_size), len_dtype(spec.max_length))
    final = shard_dir(cache_dir, name, key)
    tc = open_shard(final, key)
    if tc is not None:
        _log.info(f"{name} shard {spec.index}/{spec.count}: {len(tc):,} pairs from {final}")
        return tc
    files.remove_stale_temps(final)
    tmp = files.temp_dir(final)
    try:
        sink, seconds = _build(corpus, tokenizer, spec, key, tmp, workers, desc)
        files.publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = spec.size(len(corpus))
    _log.info(
        f"{desc}: {sink.pairs:,} pairs ({sink.dropped:,} longer than max_length dropped), "
        f"{sink.src_tokens + sink.tgt_tokens:,} tokens in {seconds:.1f}s "
        f"({total / max(seconds, 1e-9):,.0f} pairs/s) -> {final}"
    )
    tc = open_shard(final, key)
    if tc is None:
        raise files.UserError(f"the tokenized cache {final} could not be read back")
    return tc

"""Each epoch's batch plan: made once, stored beside the tokenized cache, mapped back at restarts.

    plans = EpochPlans(tc, PlanSpec(packing=False, seed=0, ...))
    plan = plans.get(epoch)          # mapped from the store, else made there (or in memory)
    plans.prefetch(epoch + 1)        # made in a background thread while this epoch trains

An epoch's plan is a pure function of the shard's lengths and the `PlanSpec`
(seeds, rows per batch, widths, packing), so it is made once (data/plans.py,
data/packing.py; packing tens of millions of pairs is a long Python loop) and kept
in the shard's cache directory, where every later start of that epoch maps it:

    CORPUS-KEYHASH-sIIIIIofNNNNN/plans/FAMILY-eEEEEEE/
        members.bin      int32 example indices, batch after batch (4 bytes per pair)
        row_start.bin    int64 [rows + 1], packed plans only
        manifest.json    the key, the counts; written last

FAMILY hashes everything but the epoch (the shard's key, PlanSpec, PLAN_VERSION):
change a seed, the batch size or the widths and another family is made. The
plan is streamed to its files as it is made (memory: the permutation and one
bucket or chunk of pairs, not the plan) in a private temporary directory that
is renamed into place when complete (data/files.py), so a process killed midway
leaves nothing that is read back. When an epoch's plan is used, its family's
earlier epochs are deleted, and so are other families untouched for a week.
A shard without a cache directory (tokenized in memory), or one whose
directory cannot be written, plans in memory as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from typing import Any

import numpy as np

from attention_jax.data import files
from attention_jax.data.packing import PackedPlan, packed_rows, plan_packed
from attention_jax.data.plans import (
    bucket_batches,
    bucket_members,
    bucket_of,
    epoch_rng,
    plan_bucketed,
)
from attention_jax.data.tokenized import TokenizedCorpus, effective_lengths, length_chunks

# Bump when a plan for the same inputs would come out differently (the packer's window,
# the shuffles): stored plans are keyed on it.
PLAN_VERSION = 1
# Another family's plans unused for this long are deleted (seconds).
_STALE_FAMILY_S = 7 * 24 * 3600
_EPOCH_DIR = re.compile(r"^([0-9a-f]{16})-e(\d{6,})$")

_log = logging.getLogger(__name__)

Plan = PackedPlan | np.ndarray  # packed, or a bucketed plan's members (see EpochPlans.get)


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What an epoch's plan depends on besides the shard's lengths and the epoch."""

    packing: bool
    seed: int
    shuffle_seed: int
    max_length: int
    rows: tuple[int, ...]  # rows of a batch, per width (packed: one)
    widths: tuple[int, ...]  # bucket widths (packed: max_length)


def bucket_of_pairs(tc: TokenizedCorpus, max_length: int, widths: np.ndarray) -> np.ndarray:
    """The bucket of each pair [n] (uint8 for up to 255 widths), in chunks: all a bucketed
    plan needs, at 1 byte per pair."""
    out = np.empty(len(tc), np.min_scalar_type(len(widths)))
    for lo, src, tgt in length_chunks(tc, max_length):
        out[lo : lo + len(src)] = bucket_of(widths, np.maximum(src, tgt))
    return out


class EpochPlans:
    """The plans of one shard's epochs: stored and mapped back, or made in memory."""

    def __init__(self, tc: TokenizedCorpus, spec: PlanSpec):
        self.tc, self.spec = tc, spec
        self.directory = os.path.join(tc.directory, "plans") if tc.directory else None
        key = {"version": PLAN_VERSION, **dataclasses.asdict(spec), "pairs": len(tc)}
        if tc.directory:
            key["shard"] = os.path.basename(os.path.normpath(tc.directory))
        self._key = json.loads(json.dumps(key))  # as it reads back from a manifest
        self.family = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self._ahead: tuple[int, threading.Thread, dict[str, Any]] | None = None
        self.last_source = ""  # how the last plan was had, for the log: mapped/made/...

    # --- What the iterator calls ---------------------------------------------------------

    def get(self, epoch: int) -> Plan:
        """Epoch `epoch`'s plan, before the shards agree on batch counts: a PackedPlan, or
        a bucketed plan's members (int32 [n]: bucket after bucket, each cut into batches
        by `bucket_batches`). Waits for a prefetch of this epoch if one runs."""
        t0 = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == epoch:
            _, thread, result = self._ahead
            self._ahead = None
            thread.join()
            if "error" in result:
                raise result["error"]
            plan, how = result["plan"], "prepared ahead"
        else:
            plan, how = self._plan(epoch)
        self._cleanup(epoch)
        self.last_source = f"{how} in {time.perf_counter() - t0:.1f}s"
        return plan

    def prefetch(self, epoch: int) -> None:
        """Start making epoch `epoch`'s plan in a background thread (numpy and a Python
        loop, no collectives); `get(epoch)` then waits for it instead of starting over."""
        if self._ahead is not None:
            return
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["plan"], _ = self._plan(epoch)
            except BaseException as e:  # handed to get(), which raises it
                result["error"] = e

        # A daemon: a run that ends mid-plan does not wait for it (its temporary
        # directory is deleted by a later start).
        thread = threading.Thread(target=run, name=f"plan-epoch-{epoch}", daemon=True)
        self._ahead = (epoch, thread, result)
        thread.start()

    # --- Making and storing ----------------------------------------------------------------

    def _plan(self, epoch: int) -> tuple[Plan, str]:
        """(the plan, how it was had): mapped from the store, made into it, or made in memory."""
        if self.directory is not None:
            final = self._path(epoch)
            plan = self._load(final, epoch)
            if plan is not None:
                return plan, f"mapped from {final}"
            try:
                return self._store(final, epoch), f"planned and stored in {final}"
            except OSError as e:  # a read-only or full cache directory: plan in memory
                _log.warning(
                    f"cannot store the epoch plan in {self.directory} ({e}); "
                    "planning in memory at every start"
                )
                self.directory = None
        return self._in_memory(epoch), "planned in memory"

    def _rng(self, epoch: int) -> np.random.Generator:
        return epoch_rng(self.spec.seed, self.spec.shuffle_seed, epoch, 0)

    def _in_memory(self, epoch: int) -> Plan:
        spec, rng = self.spec, self._rng(epoch)
        if spec.packing:
            src, tgt = effective_lengths(self.tc, spec.max_length)
            return plan_packed(src, tgt, spec.max_length, spec.rows[0], rng)
        buckets = bucket_of_pairs(self.tc, spec.max_length, np.asarray(spec.widths))
        return plan_bucketed(None, buckets, spec.rows, rng, carry_over=True).members

    def _path(self, epoch: int) -> str:
        return os.path.join(self.directory, f"{self.family}-e{epoch:06d}")

    def _store(self, final: str, epoch: int) -> Plan:
        """Makes the plan into a temporary directory, publishes it as `final`, maps it."""
        files.remove_stale_temps(final)
        tmp = files.temp_dir(final)
        try:
            counts = (_write_packed if self.spec.packing else _write_bucketed)(
                self.tc, self.spec, self._rng(epoch), tmp
            )
            files.write_manifest(tmp, {"key": {**self._key, "epoch": epoch}, **counts})
            files.publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        plan = self._load(final, epoch)
        if plan is None:
            raise files.UserError(f"the epoch plan {final} could not be read back")
        return plan

    def _load(self, path: str, epoch: int) -> Plan | None:
        """The stored plan in `path` mapped, or None: absent, or damaged (no manifest, one
        for another key, files of the wrong sizes), then deleted, to be made again."""
        if not os.path.isdir(path):
            return None
        manifest = files.read_manifest(path) or {}
        n, rows = len(self.tc), manifest.get("rows", 0)
        expect = {"members.bin": (np.int32 if n < 2**31 else np.int64, n)}
        if self.spec.packing:
            expect["row_start.bin"] = (np.int64, rows + 1)
        arrays = {}
        try:
            if manifest.get("key") != {**self._key, "epoch": epoch}:
                raise ValueError("no manifest, or one for another plan")
            for name, (dtype, count) in expect.items():
                arrays[name] = _map(os.path.join(path, name), np.dtype(dtype), count)
            os.utime(path)  # in use: not stale (see _cleanup)
        except (OSError, ValueError):
            _log.warning(f"the stored epoch plan {path} is damaged; it will be made again")
            shutil.rmtree(path, ignore_errors=True)
            return None
        if not self.spec.packing:
            return arrays["members.bin"]
        num_batches = -(-rows // self.spec.rows[0])
        return PackedPlan(
            arrays["members.bin"], arrays["row_start.bin"], self.spec.rows[0], num_batches
        )

    def _cleanup(self, epoch: int) -> None:
        """Deletes this family's plans of earlier epochs and other families' stale ones."""
        if self.directory is None or not os.path.isdir(self.directory):
            return
        now = time.time()
        for entry in os.listdir(self.directory):
            m = _EPOCH_DIR.match(entry)
            path = os.path.join(self.directory, entry)
            if m is None:
                continue
            if m.group(1) == self.family:
                stale = int(m.group(2)) < epoch
            else:
                try:
                    stale = now - os.path.getmtime(path) > _STALE_FAMILY_S
                except OSError:
                    continue
            if stale:
                shutil.rmtree(path, ignore_errors=True)


def _map(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    """A read-only map of `count` items (ValueError if the file's size differs)."""
    size = os.path.getsize(path)
    if size != dtype.itemsize * count:
        raise ValueError(f"{path}: {size} bytes, expected {dtype.itemsize * count}")
    return np.memmap(path, dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)


def _write_packed(tc: TokenizedCorpus, spec: PlanSpec, rng: np.random.Generator, tmp: str):
    """A packed plan streamed to tmp/members.bin and tmp/row_start.bin; its counts."""
    src, tgt = effective_lengths(tc, spec.max_length)
    rows = 0
    with (
        open(os.path.join(tmp, "members.bin"), "wb") as fm,
        open(os.path.join(tmp, "row_start.bin"), "wb") as fr,
    ):
        np.zeros(1, np.int64).tofile(fr)
        start = 0
        for members, sizes in packed_rows(src, tgt, spec.max_length, rng):
            members.tofile(fm)
            (start + np.cumsum(sizes)).astype(np.int64).tofile(fr)
            start, rows = start + len(members), rows + len(sizes)
    return {"pairs": len(tc), "rows": rows}


def _write_bucketed(tc: TokenizedCorpus, spec: PlanSpec, rng: np.random.Generator, tmp: str):
    """A bucketed plan's members streamed to tmp/members.bin, bucket by bucket; its counts."""
    buckets = bucket_of_pairs(tc, spec.max_length, np.asarray(spec.widths))
    raw = np.bincount(buckets, minlength=len(spec.rows))
    sizes = bucket_batches(raw, spec.rows, carry_over=True)[0]
    with open(os.path.join(tmp, "members.bin"), "wb") as f:
        for members in bucket_members(None, buckets, sizes, rng):
            members.tofile(f)
    return {"pairs": len(tc), "bucket_sizes": sizes.tolist()}

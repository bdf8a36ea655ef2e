"""TSV corpora read by byte offset: a cached index of the valid lines, nothing held in memory.

One pass over the file (numpy over 16 MiB blocks) finds the
lines that hold a valid `source<TAB>target` pair and records their byte
offsets; the held-out dev/test lines are drawn at the same time. The index
is cached (keyed on the file's path, size and mtime) as a directory of flat
arrays under `data.files.cache_dir()`, so later runs map it instantly (files
under 32 MB are indexed in memory at each start instead):

    index = line_index(path)                 # builds once, then maps
    corpus = TsvCorpus(index)                # corpus[i] -> (source, target), read on access
    corpus.pairs(np.arange(1000, 2000))      # many lines at once, one read per block

A line is valid when, after removing its line break, it is not blank, is
UTF-8, has exactly one tab and non-whitespace text on both sides (the sides
are returned stripped). These are the rules of the earlier in-memory reader,
reproduced exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np

from attention_jax.data import files

# Bump when the validity rules or the index layout change: cached indexes are keyed on it.
INDEX_VERSION = 1
# Held-out pairs carved out of a TSV file when no eval set is given.
TSV_EVAL_SIZE = 1000
# Fixed seed for held-out splits: they must not move when the training seed does.
SPLIT_SEED = 20170612
_BLOCK_BYTES = 16 << 20
# A pair.read() of one contiguous span is used when it is at most this many bytes.
_MAX_SPAN_BYTES = 64 << 20
# Files smaller than this are indexed in memory at each start (a fraction of a
# second) instead of cached: toy corpora and tests leave nothing in the user's cache.
CACHE_MIN_BYTES = 32 << 20

_log = logging.getLogger(__name__)


# --- Scanning -------------------------------------------------------------------------


def _any_in_segments(mask: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """any(mask[bounds[i] : bounds[i + 1]]) for each i (the last runs to the end)."""
    if len(bounds) == 0:
        return np.zeros(0, bool)
    return np.logical_or.reduceat(mask, bounds)


def _exact_valid(raw: bytes) -> bool:
    """The reference rule for one line (without its line break), in plain Python."""
    raw = raw.rstrip(b"\r\n")
    try:
        parts = raw.decode("utf-8").split("\t")
    except UnicodeDecodeError:
        return False
    return len(parts) == 2 and bool(parts[0].strip()) and bool(parts[1].strip())


def scan_block(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """Valid lines of a block of whole lines: (starts, ends, non-blank lines).

    `ends` exclude the line break and trailing CRs. Vectorized; only lines that
    numpy cannot decide (invalid UTF-8 in the block, sides without a printable
    ASCII character) are checked one by one.
    """
    buf = np.frombuffer(data, np.uint8)
    breaks = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], breaks + 1]).astype(np.int64)
    ends = np.concatenate([breaks, [len(buf)]]).astype(np.int64)
    if starts[-1] == len(buf):  # nothing after the last line break
        starts, ends = starts[:-1], ends[:-1]
    while True:  # rstrip(b"\r\n"): the break is gone, CRs may remain
        cr = (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)
        if not cr.any():
            break
        ends[cr] -= 1
    # Bytes 33-127 are whitespace neither to bytes.strip() nor to str.strip(): one
    # settles that a line is not blank, or a side not empty. Lines numpy cannot
    # settle this way (only spaces, control characters or non-ASCII) are checked
    # one by one below: rare in real text.
    printable = buf > 32
    nonblank = _any_in_segments(printable, starts) & (ends > starts)
    for i in np.flatnonzero(~nonblank & (ends > starts)):  # blank: not data, not malformed
        nonblank[i] = bool(data[starts[i] : ends[i]].strip())
    printable &= buf < 128
    tabs = np.flatnonzero(buf == 9)
    first_tab = np.searchsorted(tabs, starts)
    one_tab = (np.searchsorted(tabs, ends) - first_tab) == 1
    mid = starts  # the tab between the sides (lines without exactly one are invalid anyway)
    if len(tabs):
        mid = np.where(one_tab, tabs[np.minimum(first_tab, len(tabs) - 1)], starts)
    solid = _any_in_segments(printable, np.stack([starts, mid], 1).reshape(-1)).reshape(-1, 2)
    valid = nonblank & one_tab & solid[:, 0] & solid[:, 1]
    unsure = nonblank & one_tab & ~valid
    if (buf >= 128).any():
        try:
            data.decode("utf-8")  # lines split at ASCII '\n': the block is valid iff each line is
        except UnicodeDecodeError:
            high = _any_in_segments(buf >= 128, starts)
            unsure |= valid & high
            valid &= ~high
    for i in np.flatnonzero(unsure):
        valid[i] = _exact_valid(data[starts[i] : ends[i]])
    return starts[valid], ends[valid], int(nonblank.sum())


def _scan_file(path: str, out_dir: str) -> tuple[int, int]:
    """Writes the valid lines' offsets to out_dir/{starts,ends}.bin; (valid, non-blank)."""
    valid = total = base = 0
    carry = b""
    with (
        open(path, "rb") as f,
        open(os.path.join(out_dir, "starts.bin"), "wb") as fs,
        open(os.path.join(out_dir, "ends.bin"), "wb") as fe,
    ):
        while True:
            block = f.read(_BLOCK_BYTES)
            data = carry + block
            cut = len(data) if not block else data.rfind(b"\n") + 1
            if cut:
                starts, ends, nonblank = scan_block(data[:cut])
                fs.write((starts + base).tobytes())
                fe.write((ends + base).tobytes())
                valid, total, base = valid + len(starts), total + nonblank, base + cut
            carry = data[cut:]
            if not block:
                return valid, total


# --- Held-out splits ---------------------------------------------------------------------


def held_out_lines(n: int, eval_size: int = TSV_EVAL_SIZE) -> dict[str, np.ndarray]:
    """Deterministic dev/test line numbers (int64, sorted) for a TSV file without an eval set;
    training is every other line.

    The first 2k of a seeded permutation of range(n), shuffled in int32 (the values
    of `rng.permutation(n)`, whose draws depend on n alone, at half its memory:
    4 bytes a line, where int64 and the sorted training lines took 16).
    """
    k = min(eval_size, n // 20)  # at most 5% per held-out split
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    np.random.default_rng(SPLIT_SEED).shuffle(order)
    held = order[: 2 * k].astype(np.int64)
    del order
    return {"dev": np.sort(held[:k]), "test": np.sort(held[k:])}


# --- The cached index -----------------------------------------------------------------------


def _fingerprint(path: str) -> dict[str, Any]:
    """What identifies the file's content without reading it: path, size, mtime.

    A content hash would read the whole file at every start; mtime_ns changes on
    every write, and keeping the path means a moved file is indexed again.
    """
    st = os.stat(path)
    return {
        "kind": "tsv",
        "path": os.path.realpath(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "index_version": INDEX_VERSION,
    }


def _index_dir(fingerprint: dict[str, Any], root: str) -> tuple[str, str]:
    """(this version's directory, the prefix shared by every version of this path)."""
    stem = re.sub(r"[^A-Za-z0-9._]+", "_", os.path.basename(fingerprint["path"]))[:40]
    path_hash = hashlib.sha256(fingerprint["path"].encode()).hexdigest()[:8]
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    prefix = os.path.join(root, f"tsv-{stem}-{path_hash}-")
    return prefix + key, prefix


class LineIndex:
    """The valid lines of one TSV file: byte offsets (memory-mapped) and counts."""

    def __init__(self, directory: str, manifest: dict[str, Any], *, in_memory: bool = False):
        """`in_memory`: read the arrays (the directory is temporary), do not map them."""
        self.directory = None if in_memory else directory
        self.fingerprint = manifest["fingerprint"]
        self.path = self.fingerprint["path"]
        self.num_valid, self.num_lines = manifest["num_valid"], manifest["num_lines"]
        load = (lambda f, n: np.fromfile(f, np.int64, n)) if in_memory else _map
        self.starts = load(os.path.join(directory, "starts.bin"), self.num_valid)
        self.ends = load(os.path.join(directory, "ends.bin"), self.num_valid)
        self.held_out = {s: np.load(os.path.join(directory, f"{s}.npy")) for s in ("dev", "test")}

    def __reduce__(self):
        if self.directory is None:  # a small file's index travels whole
            return (_index_from_state, (self.__dict__,))
        return (_open_index, (self.directory,))  # workers map the files themselves

    @property
    def num_malformed(self) -> int:
        return self.num_lines - self.num_valid

    def release_pages(self) -> None:
        """Unmap the offsets' pages that reads have mapped into this process (16 bytes
        a pair: a cache worker that has read every pair would hold all of them)."""
        files.drop_mapped_pages(self.starts, self.ends)


def _map(path: str, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, np.int64)
    return np.memmap(path, dtype=np.int64, mode="r", shape=(count,))


def _index_from_state(state: dict[str, Any]) -> LineIndex:
    index = LineIndex.__new__(LineIndex)
    index.__dict__.update(state)
    return index


def _open_index(directory: str) -> LineIndex:
    manifest = files.read_manifest(directory)
    if manifest is None:
        raise files.UserError(f"TSV index {directory} disappeared while in use")
    return LineIndex(directory, manifest)


def _valid_index(directory: str, fingerprint: dict[str, Any]) -> LineIndex | None:
    manifest = files.read_manifest(directory)
    if manifest is None or manifest.get("fingerprint") != fingerprint:
        return None
    try:
        index = LineIndex(directory, manifest)
    except (OSError, ValueError):
        files.move_aside(directory)
        return None
    return index


def _write_index(path: str, directory: str, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Scans `path` into `directory` (offsets, held-out lines, manifest); the manifest."""
    valid, total = _scan_file(path, directory)
    for split, lines in held_out_lines(valid).items():
        np.save(os.path.join(directory, f"{split}.npy"), lines)
    manifest = {"fingerprint": fingerprint, "num_valid": valid, "num_lines": total}
    files.write_manifest(directory, manifest)
    return manifest


def line_index(path: str, root: str | None = None) -> LineIndex:
    """The index of `path`'s valid lines: mapped from the cache, or built once."""
    if not os.path.isfile(path):
        raise files.UserError(f"TSV file not found: {path}")
    fingerprint = _fingerprint(path)
    if fingerprint["size"] < CACHE_MIN_BYTES:
        with tempfile.TemporaryDirectory() as tmp:
            return LineIndex(tmp, _write_index(path, tmp, fingerprint), in_memory=True)
    final, prefix = _index_dir(fingerprint, root or files.cache_dir())
    index = _valid_index(final, fingerprint)
    if index is not None:
        return index
    files.remove_stale_temps(final)
    tmp = files.temp_dir(final)
    try:
        manifest = _write_index(path, tmp, fingerprint)
        valid, total = manifest["num_valid"], manifest["num_lines"]
        files.publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # The file changed since the other indexes of this path were built: they are stale.
    parent = os.path.dirname(final)
    for entry in os.listdir(parent):
        other = os.path.join(parent, entry)
        if other.startswith(prefix) and other != final and ".tmp-" not in entry:
            shutil.rmtree(other, ignore_errors=True)
    _log.info(f"indexed {path}: {valid:,} pairs ({total - valid:,} malformed lines) -> {final}")
    index = _valid_index(final, fingerprint)
    if index is None:
        raise files.UserError(f"the TSV index {final} could not be read back")
    return index


# --- Random access ----------------------------------------------------------------------------


class TsvCorpus:
    """`corpus[i] -> (source, target)` over a TSV file's valid lines, read from disk on access.

    `take` (line numbers) selects a subset, or `skip` (sorted line numbers)
    removes a few lines from all of them; the training split of a file with
    carved-out dev/test pairs is `skip=dev+test` (memory for the skipped lines
    only, not for the millions kept).
    """

    def __init__(
        self,
        index: LineIndex,
        *,
        take: np.ndarray | None = None,
        skip: np.ndarray | None = None,
        name: str = "",
    ):
        self.index, self.name = index, name or f"tsv:{index.path}"
        self._take = None if take is None else np.asarray(take, np.int64)
        self._skip = None if skip is None else np.sort(np.asarray(skip, np.int64))
        if self._take is not None:
            self._len = len(self._take)
        else:
            self._len = index.num_valid - (0 if self._skip is None else len(self._skip))
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # each process opens the file itself

    def __len__(self) -> int:
        return self._len

    def lines(self, i: np.ndarray) -> np.ndarray:
        """Valid-line numbers of corpus positions `i`."""
        i = np.asarray(i, np.int64)
        if self._take is not None:
            return self._take[i]
        if self._skip is None:
            return i
        # The i-th kept line is i + (skipped lines at or before it).
        return i + np.searchsorted(self._skip - np.arange(len(self._skip)), i, side="right")

    def fingerprint(self) -> dict[str, Any]:
        selection: Any = "all"
        if self._take is not None:
            selection = {"take": hashlib.sha256(self._take.tobytes()).hexdigest()}
        elif self._skip is not None:
            selection = {"skip": hashlib.sha256(self._skip.tobytes()).hexdigest()}
        return {**self.index.fingerprint, "selection": selection}

    def _read(self, offset: int, size: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.index.path, os.O_RDONLY)
        return os.pread(self._fd, size, offset)

    def release_pages(self) -> None:
        """Unmap the line index's pages that reads have mapped into this process."""
        self.index.release_pages()

    def __getitem__(self, i: int) -> tuple[str, str]:
        if not -self._len <= i < self._len:
            raise IndexError(i)
        return self.pairs(np.array([i % self._len]))[0]

    def pairs(self, i: np.ndarray) -> list[tuple[str, str]]:
        """The pairs at positions `i` (sorted positions read a contiguous span at once)."""
        lines = self.lines(i)
        starts, ends = self.index.starts[lines], self.index.ends[lines]
        if not len(lines):
            return []
        lo, hi = int(starts.min()), int(ends.max())
        spans = list(zip(starts.tolist(), ends.tolist(), strict=True))
        if hi - lo <= _MAX_SPAN_BYTES:
            block = self._read(lo, hi - lo)
            raw = [block[s - lo : e - lo] for s, e in spans]
        else:  # strided shards of a large file: one read per line
            raw = [self._read(s, e - s) for s, e in spans]
        out = []
        for r in raw:
            src, tgt = r.decode("utf-8").split("\t")
            out.append((src.strip(), tgt.strip()))
        return out

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

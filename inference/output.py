"""decode.py's output written a chunk at a time: complete only at the end, resumable after a kill.

    job = {"input": file_identity("big.de"), "model": {...}, "settings": {...}}
    out = open_output("big.en", job, restart=False)
    out.done                    # the record of the last complete chunk ({} when starting)
    out.append(data, done)      # a chunk's bytes, then the record that counts them
    out.finish()                # big.en appears, complete; the record is gone

While the job runs, its lines go to `big.en.partial` and the record of its
progress to `big.en.partial.json` (the job: what the output depends on; done:
lines, input offset, output bytes, counters). Each chunk's bytes are written
and fsynced before the record that counts them is replaced (atomically), so
whenever a kill comes (even SIGKILL), the record counts only bytes on disk; a
chunk written after the last record is cut off on resume. The same job run
again continues after its last recorded chunk; a different job (other input,
model or settings) is refused, naming what changed, unless `restart`. An
exclusive lock on the partial file keeps a second process off the same output.
`big.en` itself is replaced only by `finish` (fsync, rename), so an old file of
that name survives until the new one is complete.

Within a chunk, each finished batch's results go to `big.en.partial.journal`
(`Journal`: one JSON line a batch, tagged with the line the chunk starts at),
so a run killed mid-chunk loses at most the batches in flight: the same job
run again reads the chunk again and translates only the sources the journal
lacks (a source's result does not depend on its batch). The journal is
emptied once its chunk is in the output and the record.

stdout, a device or a pipe ('-', /dev/null, a FIFO) is written as it comes,
without a record. A job whose input cannot be read again from an offset
(stdin) has `job=None`: its partial file is started over by every run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

from attention_jax.data import atomic_write
from attention_jax.runtime.errors import UserError
from attention_jax.search.hypothesis import Hypothesis

PARTIAL = ".partial"  # the output while it is written
RECORD = ".partial.json"  # its progress record
JOURNAL = ".partial.journal"  # the results of the running chunk's finished batches
_RECORD_VERSION = 1
_HEAD_BYTES = 1 << 20  # an input's identity hashes its first MiB (size and mtime cover the rest)


# --- What a job's output depends on -------------------------------------------------------


def file_identity(path: str) -> dict[str, Any]:
    """A file as a job input: its absolute path, size, mtime and a hash of its first MiB.

    Any edit of the file changes its size or mtime; the hash also catches a file
    replaced by another one with the same size and mtime.
    """
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest()
    return {
        "path": os.path.abspath(path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "head_sha256": head,
    }


def lines_identity(lines: Sequence[str], **what: Any) -> dict[str, Any]:
    """Lines held in memory (a dataset split) as a job input: `what` they are, their count
    and a hash of their text."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8", "surrogatepass") + b"\n")
    return {**what, "lines": len(lines), "sha256": digest.hexdigest()}


def _normalized(job: Any) -> Any:
    """The job as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(job))


def differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """'key: old -> new' for each leaf where two jobs differ (dicts compared key by key)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


# --- Outputs ------------------------------------------------------------------------------


class StreamOutput:
    """stdout, a device or a pipe: each chunk is written and flushed as it comes; no record."""

    resumable = False
    done: dict[str, Any] = {}  # noqa: RUF012 (never written to)
    journal = None

    def __init__(self, path: str):
        self.path = path
        self._file: BinaryIO = sys.stdout.buffer if path == "-" else open(path, "wb")  # noqa: SIM115

    def append(self, data: bytes, done: dict[str, Any]) -> None:
        self._file.write(data)
        self._file.flush()

    def finish(self) -> None:
        if self.path != "-":
            self._file.close()

    def close(self) -> None:
        if self.path != "-":
            self._file.close()


def _entry(h: Hypothesis) -> list:
    if h.token_log_probs is not None:  # --score
        return [h.tokens, h.score, None, list(h.token_log_probs)]
    return [h.tokens, h.score] if h.met is None else [h.tokens, h.score, list(h.met)]


def _hypothesis(
    tokens: list, score: float, met: list | None = None, log_probs: list | None = None
) -> Hypothesis:
    return Hypothesis(
        list(tokens),
        float(score),
        None if met is None else tuple(met),
        None if log_probs is None else tuple(float(x) for x in log_probs),
    )


class Journal:
    """The results of the running chunk's finished batches, one JSON line a batch:
    {"at": the chunk's first line, "i": [source indices in the chunk], "h": [[[tokens],
    score(, [met] or null(, [token log-probabilities]))], ...] per source}. Lines of
    another chunk, and a torn last line, are ignored."""

    def __init__(self, path: str, at: int):
        self.path, self.at = path, at
        self._file: Any = None

    def read(self) -> dict[int, list[Hypothesis]]:
        """{source index: its hypotheses} of the batches this chunk finished before."""
        found: dict[int, list[Hypothesis]] = {}
        try:
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        if entry.get("at") != self.at:
                            continue
                        batch = {
                            int(i): [_hypothesis(*h) for h in hyps]
                            for i, hyps in zip(entry["i"], entry["h"], strict=True)
                        }
                    except (ValueError, TypeError, KeyError, AttributeError):  # a torn line
                        continue
                    found.update(batch)
        except FileNotFoundError:
            pass
        return found

    def write(self, indices: Sequence[int], found: Sequence[list[Hypothesis]]) -> None:
        """One finished batch's results, flushed to the OS (a killed process loses none)."""
        if self._file is None:
            self._file = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115
            if self._file.tell():  # after a torn last line, start a line of its own
                self._file.seek(self._file.tell() - 1)
                if self._file.read(1) != "\n":
                    self._file.write("\n")
        hyps = [[_entry(h) for h in hs] for hs in found]
        entry = {"at": self.at, "i": [int(i) for i in indices], "h": hyps}
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def clear(self, at: int) -> None:
        """Empty it for the chunk that starts at line `at`."""
        self.close()
        with open(self.path, "w", encoding="utf-8"):
            pass
        self.at = at


class PartialOutput:
    """A file written beside its final name and renamed there when complete (see the module).

    Use `open_output`; `done` is the record of the last complete chunk, {} at the start.
    """

    resumable = True

    def __init__(self, path: str, job: dict[str, Any] | None, restart: bool):
        self.path, self.partial, self.record = path, path + PARTIAL, path + RECORD
        self.job = None if job is None else _normalized(job)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        existed = os.path.exists(self.partial)  # else a record is stale (a finished job)
        # O_CREAT without O_TRUNC: the lines of an earlier run stay until we know the job.
        fd = os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o666)
        self._file: BinaryIO = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise UserError(
                f"another decode.py is writing {self.partial}; wait for it, or choose "
                "another --output"
            ) from None
        try:
            resumed = self._resumed() if existed and self.job and not restart else None
            self.done = resumed or {}
            if resumed is None:  # a fresh start: an earlier run's journal is another job's
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.record)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path + JOURNAL)
            self._file.truncate(self.done.get("output_bytes", 0))
            self._file.seek(0, os.SEEK_END)
            # a job that cannot be resumed (stdin) keeps no journal
            self.journal = Journal(path + JOURNAL, self.done.get("lines", 0)) if self.job else None
            if resumed is None:
                self._save({})
        except BaseException:
            self._file.close()
            raise

    def _resumed(self) -> dict[str, Any] | None:
        """The record of an earlier run of this job ({} in its first chunk: only its
        journal to go on from); None if there is none to go on from."""
        try:
            with open(self.record, encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            return None  # a first chunk never finished, or a finished job: nothing to keep
        except (OSError, ValueError) as e:
            raise UserError(
                f"cannot read the progress record {self.record} ({e}); add --restart to start over"
            ) from e
        done = record.get("done", {})
        same = record.get("version") == _RECORD_VERSION and record.get("job") == self.job
        if not done.get("lines"):
            # killed in its first chunk: its journal is kept for the same job, else dropped
            return {} if same else None
        if not same:
            changed = differences(record.get("job"), self.job)
            raise UserError(
                f"{self.partial} holds {done.get('lines', 0)} lines of a job with other inputs "
                f"or settings ({'; '.join(changed[:3]) or 'record version'}"
                f"{'; ...' if len(changed) > 3 else ''}): re-run that command to resume it, or "
                "add --restart to start over"
            )
        size = os.fstat(self._file.fileno()).st_size
        if size < done.get("output_bytes", 0):
            raise UserError(
                f"{self.partial} has {size} bytes but its record counts "
                f"{done['output_bytes']}: it was changed by hand; add --restart to start over"
            )
        return done

    def _save(self, done: dict[str, Any]) -> None:
        if self.job is None:
            return
        with atomic_write(self.record, "w") as f:
            json.dump({"version": _RECORD_VERSION, "job": self.job, "done": done}, f)
            f.flush()
            os.fsync(f.fileno())

    def append(self, data: bytes, done: dict[str, Any]) -> None:
        """A complete chunk's bytes, on disk, then `done` (its record: counts with it), then
        the journal emptied for the next chunk."""
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done = {**done, "output_bytes": self._file.tell()}
        self._save(self.done)
        if self.journal is not None:
            self.journal.clear(self.done.get("lines", 0))

    def finish(self) -> None:
        """The output under its name, complete; the record and journal removed."""
        os.fsync(self._file.fileno())
        os.replace(self.partial, self.path)  # still locked: no other run takes the name
        _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        self._file.close()
        if self.journal is not None:
            self.journal.close()
        for leftover in (self.record, self.path + JOURNAL):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)

    def close(self) -> None:
        """Stop without finishing: the partial file, record and journal stay for a resume."""
        self._file.close()
        if self.journal is not None:
            self.journal.close()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_output(
    path: str, job: dict[str, Any] | None, restart: bool
) -> PartialOutput | StreamOutput:
    """The output of decode.py: a `PartialOutput` for a file, a `StreamOutput` for stdout
    ('-') or anything that is not a regular file (a device, a FIFO). UserError for a job
    that cannot be resumed or a file that cannot be written."""
    try:
        if path == "-" or (os.path.exists(path) and not os.path.isfile(path)):
            return StreamOutput(path)
        return PartialOutput(path, job, restart)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from e

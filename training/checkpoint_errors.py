"""Why a checkpoint could not be read or written, and what to tell the user.

Only evidence of damage moves a checkpoint aside (training/checkpoints.py
`restore_latest`): a file that is missing or truncated, or whose contents do
not decode (a checksum or deserialization error), still so after retries. Any
other failure leaves the checkpoints where they are and stops the run with what
to change:

    DAMAGED        missing / truncated / undecodable files: retried, then moved aside
    STORAGE        the storage refuses or times out (permissions, unreachable, EIO
                   that is not a file's fault): retried, then a UserError
    OUT_OF_MEMORY  XLA's RESOURCE_EXHAUSTED, MemoryError: a UserError that says how
                   to need less memory
    BUG            an error of the program (TypeError, AttributeError, ...): raised as it
                   is, after a line saying that nothing was moved
    OTHER          anything else (e.g. no device to put the arrays on): a UserError
KeyboardInterrupt and SystemExit are never caught.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from attention_jax.runtime.errors import UserError

DAMAGED, STORAGE, OUT_OF_MEMORY, BUG, OTHER = "damaged", "storage", "out of memory", "bug", "other"

# Errors of the program itself: a checkpoint is never their cause.
_BUGS = (
    TypeError, AttributeError, NameError, KeyError, IndexError, AssertionError,
    NotImplementedError, ImportError, RecursionError,
)  # fmt: skip
# Decoding errors of a file's contents (JSON metadata, compressed chunks, truncation).
_UNDECODABLE = (json.JSONDecodeError, UnicodeDecodeError, EOFError, zlib.error)
# TensorStore reports failed reads as ValueError("CODE: ..."), CODE an absl status.
_STATUS = re.compile(r"^([A-Z_]+): ")
_DAMAGE_STATUS = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")
_STORAGE_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "PERMISSION_DENIED")

T = TypeVar("T")
_log = logging.getLogger(__name__)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify(exc: Exception) -> str:
    """What a failed read means: DAMAGED, STORAGE, OUT_OF_MEMORY, BUG or OTHER."""
    chain = list(_chain(exc))
    if any(_out_of_memory(x) for x in chain):
        return OUT_OF_MEMORY
    if isinstance(exc, _BUGS):
        return BUG
    for x in chain:
        status = _STATUS.match(str(x)) if isinstance(x, ValueError) else None
        if isinstance(x, _UNDECODABLE) or (status and status[1] in _DAMAGE_STATUS):
            return DAMAGED
        if isinstance(x, (FileNotFoundError, NotADirectoryError)) or (
            isinstance(x, OSError) and x.errno == errno.EIO
        ):
            return DAMAGED  # a file missing, or unreadable however often it is read
        if isinstance(x, OSError) or (status and status[1] in _STORAGE_STATUS):
            return STORAGE
    return OTHER


def _out_of_memory(x: BaseException) -> bool:
    return (
        "RESOURCE_EXHAUSTED" in str(x)
        or isinstance(x, MemoryError)
        or (isinstance(x, OSError) and x.errno == errno.ENOMEM)
    )


def retry(fn: Callable[[], T], attempts: int = 3, wait: float = 1.0) -> T:
    """fn(), tried again after 1 s and 3 s if it fails reading storage (DAMAGED or
    STORAGE): storage that hiccups (a network filesystem timing out) must not get a good
    checkpoint moved aside. Anything else is raised at once."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if attempt == attempts - 1 or classify(e) not in (DAMAGED, STORAGE):
                raise
            _log.warning(f"reading a checkpoint failed ({describe(e)}); retrying")
            time.sleep(wait * (2 * attempt + 1))
    raise AssertionError("unreachable")


def describe(exc: BaseException) -> str:
    """'Type: first line of the message' (at most 300 characters)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def stop_error(exc: Exception, step: int, directory: str) -> UserError | None:
    """The error to stop with for a read of checkpoint `step` that failed for another
    reason than damage (OUT_OF_MEMORY, STORAGE, OTHER); None for a BUG, which the caller
    re-raises as it is."""
    kind = classify(exc)
    what = f"restoring checkpoint step {step} of {directory} failed ({describe(exc)})"
    untouched = "the checkpoints were not touched"
    if kind == BUG:
        _log.error(f"{what}: an error of the program, not of the checkpoint; {untouched}")
        return None
    if kind == OUT_OF_MEMORY:
        return UserError(
            f"{what}: out of memory, not damage; {untouched}. Give each device less to "
            "hold: shard the parameters and optimizer state over more devices with "
            "--config.mesh_fsdp=N, or run fewer devices per host (more processes, fewer "
            "visible devices each); to read only the model, restore on the CPU "
            "(JAX_PLATFORMS=cpu). Then re-run the same command to resume"
        )
    if kind == STORAGE:
        return UserError(
            f"{what}: the storage refused or timed out, after retries; {untouched}. Check "
            "that the workdir is readable and reachable, then re-run the same command"
        )
    return UserError(
        f"{what}: not evidence of damage, so {untouched}. Fix the cause (for example a "
        "missing or busy accelerator: see what `python -c 'import jax; print(jax.devices())'` "
        "lists) and re-run the same command to resume"
    )


class WriteErrors:
    """Turn an OSError of a checkpoint write (also one raised in Orbax's background
    thread and re-raised later) into a UserError that says what to do.

    `done()` lists the complete checkpoints (to say which ones are intact).
    """

    def __init__(self, directory: str, step: int, done: Callable[[], list[int]]):
        self.directory, self.step, self.done = directory, step, done

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        os_error = next(
            (x for x in _chain(exc) if isinstance(x, OSError) and x.errno is not None), None
        )
        if os_error is None:
            return False
        what = f"checkpoint step {self.step}" if self.step >= 0 else "a checkpoint"
        if os_error.errno == errno.ENOSPC:
            fix = "free disk space (or use a --workdir on a larger disk)"
        elif os_error.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
            fix = "make the workdir writable (or use another --workdir)"
        else:
            fix = "fix the storage problem"
        try:
            done = self.done()
        except Exception:
            done = []
        have = f"the newest complete checkpoint is step {done[-1]}" if done else "none is complete"
        raise UserError(
            f"could not write {what} to {self.directory}: {os_error}. Earlier "
            f"checkpoints are intact ({have}); {fix}, then re-run the same command to resume"
        ) from exc

"""Files the project writes: cache locations, atomic writes and directory publication.

Every cache (the Ding parse, a TSV line index, a tokenized corpus shard) is
built in a private temporary directory next to its final one and renamed into
place when complete, so a reader sees either nothing or a finished build:

    tmp = temp_dir(final)                 # '.NAME.tmp-HOST-PID-RANDOM', unique per process
    ... write files, manifest.json last ...
    publish_dir(tmp, final)               # rename; if another process won, use its copy

A build killed midway (even by SIGKILL) leaves only its temporary directory,
which no reader trusts and `remove_stale_temps` deletes later. Single files
(config.json, metrics.jsonl when trimmed, decode.py's output, an export) are
written the same way by `atomic_write`:

    with atomic_write(path, "w") as f:    # a temporary file beside `path`, renamed at the end
        f.write(text)

`files_identity(paths)` digests what a job was made from (a checkpoint, an export): its
files' names, sizes and mtimes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

from attention_jax.runtime.errors import UserError

MANIFEST = "manifest.json"
# Another host's temporary directory untouched for this long belongs to a dead build
# (we cannot ask another host whether its pid is alive).
_FOREIGN_TEMP_AGE_S = 3600
# The process's umask, read once (setting it is the only way to read it), for
# `atomic_write`'s files to get the mode that `open` would give them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)

_log = logging.getLogger(__name__)


def cache_dir() -> str:
    """`$ATTENTION_JAX_CACHE`, else `$XDG_CACHE_HOME/attention-jax`, else ~/.cache/..."""
    if os.environ.get("ATTENTION_JAX_CACHE"):
        return os.environ["ATTENTION_JAX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-jax")


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """A file (mode "wb" or "w", UTF-8) whose contents replace `path` when the block ends.

    It is written as a temporary file in the same directory and renamed over `path`,
    so a reader sees the old file or the whole new one, never a part of it; an error
    in the block leaves `path` as it was. The file gets the permissions `open` gives.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's own mode is owner-only
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes) -> None:
    """`data` into `path`, atomically (see `atomic_write`)."""
    with atomic_write(path) as f:
        f.write(data)


def _host() -> str:
    return socket.gethostname().replace(os.sep, "_").replace("-", "_") or "host"


def temp_dir(final: str) -> str:
    """Creates and returns a private build directory next to `final`.

    The name carries host and pid, so processes of a multi-host job that share
    a filesystem never write into each other's builds.
    """
    parent, name = os.path.split(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    path = os.path.join(parent, f".{name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    os.makedirs(path)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(final: str) -> None:
    """Deletes temporary builds of `final` left by dead processes (e.g. SIGKILLed).

    On this host a build is dead when its pid is; another host's build when it
    has not been touched for an hour.
    """
    parent, name = os.path.split(os.path.abspath(final))
    prefix = f".{name}.tmp-"
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return
    host = _host()
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        path = os.path.join(parent, entry)
        parts = entry[len(prefix) :].split("-")
        try:
            same_host, pid = parts[0] == host, int(parts[1])
            age = time.time() - max(
                (os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)),
                default=os.path.getmtime(path),
            )
        except (IndexError, ValueError, OSError):
            continue
        if (same_host and not _pid_alive(pid)) or (not same_host and age > _FOREIGN_TEMP_AGE_S):
            _log.info(f"removing the unfinished build {path}")
            shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: str) -> None:
    """Flushes the files of a build directory and the directory itself to disk."""
    for entry in os.listdir(path):
        with open(os.path.join(path, entry), "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    """The manifest is written last: a directory without one is not a finished build."""
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest of a published directory, or None if absent or unreadable."""
    try:
        with open(os.path.join(directory, MANIFEST), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def publish_dir(tmp: str, final: str) -> None:
    """Renames the finished build `tmp` to `final` (atomic on POSIX filesystems).

    If another process published `final` first, its copy is kept (it was built
    from the same key, so it has the same content) and ours is deleted. A
    `final` without a readable manifest (damaged by hand) is moved aside.
    """
    fsync_dir(tmp)
    for _ in range(2):
        try:
            os.rename(tmp, final)
            return
        except OSError:
            if not os.path.isdir(final):
                raise
            if read_manifest(final) is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return
            move_aside(final)
    raise UserError(f"cannot publish {final}: it keeps being replaced by another process")


def move_aside(path: str) -> None:
    """Renames a damaged cache directory out of the way (kept for inspection)."""
    aside = f"{path}.damaged-{int(time.time())}-{secrets.token_hex(2)}"
    _log.warning(f"moving the damaged cache {path} aside to {aside}; it will be rebuilt")
    with contextlib.suppress(FileNotFoundError):  # another process moved it first
        os.rename(path, aside)


def drop_mapped_pages(*arrays: Any) -> None:
    """Unmap from this process the pages of numpy memmaps that reading has mapped in.

    A process's RSS counts every page of a mapped file it has touched, though none
    of it is the process's own memory. MADV_DONTNEED on a read-only file map drops
    the pages from the process, not from the page cache: the next read maps them
    again, the data unchanged. Arrays in memory (and systems without madvise) are
    left alone.
    """
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None:  # not Linux
        return
    for a in arrays:
        mapped = getattr(a, "_mmap", None)  # numpy.memmap's mmap (views share it)
        if mapped is not None and not mapped.closed:
            mapped.madvise(advice)


def read_versioned_json(directory: str, name: str, version: int, writer: str) -> dict[str, Any]:
    """DIRECTORY/NAME, a JSON file that the command `writer` writes with this
    "format_version": ValueError that says what to run if it is missing or of another
    version (an export from another release of this code)."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: is {directory!r} a directory written by `{writer}`?")
    try:
        with open(path) as f:
            contents = json.load(f)
    except ValueError as e:  # cut short or edited: the export is unusable as it is
        raise ValueError(f"{path} is not valid JSON ({e}): write it again with `{writer}`") from e
    found = contents.get("format_version") if isinstance(contents, dict) else None
    if found != version:
        raise ValueError(
            f"{path}: format version {found}, this version reads {version}: write it again "
            f"with `{writer}`"
        )
    return contents


def files_identity(paths: Iterable[str]) -> str:
    """A digest of the names, sizes and mtimes of `paths` and of every file under those that
    are directories (a checkpoint, an exported translator): rewriting any of them changes it."""
    entries = []
    for top in paths:
        found = [top]
        if os.path.isdir(top):
            found = [os.path.join(d, f) for d, _, files in os.walk(top) for f in files]
        for path in found:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(path)
                entries.append(f"{os.path.abspath(path)}\t{st.st_size}\t{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()

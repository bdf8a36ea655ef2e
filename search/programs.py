"""Compiled search programs kept on disk, so a new process skips tracing and lowering.

    programs.enable("~/.cache/attention-jax/xla/programs")  # decode.py does this
    out = programs.call(beam._start, graphdef, args, static)  # _start(graphdef, *args, **static)

JAX's persistent compilation cache skips XLA's compilation, but every process
still traces and lowers each program to find its cache entry: ~0.5 s per beam
search program of the tiny model on the 2-core box (0.2-0.37 s tracing, 0.19 s
lowering, 0.1 s loading), and a file of a few widths runs 10-15 of them. Here a
program compiled once is serialized whole (`jax.experimental.serialize_executable`)
under a key made of everything it was built from -- the code of model/, the
versions of jax, jaxlib, flax and Python, the backend and device, $XLA_FLAGS, the
model's structure and config, the static arguments and the shapes, dtypes and
structure of the others -- and later processes load it in ~0.1 s.

Only single-device calls are kept (a sharded evaluation goes through `jax.jit`
as before), and only programs XLA can serialize: for one it cannot (XLA:CPU's
small sorts) an empty `<key>.unkept` file sends later processes through
`jax.jit` and XLA's own cache. A file that cannot be read or loaded is compiled
again and replaced; a directory that cannot be written costs nothing but the speed-up.
Executables are compiled here with JAX's own cache off: one that JAX's cache
handed back cannot be serialized again on XLA:CPU (it runs, but its copy fails
to find its kernels). The files are pickles (as `serialize_executable`'s payloads
are): keep the directory as private as the code you run.

`prepare` starts loading or compiling a program in a background thread before it
is first called, so that the programs a job will need (its batches' shapes are
known once it is planned) compile side by side, on as many cores as the host
has, while the first ones already run; a call of a program being prepared waits
for it. On a GPU, where each search program of base's size takes ~10-15 s to
compile, this is most of a first run's start.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import os
import pickle
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import jax

from search import timing

_directory: str | None = None
# key -> a loaded or compiled executable (jax.stages.Compiled), or the jitted function
_loaded: dict[str, Any] = {}
# key -> the future of a program `prepare` is loading or compiling
_pending: dict[str, concurrent.futures.Future] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()
_cache_off_count = 0  # compiles under way with JAX's cache off (see `_jax_cache_off`)
SUFFIX = ".jaxexe"
# Part of every key. 2: files of format 1 may hold programs XLA's cache handed back,
# which load but fail at run time ("Function ... not found"): never read them.
FORMAT = 2
UNKEPT = ".unkept"  # an empty file: XLA could not serialize the program of this key


def enable(directory: str | None) -> str | None:
    """Keep programs in `directory` (created if needed); None = off. Returns the directory
    in use (None if it cannot be created, e.g. a read-only home)."""
    global _directory
    if directory is not None:
        directory = os.path.abspath(os.path.expanduser(directory))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError:
            directory = None
    _directory = directory
    return directory


@functools.cache
def _environment() -> str:
    """What every program depends on besides its arguments: code, versions, backend."""
    import flax
    import jaxlib

    import model

    model_dir = os.path.dirname(os.path.abspath(model.__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".py"):
            with open(os.path.join(model_dir, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read() + b"\0")
    device = jax.devices()[0]
    return repr(
        (
            FORMAT,
            digest.hexdigest(),
            jax.__version__,
            jaxlib.__version__,
            flax.__version__,
            sys.version_info[:2],
            device.platform,
            device.device_kind,
            device.client.platform_version,
            os.environ.get("XLA_FLAGS", ""),
        )
    )


@functools.lru_cache(maxsize=8)
def _model_text(graphdef: Any) -> str:
    """The model's structure and config (graphdefs are hashable), without the object
    addresses (e.g. of the activation) that vary from process to process."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(graphdef))


def _key(fn: Any, graphdef: Any, leaves: list, treedef: Any, static: dict) -> str:
    avals = [(tuple(x.shape), str(x.dtype)) for x in leaves]
    model = _model_text(graphdef)
    what = (_environment(), fn.__module__, fn.__qualname__, model, sorted(static.items()))
    return hashlib.sha256(repr((*what, treedef, avals)).encode()).hexdigest()


def _single_device(leaves: list) -> bool:
    """Concrete arrays on one device (not tracers: e.g. `--export` traces the search)."""
    return all(
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) == 1
        and x.is_fully_addressable
        for x in leaves
    )


def _load(path: str) -> Any | None:
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception:  # a torn, stale or foreign file: compile again and replace it
        return None


def _save(path: str, compiled: Any) -> None:
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception:  # e.g. XLA:CPU's "`LessThan` is not serializable" (a small sort)
        blob, path = b"", path[: -len(SUFFIX)] + UNKEPT  # later processes: jax.jit
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
    except OSError:  # e.g. a full or read-only disk: only the speed-up is lost
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _jax_cache_off() -> Iterator[None]:
    """JAX's compilation cache off while any compile of ours runs (threads share it)."""
    global _cache_off_count
    from jax.experimental.compilation_cache import compilation_cache

    with _lock:
        if _cache_off_count == 0:
            _cache_off_count_before[0] = jax.config.jax_enable_compilation_cache
            # JAX decides once per process whether its cache is used; reset_cache() makes
            # it look at the setting again, here and after.
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        _cache_off_count += 1
    try:
        yield
    finally:
        with _lock:
            _cache_off_count -= 1
            if _cache_off_count == 0:
                jax.config.update("jax_enable_compilation_cache", _cache_off_count_before[0])
                compilation_cache.reset_cache()


_cache_off_count_before = [False]


def _compile(fn: Any, graphdef: Any, args: tuple, static: dict) -> Any:
    """Compiled afresh, never handed back by XLA's cache (see the module docstring)."""
    lowered = fn.trace(graphdef, *args, **static).lower()
    with _jax_cache_off():
        return lowered.compile()


def _obtain(key: str, fn: Any, graphdef: Any, args: tuple, static: dict) -> Any:
    """The executable of `key`: kept on disk, or compiled now (and kept)."""
    path = os.path.join(_directory, key + SUFFIX)
    if os.path.exists(os.path.join(_directory, key + UNKEPT)):
        return functools.partial(fn, graphdef, **static)  # as before: jax.jit
    with timing.phase("programs"):
        compiled = _load(path) if os.path.exists(path) else None
    if compiled is not None:
        timing.count("loaded")
        return compiled
    compiled = _compile(fn, graphdef, args, static)
    _save(path, compiled)
    return compiled


def call(fn: Any, graphdef: Any, args: tuple, static: dict) -> Any:
    """fn(graphdef, *args, **static) for a `jax.jit` function whose first argument
    (graphdef) and `static` are static: through a kept executable when enabled and
    every array of args is on one device, else as a plain call."""
    if _directory is None:
        return fn(graphdef, *args, **static)
    leaves, treedef = jax.tree.flatten(args)
    if not _single_device(leaves):
        return fn(graphdef, *args, **static)
    key = _key(fn, graphdef, leaves, treedef, static)
    compiled = _loaded.get(key)
    if compiled is None:
        future = _pending.pop(key, None)
        if future is not None:
            with timing.phase("programs_wait"):
                compiled = future.result()
        else:
            compiled = _obtain(key, fn, graphdef, args, static)
        _loaded[key] = compiled
    return compiled(*args)


def prepare(fn: Any, graphdef: Any, args: tuple, static: dict) -> None:
    """Start loading or compiling the program `call(fn, graphdef, args, static)` will run,
    in a background thread; args may hold `jax.ShapeDtypeStruct`s for the arrays.
    Nothing is done when programs are not kept, or for arrays on several devices."""
    global _pool
    if _directory is None:
        return
    leaves, treedef = jax.tree.flatten(args)
    concrete = [x for x in leaves if not isinstance(x, jax.ShapeDtypeStruct)]
    if not _single_device(concrete):
        return
    key = _key(fn, graphdef, leaves, treedef, static)
    with _lock:
        if key in _loaded or key in _pending:
            return
        if _pool is None:
            workers = max(1, min(8, (os.cpu_count() or 2) - 1))
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
        _pending[key] = _pool.submit(_obtain, key, fn, graphdef, args, static)

"""Compiled search programs kept on disk, so a new process skips tracing and lowering.

    programs.enable("~/.cache/attention-jax/xla/programs")  # decode.py does this
    out = programs.call(segments._start, graphdef, args, static)  # _start(graphdef, *args, **kw)

JAX's persistent compilation cache skips XLA's compilation, but every process
still traces and lowers each program to find its cache entry, which for a beam
search costs several times what loading it does (docs/jobs.md), and a job runs
several per source width. Here a program compiled once is serialized whole
(`jax.experimental.serialize_executable`) under a key made of everything it was
built from -- the code of model/ and search/ (not their comments or docstrings), the
versions of jax, jaxlib, flax and Python, the backend and device, $XLA_FLAGS, the
model's structure and config, the static arguments and the shapes, dtypes and
structure of the others -- and later processes load it whole.

Only single-device calls are kept (a sharded evaluation goes through `jax.jit` as
before), and only programs XLA can serialize: for one it cannot (XLA:CPU's small
sorts) an empty `<key>.unkept` file sends later processes through `jax.jit` and
XLA's own cache. A file that cannot be read or loaded is compiled again and
replaced; a directory that cannot be written costs nothing but the speed-up.

Programs are compiled with JAX's persistent cache on, as every other compile of the
process. An executable that XLA's cache handed back (not compiled afresh; or one JAX
held in memory, which may have come from there) cannot be kept: serialized again, it
fails in the next process on XLA:CPU ("Function ... not found"). That happens when the
cache holds a program these files do not (they were deleted, or an edit of model/
changed their keys but not the program, as an upgrade does): the program is then
compiled once more, with a compiler option that changes nothing but the cache's key,
and kept, so that later processes load it whole instead of tracing it every time. The
files are pickles (as `serialize_executable`'s payloads are): keep the directory as
private as the code you run.

`prepare` starts loading or compiling a program in a background thread before it
is first called, so that the programs a job will need (its batches' shapes are
known once a chunk is read and planned) compile side by side, on as many cores as
the host has, while the first ones already run. A call of a program being prepared
waits for it; one of a program still queued takes it from the queue and compiles it
on its own thread. On a GPU, where a search program of base's size takes seconds to
compile, this is most of a first run's start. A program a job rarely runs is prepared
with `load=False`: compiled and kept if it is not kept yet, else left on disk until a
call needs it: loading takes the cores the searches beside it would use.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import os
import pickle
import re
import sys
import threading
import tokenize
from typing import Any

import jax

from attention_jax.data import atomic_write_bytes
from attention_jax.runtime.cpus import usable_cpus
from attention_jax.search import timing

_directory: str | None = None
# key -> a loaded or compiled executable (jax.stages.Compiled), or the jitted function
_loaded: dict[str, Any] = {}
# key -> the future of a program `prepare` is loading or compiling
_pending: dict[str, concurrent.futures.Future] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()
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
        else:  # parsing the code takes a moment: not on the first program's path
            threading.Thread(target=_code, name="programs-code", daemon=True).start()
    _directory = directory
    return directory


def enabled() -> bool:
    """Whether programs are kept (and `prepare` does anything)."""
    return _directory is not None


def enable_beside(cache: str | None) -> str | None:
    """Keep programs in the `programs` directory of XLA's cache directory `cache` (as
    train.py and decode.py do); None = off. Returns the directory in use."""
    return enable(None if cache is None else os.path.join(cache, "programs"))


@functools.cache
def _environment() -> str:
    """What every program depends on besides its arguments: code, versions, backend."""
    import flax
    import jaxlib

    device = jax.devices()[0]
    return repr(
        (
            FORMAT,
            _code(),
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


@functools.cache
def _code() -> str:
    """The digest of the network's code and the search's: a program is both, traced."""
    import attention_jax
    from attention_jax import search

    return code_digest(
        [os.path.dirname(os.path.abspath(p.__file__)) for p in (attention_jax, search)]
    )


def code_digest(folders: list[str]) -> str:
    """A digest of the Python code in `folders`: a change to the code makes every kept
    program stale, but not one to comments, docstrings or layout (the programs are the
    same, and XLA's cache would hand them back: then they could not be kept again)."""
    digest = hashlib.sha256()
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tokens = tokenize.generate_tokens(f.readline)
                    code = [f"{t.type} {t.string}" for t in _code_tokens(tokens)]
                digest.update(name.encode() + b"\0" + "\0".join(code).encode() + b"\0")
    return digest.hexdigest()


def _code_tokens(tokens: Any) -> Any:
    """The tokens of a file's code: no comments, blank lines or statements that are a
    string alone (docstrings). tokenize, not ast: CPython 3.11's ast.parse fails when
    two threads run it at once, and the digest is made on a thread of its own."""
    line: list[tokenize.TokenInfo] = []
    for t in tokens:
        if t.type in (tokenize.COMMENT, tokenize.NL):
            continue
        line.append(t)
        if t.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            body = [x for x in line if x.type not in (tokenize.INDENT, tokenize.DEDENT)]
            if all(x.type == tokenize.STRING for x in body[:-1]) and len(body) > 1:
                line = [x for x in line if x.type in (tokenize.INDENT, tokenize.DEDENT)]
            yield from line
            line = []
    yield from line


@functools.lru_cache(maxsize=8)
def _model_text(graphdef: Any) -> str:
    """The model's structure and config (graphdefs are hashable), without the object
    addresses (e.g. of the activation) that vary from process to process."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(graphdef))


def _key(fn: Any, graphdef: Any, leaves: list, treedef: Any, static: dict) -> str:
    """The digest naming fn's program for these arguments. A job calls a few programs
    many times: the digest of each (fn, shapes, static) is kept with the graphdef it was
    made for, and reused while the same graphdef object asks (hashing a graphdef walks
    the module graph; another graphdef object, even an equal one, gets a fresh digest)."""
    shapes = tuple((tuple(x.shape), x.dtype) for x in leaves)
    memo = (fn, treedef, shapes, tuple(sorted(static.items())))
    with _lock:
        held = _keys.get(memo)
        if held is not None and held[0] is graphdef:
            _keys.move_to_end(memo)
            return held[1]
    avals = [(shape, str(dtype)) for shape, dtype in shapes]
    model = _model_text(graphdef)
    what = (_environment(), fn.__module__, fn.__qualname__, model, sorted(static.items()))
    key = hashlib.sha256(repr((*what, treedef, avals)).encode()).hexdigest()
    with _lock:
        _keys[memo] = (graphdef, key)
        _keys.move_to_end(memo)
        if len(_keys) > _KEYS_HELD:  # the least recently used goes, with its graphdef
            _keys.popitem(last=False)
    return key


# (fn, treedef, shapes, static) -> (graphdef, key): `_key`'s digests, most recent last
_keys: collections.OrderedDict[tuple, tuple[Any, str]] = collections.OrderedDict()
_KEYS_HELD = 128


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
    except Exception:  # a torn, stale or foreign file: compile again (and replace it)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None


def _save(path: str, compiled: Any) -> None:
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception:  # e.g. XLA:CPU's "`LessThan` is not serializable" (a small sort)
        blob, path = b"", path[: -len(SUFFIX)] + UNKEPT  # later processes: jax.jit
    with contextlib.suppress(OSError):  # e.g. a full or read-only disk: only the speed-up is lost
        atomic_write_bytes(path, blob)  # readers see the old file or the whole new one


_events = threading.local()  # what XLA did for this thread's compiles (counts)


def _on_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _events.hits = getattr(_events, "hits", 0) + 1


def _on_duration(event: str, seconds: float, **_: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # compiled, or read from a cache
        _events.compiles = getattr(_events, "compiles", 0) + 1


def _compile(fn: Any, graphdef: Any, args: tuple, static: dict) -> tuple[Any, bool]:
    """(the executable, whether XLA compiled it afresh: not read from its persistent cache,
    nor an executable JAX already held in memory, which may have come from that cache).
    One handed back is compiled again under another cache key, so that it can be kept."""
    global _listening
    if not _listening:
        import jax.monitoring

        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True
    lowered = fn.trace(graphdef, *args, **static).lower()
    compiled, fresh = _counted(lowered.compile)
    if not fresh:
        with contextlib.suppress(Exception):  # an XLA without the option: used, not kept
            compiled, fresh = _counted(lambda: lowered.compile(compiler_options=_new_cache_key()))
    return compiled, fresh


def _counted(compile_: Any) -> tuple[Any, bool]:
    """(compile_(), whether XLA compiled it rather than a cache handing it back)."""
    before = getattr(_events, "hits", 0), getattr(_events, "compiles", 0)
    compiled = compile_()
    after = getattr(_events, "hits", 0), getattr(_events, "compiles", 0)
    return compiled, after[0] == before[0] and after[1] > before[1]


def _new_cache_key() -> dict[str, int]:
    """Compiler options that give the persistent cache a key it has never seen, and change
    nothing else: a limit on how much of a buffer assignment XLA's debug strings print
    (part of the key, unlike the dump flags JAX leaves out of it)."""
    import random

    return {"xla_debug_buffer_assignment_show_max": (1 << 20) + random.randrange(1 << 20)}


_listening = False


def _file(key: str, suffix: str) -> str:
    """The file of `key` in the directory: its program (SUFFIX), or that it has none (UNKEPT)."""
    return os.path.join(_directory, key + suffix)


def _obtain(key: str, fn: Any, graphdef: Any, args: tuple, static: dict) -> Any:
    """The executable of `key`: kept on disk, or compiled now (and kept)."""
    path = _file(key, SUFFIX)
    if os.path.exists(_file(key, UNKEPT)):
        return functools.partial(fn, graphdef, **static)  # as before: jax.jit
    with timing.phase("programs"):
        compiled = _load(path) if os.path.exists(path) else None
    if compiled is not None:
        timing.count("loaded")
        return compiled
    compiled, fresh = _compile(fn, graphdef, args, static)
    if fresh:  # one XLA's cache handed back would fail in the next process
        _save(path, compiled)
        timing.count("kept")
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
    while compiled is None:
        with _lock:  # prepared by another thread, or obtained here (and `prepare` knows)
            future = _pending.get(key)
            if future is not None and future.cancel():  # still queued: take it
                future = None
            mine = future is None
            if mine:
                future = _pending[key] = concurrent.futures.Future()
                future.set_running_or_notify_cancel()  # so no other call takes it
        if mine:
            try:
                future.set_result(_obtain(key, fn, graphdef, args, static))
            except BaseException as e:
                future.set_exception(e)
                with _lock:
                    _pending.pop(key, None)
                raise
        with timing.phase("programs_wait"):
            try:
                compiled = future.result()
            except concurrent.futures.CancelledError:  # taken from the queue by another call
                continue
        with _lock:
            _loaded[key] = compiled
            _pending.pop(key, None)
    timing.running()
    return compiled(*args)


def prepare(fn: Any, graphdef: Any, args: tuple, static: dict, *, load: bool = True) -> None:
    """Start loading or compiling the program `call(fn, graphdef, args, static)` will run,
    in a background thread; args may hold `jax.ShapeDtypeStruct`s for the arrays.
    Nothing is done when programs are not kept, or for arrays on several devices.
    load=False (a program a job rarely runs): one kept on disk already stays there until
    its first call loads it; one not kept yet is compiled and kept now, as any other, so
    that a later job never compiles it."""
    global _pool
    if _directory is None:
        return
    leaves, treedef = jax.tree.flatten(args)
    concrete = [x for x in leaves if not isinstance(x, jax.ShapeDtypeStruct)]
    if not _single_device(concrete):
        return
    key = _key(fn, graphdef, leaves, treedef, static)
    if not load and any(os.path.exists(_file(key, suffix)) for suffix in (SUFFIX, UNKEPT)):
        return
    with _lock:
        if _pool is None:
            workers = max(1, min(8, usable_cpus() - 1))
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
        if key not in _loaded and key not in _pending:
            _pending[key] = _pool.submit(_obtain, key, fn, graphdef, args, static)

"""Where decode.py's wall time goes: start-up, programs, host work, device time and idle.

    timing.enable()                        # decode.py --stats=FILE does this first
    with timing.phase("tokenize"): ...     # host work, by name
    with timing.search_call() as call:     # a search: from its launch ...
        call.dispatched(out)               # ... until its outputs are ready
    breakdown = timing.breakdown(lines=1000, tokens=12345)   # a JSON-able dict

Host phases are timed with the host's clock on the thread that runs them (they
do not overlap one another). Programs: JAX's compile events (tracing, lowering,
compiling or reading XLA's cache) and search/programs.py's loading of kept
executables, on whatever thread runs them, and the waits of the main and search threads for a
program another thread prepares. The device is timed without a profiler: a search
keeps the device busy from its launch (the later of the call, once its program is
there, and the previous search's end: one device stream runs them in order) until
a watcher thread sees its outputs ready. The rest of the wall time after start-up
is device idle: the host compiling, or preparing the next batch. Off (the default),
every call here costs a flag test.
"""

from __future__ import annotations

import collections
import contextlib
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",  # an XLA compile, or a read of its cache
)
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
NAMES_SHOWN = 12  # program names in the breakdown


class _State:
    def __init__(self) -> None:
        self.on = False
        self.origin = time.perf_counter()  # the start of the job (enable's `origin`)
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.marks: dict[str, float] = {}
        self.counts: dict[str, int] = collections.defaultdict(int)
        self.names: collections.Counter[str] = collections.Counter()  # XLA programs, by name
        self.device: list[tuple[float, float]] = []  # searches on the device
        self.programs: list[tuple[float, float]] = []  # compiling or loading, any thread
        self.waits: list[tuple[float, float]] = []  # the main thread waiting for programs
        self.last_end = 0.0
        self.queue: queue.Queue[tuple[float, Any] | None] = queue.Queue()
        self.watcher: threading.Thread | None = None
        self.listening = False
        self.local = threading.local()  # the search call under way on this thread


_state = _State()


def enabled() -> bool:
    return _state.on


def enable(origin: float | None = None) -> None:
    """Start timing (process-wide): JAX's compile events and the device watcher. origin:
    when the job started, on `time.perf_counter`'s clock (decode.py: before its imports)."""
    if _state.on:
        return
    _state.on = True
    _state.origin = time.perf_counter() if origin is None else origin
    if not _state.listening:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _state.listening = True
    _state.watcher = threading.Thread(target=_watch, name="device-timing", daemon=True)
    _state.watcher.start()


def _on_critical_path() -> bool:
    """On the critical path: the main thread, or a search thread (search/stages.py)."""
    thread = threading.current_thread()
    return thread is threading.main_thread() or thread.name.startswith("search")


def _on_duration(event: str, seconds: float, fun_name: str = "?", **_: Any) -> None:
    if _state.on and event in _COMPILE_EVENTS:
        now = time.perf_counter()
        _program_time((now - seconds, now))
        if event == _COMPILE_EVENTS[-1]:
            _state.counts["xla_compiles_or_cache_reads"] += 1
            _state.names[fun_name] += 1


def _on_event(event: str, **_: Any) -> None:
    if _state.on and event == _CACHE_HIT:
        _state.counts["xla_cache_reads"] += 1


def _program_time(interval: tuple[float, float]) -> None:
    _state.seconds["programs"] += interval[1] - interval[0]
    _state.programs.append(interval)
    if _on_critical_path():
        _state.waits.append(interval)


def mark(name: str) -> None:
    """Note the time of a moment (e.g. "started": the end of start-up)."""
    if _state.on:
        _state.marks[name] = time.perf_counter() - _state.origin


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the time spent in the block to `name` ("programs": loading a kept program;
    "programs_wait": waiting for one that another thread prepares)."""
    if not _state.on:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        if name == "programs":
            _program_time((t0, end))
        elif name == "programs_wait":
            _state.seconds[name] += end - t0
            _state.waits.append((t0, end))
        else:
            _state.seconds[name] += end - t0


def count(name: str, n: int = 1) -> None:
    """Count n more of `name` (e.g. "loaded": programs read from disk)."""
    if _state.on:
        _state.counts[name] += n


def counted(name: str) -> int:
    return _state.counts.get(name, 0)


class _Call:
    """A search under way: launched at `start` (moved on by `running`), then dispatched."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def dispatched(self, outputs: Any) -> None:
        """The search's `outputs` (device arrays), just returned: time it on the device."""
        if _state.on:
            _state.queue.put((self.start, outputs))


@contextlib.contextmanager
def search_call() -> Iterator[_Call]:
    """A search call: the device is busy from its launch until its outputs are ready."""
    call = _Call()
    _state.local.call = call
    try:
        yield call
    finally:
        _state.local.call = None


def running() -> None:
    """The search call under way on this thread has its program and runs it now (what it
    did before, compiling or waiting for its program, was not device time)."""
    call = getattr(_state.local, "call", None)
    if _state.on and call is not None:
        call.start = time.perf_counter()


def _watch() -> None:
    import jax

    while (item := _state.queue.get()) is not None:
        start, outputs = item
        with contextlib.suppress(Exception):  # deleted: the search was read back already
            jax.block_until_ready(outputs)
        end = time.perf_counter()
        begin = min(max(start, _state.last_end), end)
        _state.device.append((begin, end))
        _state.last_end = end
        _state.counts["searches"] += 1
        _state.queue.task_done()


def breakdown(lines: int, tokens: int) -> dict[str, Any]:
    """Seconds by part since the process started, and rates (call at the end of a job).

    startup_s: until the first chunk was read (imports, restore, the output opened);
    work_s: the rest of the wall time. Programs: programs_s, compiling or loading them
    summed over the threads that do it side by side (it may exceed the wall time);
    programs_wall_s, the part of work_s during which any was; programs_critical_s,
    the part the main and search threads spent on them, compiling or waiting (the compile time on
    the critical path). device_busy_s + device_idle_s = work_s; host_bound_s: the
    device idle while no program was compiling or loading (waiting for the host), and
    host_share its share of work_s. beam_row_steps: the beam rows times steps the
    searches ran, those the sources needed, and their ratio (a live model's searches,
    whole or shrinking; an export's programs do not report them). Host phases by name
    (read, tokenize, search_host: planning, filling and placing batches; fetch:
    waiting for results; detokenize, format, write). target_tokens_per_s: tokens over work_s;
    target_tokens_per_s_after_programs: over work_s less programs_critical_s (None
    when that leaves less than 1% of work_s).
    """
    if _state.watcher is not None:
        _state.queue.join()
    now = time.perf_counter()
    wall = now - _state.origin
    startup = min(_state.marks.get("started", 0.0), wall)
    after = _state.origin + startup
    work = wall - startup
    raw = dict(_state.seconds)
    programs = raw.pop("programs", 0.0)
    busy = _union(_state.device, after)
    critical = _union(_state.waits, after)
    # "search" holds the waits for results ("fetch") and for programs (`critical`)
    if "search" in raw:
        raw["search_host"] = max(0.0, raw.pop("search") - raw.get("fetch", 0.0) - critical)
    host_bound = max(0.0, work - _union(_state.device + _state.programs, after))
    counts = dict(_state.counts)
    searches = counts.pop("searches", 0)
    run, needed = counts.pop("beam_row_steps_run", 0), counts.pop("beam_row_steps_needed", 0)
    compiles = counts.pop("xla_compiles_or_cache_reads", 0)
    reads = counts.pop("xla_cache_reads", 0)
    after_programs = work - critical
    return {
        "wall_s": round(wall, 3),
        "startup_s": round(startup, 3),
        "work_s": round(work, 3),
        "programs_s": round(programs, 3),
        "programs_wall_s": round(_union(_state.programs, after), 3),
        "programs_critical_s": round(critical, 3),
        "device_busy_s": round(busy, 3),
        "device_idle_s": round(work - busy, 3),
        "host_bound_s": round(host_bound, 3),
        "host_share": round(host_bound / work, 4) if work > 0 else 0.0,
        "searches": searches,
        # XLA programs compiled, and read from XLA's cache; search programs loaded whole
        # from search/programs.py's files, and written there
        "programs": {"compiled": compiles - reads, "xla_cache": reads, **counts},
        # the same XLA programs (compiled or read) by name, the most frequent first: a
        # helper compiled per shape shows here
        "program_names": dict(_state.names.most_common(NAMES_SHOWN)),
        "phases_s": {k: round(v, 4) for k, v in sorted(raw.items())},
        # beam rows x steps the searches ran, and those the sources needed (each source's
        # K beams until its search ended): the share of the work spent on finished ones
        "beam_row_steps": {
            "run": run,
            "needed": needed,
            "ratio": round(run / needed, 3) if needed else None,
        },
        "lines": lines,
        "target_tokens": tokens,
        "target_tokens_per_s": round(tokens / work, 1) if work > 0 else None,
        "target_tokens_per_s_after_programs": (
            round(tokens / after_programs, 1) if after_programs > 0.01 * work else None
        ),
    }


def _union(intervals: list[tuple[float, float]], after: float) -> float:
    """The length of the union of [start, end) intervals, counted from `after` on."""
    total, reach = 0.0, after
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def report(path: str, lines: int, tokens: int, **facts: Any) -> dict[str, Any]:
    """The breakdown with the devices and `facts`, as one JSON object into `path` and a
    table on stderr (OSError if the file cannot be written); returns it."""
    import jax

    b = breakdown(lines=lines, tokens=tokens)
    b.update(
        backend=jax.default_backend(),
        device_kind=jax.devices()[0].device_kind,
        devices=jax.device_count(),
        **facts,
    )
    with open(path, "w") as f:
        f.write(json.dumps(b) + "\n")
    print(table(b), file=sys.stderr)
    return b


def table(b: dict[str, Any]) -> str:
    """The breakdown as a small table, one part a row, with its share of the wall time."""
    wall = max(b["wall_s"], 1e-9)
    rows = [
        ("start-up", b["startup_s"]),
        ("programs, summed over threads", b["programs_s"]),
        ("programs, wall", b["programs_wall_s"]),
        ("programs, critical path", b["programs_critical_s"]),
    ]
    rows += [(f"  host: {k}", v) for k, v in b["phases_s"].items()]
    rows += [("device busy", b["device_busy_s"]), ("device idle", b["device_idle_s"])]
    rows += [("  idle, waiting for the host", b["host_bound_s"])]
    out = [f"{'part':<31} {'seconds':>9} {'share':>7}"]
    out += [f"{name:<31} {v:>9.2f} {100 * v / wall:>6.1f}%" for name, v in rows]
    out.append(f"{'wall':<31} {b['wall_s']:>9.2f}")
    p = b["programs"]
    out.append(
        f"programs: {p['compiled']} compiled, {p['xla_cache']} from XLA's cache, "
        f"{p.get('loaded', 0)} loaded whole; {b['searches']} searches"
    )
    if b.get("program_names"):
        names = ", ".join(f"{name} {n}" for name, n in list(b["program_names"].items())[:5])
        out.append(f"XLA programs by name: {names}")
    steps = b.get("beam_row_steps") or {}
    if steps.get("needed"):
        out.append(
            f"beam-row steps: {steps['run']} run, {steps['needed']} needed (x{steps['ratio']})"
        )
    out.append(
        f"{b['lines']} lines, {b['target_tokens']} target tokens: "
        f"{b['target_tokens_per_s']} tokens/s after start-up"
    )
    return "\n".join(out)

"""Where decode.py's wall time goes: start-up, programs, host work, device time and idle.

    timing.enable()                        # decode.py --stats=FILE does this first
    with timing.phase("tokenize"): ...     # host work, by name
    timing.dispatched(out)                 # a search's outputs, just dispatched
    breakdown = timing.breakdown(lines=1000, tokens=12345)   # a JSON-able dict

Host phases are timed with the host's clock on the thread that runs them (they
do not overlap one another). Compiling or loading programs is what JAX reports
(`/jax/core/compile/...` events) plus search/programs.py's loading of kept
executables. The device is timed without a profiler: a watcher thread waits
for each dispatched search in turn and notes when it is ready; a search keeps
the device busy from the later of its dispatch and the previous one's end until
its own end (one device stream runs them in order). The rest of the wall time
after start-up is device idle: the host compiling, or preparing the next batch.
Off (the default), every call here costs a flag test.
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
    "/jax/core/compile/backend_compile_duration",
)


class _State:
    def __init__(self) -> None:
        self.on = False
        self.origin = time.perf_counter()  # the start of the job (enable's `origin`)
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.marks: dict[str, float] = {}
        self.counts: dict[str, int] = collections.defaultdict(int)
        self.busy = 0.0  # device seconds
        self.intervals: list[tuple[float, float]] = []  # device busy or compiling
        self.searches = 0
        self.last_end = 0.0
        self.queue: queue.Queue[tuple[float, Any] | None] = queue.Queue()
        self.watcher: threading.Thread | None = None
        self.listening = False


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

        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _state.listening = True
    _state.watcher = threading.Thread(target=_watch, name="device-timing", daemon=True)
    _state.watcher.start()


def _on_event(event: str, seconds: float, **_: Any) -> None:
    if _state.on and event in _COMPILE_EVENTS:
        _state.seconds["programs"] += seconds
        if threading.current_thread() is threading.main_thread():
            _state.seconds["programs_main"] += seconds
        if event == _COMPILE_EVENTS[-1]:
            _state.counts["compiled_or_cached"] += 1
        now = time.perf_counter()
        _state.intervals.append((now - seconds, now))


def mark(name: str) -> None:
    """Note the time of a moment (e.g. "started": the end of start-up)."""
    if _state.on:
        _state.marks[name] = time.perf_counter() - _state.origin


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the time spent in the block to `name`."""
    if not _state.on:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        _state.seconds[name] += end - t0
        if name == "programs":
            _state.intervals.append((t0, end))
            if threading.current_thread() is threading.main_thread():
                _state.seconds["programs_main"] += end - t0


def count(name: str, n: int = 1) -> None:
    """Count n more of `name` (e.g. "loaded": programs read from disk)."""
    if _state.on:
        _state.counts[name] += n


def counted(name: str) -> int:
    return _state.counts.get(name, 0)


def dispatched(outputs: Any) -> None:
    """A search whose `outputs` (device arrays) were just dispatched: time it on the device."""
    if _state.on:
        _state.queue.put((time.perf_counter(), outputs))


def _watch() -> None:
    import jax

    while (item := _state.queue.get()) is not None:
        start, outputs = item
        with contextlib.suppress(Exception):  # deleted: the search was read back already
            jax.block_until_ready(outputs)
        end = time.perf_counter()
        begin = max(start, _state.last_end)
        _state.busy += max(0.0, end - begin)
        _state.intervals.append((begin, end))
        _state.last_end = end
        _state.searches += 1
        _state.queue.task_done()


def breakdown(lines: int, tokens: int) -> dict[str, Any]:
    """Seconds by part since the process started, and rates (call at the end of a job).

    startup_s: until the first chunk was read (imports, restore, the output opened);
    programs_s: compiling or loading programs (summed over the threads that compile
    side by side, so it may exceed the wall time); device_busy_s / device_idle_s: after
    start-up; host_bound_s: the device idle while no program was compiling (waiting
    for the host); host phases by name (read, tokenize, search_host: planning, filling
    and placing batches; fetch: waiting for results; detokenize, format, write);
    target_tokens_per_s: tokens over the wall time after start-up.
    """
    if _state.watcher is not None:
        _state.queue.join()
    wall = time.perf_counter() - _state.origin
    startup = _state.marks.get("started", 0.0)
    work = max(wall - startup, 1e-9)
    raw = dict(_state.seconds)
    programs = raw.pop("programs", 0.0)  # summed over threads: compiles may run side by side
    on_main = raw.pop("programs_main", 0.0)
    # "search" holds the waits for results ("fetch"), for programs compiled ahead
    # ("programs_wait") and the programs compiled in it
    if "search" in raw:
        waits = raw.get("fetch", 0.0) + raw.get("programs_wait", 0.0) + on_main
        raw["search_host"] = max(0.0, raw.pop("search") - waits)
    seconds = {k: round(v, 4) for k, v in sorted(raw.items())}
    idle = max(0.0, work - _state.busy)
    # compiling may overlap a search on the device (the next batch's program)
    busy_or_compiling = _union(_state.intervals, _state.origin + startup)
    return {
        "wall_s": round(wall, 3),
        "startup_s": round(startup, 3),
        "work_s": round(work, 3),
        "programs_s": round(programs, 3),
        "device_busy_s": round(_state.busy, 3),
        "device_idle_s": round(idle, 3),
        # the device waiting for the host, neither busy nor waiting for a program
        "host_bound_s": round(max(0.0, work - busy_or_compiling), 3),
        "host_share_after_programs": round(
            max(0.0, work - busy_or_compiling) / max(work - programs, 1e-9), 4
        ),
        "searches": _state.searches,
        "programs": dict(_state.counts),
        "phases_s": seconds,
        "lines": lines,
        "target_tokens": tokens,
        "target_tokens_per_s": round(tokens / work, 1),
        "target_tokens_per_s_after_programs": round(tokens / max(work - programs, 1e-9), 1),
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
    rows = [("start-up", b["startup_s"]), ("programs (all threads)", b["programs_s"])]
    rows += [(f"  host: {k}", v) for k, v in b["phases_s"].items()]
    rows += [("device busy", b["device_busy_s"]), ("device idle", b["device_idle_s"])]
    rows += [("  idle, waiting for the host", b["host_bound_s"])]
    out = [f"{'part':<28} {'seconds':>9} {'share':>7}"]
    out += [f"{name:<28} {v:>9.2f} {100 * v / wall:>6.1f}%" for name, v in rows]
    out.append(f"{'wall':<28} {b['wall_s']:>9.2f}")
    out.append(
        f"{b['lines']} lines, {b['target_tokens']} target tokens: "
        f"{b['target_tokens_per_s']:.0f} tokens/s after start-up"
    )
    return "\n".join(out)

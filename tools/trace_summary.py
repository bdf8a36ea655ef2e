"""Where a device's time went in a `jax.profiler` trace: kernel time by kind, top kernels.

    python tools/trace_summary.py TRACE_DIR [--top=25]

Reads the newest `*.xplane.pb` under TRACE_DIR (as `bench/profile.py
--trace_dir`, `bench/decode_step.py --trace_dir` or `jax.profiler.trace` write it)
with `jax.profiler.ProfileData` and sums the kernels of the first GPU or TPU plane by
kind: collectives (NCCL), GEMMs (cuBLAS), attention (cuDNN), reductions (XLA input
fusions), elementwise fusions, copies (with concatenations and transposes). A CPU
trace has no device plane: there the kernels are the XLA operations its runtime
recorded on the host's threads (`ynn_fusion`: YNNPACK's fused dots and their
elementwise neighbours). An operation that runs others (a `while` loop, its body's)
counts only its own time. Also the span from the first kernel's start to the last
one's end, and how much of it no kernel ran (time the device waited for the host).
Prints JSON objects and tables.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections.abc import Iterable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.report import report

# First match wins; names are lower-cased kernel names (XLA fusion or library kernel).
KINDS = (
    ("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")),
    ("attention", ("sdpa", "fmha", "flash", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "convolution", "dot.")),
    ("ynnpack", ("ynn_",)),
    ("copy", ("memcpy", "memset", "copy", "concatenate", "transpose", "dynamic")),
    ("reduction", ("input_", "reduce")),
    ("elementwise", ("loop_", "fusion", "wrapped_")),
)


def kind(name: str) -> str:
    """The kind of one kernel, from its name: one of KINDS' names, else 'other'."""
    low = name.lower()
    for label, keys in KINDS:
        if any(k in low for k in keys):
            return label
    return "other"


def summarize(events: Iterable[tuple[str, int, int]], top: int = 25) -> dict:
    """events (name, start_ns, duration_ns) of one device stream -> totals in ms.

    Returns {span_ms, busy_ms, idle_ms, kernels, kinds: [{kind, ms, share, count}],
    top: [{kernel, kind, ms, count}]}; share is of the busy time. Overlapping
    kernels (several streams) are counted once in busy_ms.
    """
    events = sorted(events, key=lambda e: e[1])
    if not events:
        raise ValueError("no device kernels in the trace")
    busy, end = 0, events[0][1]
    by_kind: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for name, start, dur in events:
        busy += max(0, start + dur - max(start, end))  # union of the intervals
        end = max(end, start + dur)
        for table, key in ((by_kind, kind(name)), (by_name, name)):
            acc = table.setdefault(key, [0.0, 0])
            acc[0] += dur / 1e6
            acc[1] += 1
    span = (end - events[0][1]) / 1e6
    total = sum(ms for ms, _ in by_kind.values())
    kinds = [
        {"kind": k, "ms": ms, "share": ms / total, "count": n}
        for k, (ms, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])
    ]
    names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_ms": span,
        "busy_ms": busy / 1e6,
        "idle_ms": span - busy / 1e6,
        "kernels": len(events),
        "kinds": kinds,
        "top": [{"kernel": n[:90], "kind": kind(n), "ms": ms, "count": c} for n, (ms, c) in names],
    }


def own_times(events: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """events (name, start_ns, duration_ns) of one thread -> the same with each duration
    less the events it encloses (an XLA:CPU `while` runs its body's operations as events
    of their own: counted whole, they would count twice)."""
    out: list[list] = []
    open_: list[list] = []  # the enclosing events of the one at hand, innermost last
    for name, start, dur in sorted(events, key=lambda e: (e[1], -e[2])):
        while open_ and start >= open_[-1][1] + open_[-1][3]:
            open_.pop()
        if open_:
            open_[-1][2] -= min(dur, open_[-1][1] + open_[-1][3] - start)
        event = [name, start, dur, dur]  # [name, start, own, whole]
        out.append(event)
        open_.append(event)
    return [(name, start, max(own, 0)) for name, start, own, _ in out]


# An XLA operation on a CPU trace's host plane: an HLO instruction's name ("dot.184",
# "ynn_fusion.4", "while.111"), not the runtime's ("ThunkExecutor::Execute", "end: ..."),
# Python's ("$api.py:2479 block_until_ready") or JAX's ("PjitFunction(f)").
_XLA_OP = re.compile(r"[a-z_][\w.\-]*")


def device_events(trace_dir: str) -> tuple[str, list[tuple[str, int, int]]]:
    """(plane name, kernel events) of the first device plane of the newest trace in
    trace_dir; in a CPU trace, of the host plane's XLA operations (own times)."""
    from jax.profiler import ProfileData

    found = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    data = ProfileData.from_file(max(found, key=os.path.getmtime))
    planes = list(data.planes)
    for plane in planes:
        if plane.name.startswith(("/device:GPU", "/device:TPU")):
            evs = [(e.name, e.start_ns, e.duration_ns) for line in plane.lines for e in line.events]
            return plane.name, evs
    for plane in planes:
        if plane.name == "/host:CPU":
            evs = []
            for line in plane.lines:
                ops = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
                evs += own_times(op for op in ops if _XLA_OP.fullmatch(op[0]))
            if evs:
                return plane.name, evs
    raise ValueError(f"{trace_dir}: no GPU or TPU plane, nor XLA operations on the host's")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    try:
        plane, events = device_events(args.trace_dir)
        summary = summarize(events, args.top)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_summary.py: {e}")
    meta = {k: summary[k] for k in ("span_ms", "busy_ms", "idle_ms", "kernels")}
    meta["plane"] = plane
    report("trace_summary", meta, summary["kinds"], ["kind", "ms", "share", "count"])
    report("trace_top", {"plane": plane}, summary["top"], ["kernel", "kind", "ms", "count"])


if __name__ == "__main__":
    main()

"""Shared helpers for the benchmarks: timing, device facts, JSON + table output."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def set_gpu_flags() -> None:
    from training.xla import set_gpu_flags as set_flags

    set_flags()


def build_train_step(config):
    """(mesh, graphdef, state, train_step) of `training.steps` for `config`, state born sharded.

    The same set-up as `training.train_and_evaluate` (`steps.train_setup`), checks included.
    """
    from training import config as config_lib
    from training import mesh as mesh_lib
    from training import steps

    config_lib.validate(config)
    mesh = mesh_lib.make_mesh(config)
    setup = steps.train_setup(config, mesh)
    return mesh, setup.graphdef, steps.init_train_state(setup), steps.make_train_step(setup)


def device_info() -> dict[str, Any]:
    import jax

    d = jax.devices()[0]
    return {
        "platform": d.platform,
        "device_kind": d.device_kind,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def block(x):
    import jax

    return jax.block_until_ready(x)


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, iters: int = 10) -> float:
    """Median wall seconds of fn() with the device synchronized around each call."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul_peak(n: int = 8192, dtype: str = "bfloat16") -> float:
    """FLOP/s of an n x n x n matmul on random data (the measured ceiling for MFU)."""
    import jax

    if jax.default_backend() == "cpu":
        n = min(n, 1024)
        dtype = "float32"
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    mm = jax.jit(lambda a, b: a @ b)
    seconds = time_fn(lambda: mm(a, b), warmup=3, iters=20)
    return 2 * n**3 / seconds


def report(name: str, meta: dict[str, Any], rows: Sequence[dict[str, Any]], columns: Sequence[str]):
    """Print one JSON object (machine-readable) then an aligned table (for people)."""
    print(json.dumps({"benchmark": name, **meta, "results": list(rows)}))
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths, strict=True)))
    sys.stdout.flush()


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)

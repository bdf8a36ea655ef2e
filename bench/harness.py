"""What every benchmark measures with: timing, device facts, memory of a process tree,
decode.py runs, and the JSON + table it prints."""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from tools.package_links import link_package, package_dirs
from tools.report import report, table  # noqa: F401  (the benchmarks print through bench.harness)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE_PY = os.path.join(ROOT, "decode.py")
# decode.py's summary line on stderr.
DECODE_SUMMARY = re.compile(
    r"decode\.py: (\d+) lines .*?: ([\d.]+) s, ([\d.]+) sentences/s, ([\d.]+) tokens/s"
)


def set_gpu_flags() -> None:
    from attention_jax.runtime.xla import set_gpu_flags as set_flags

    set_flags()


def build_train_step(config):
    """(mesh, setup, state, train_step) of `training.steps` for `config`, state born sharded.

    The same set-up as `training.train_and_evaluate` (`steps.train_setup`), checks included.
    """
    from attention_jax.training import config as config_lib
    from attention_jax.training import mesh as mesh_lib
    from attention_jax.training import steps

    config_lib.validate(config)
    mesh = mesh_lib.make_mesh(config)
    setup = steps.train_setup(config, mesh)
    return mesh, setup, steps.init_train_state(setup), steps.make_train_step(setup)


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host's CPU as a result row states it: its model name, the widest x86 vector
    extension it has, and the cores this process may use, e.g. "AMD EPYC, AVX-512, 2
    cores" (Linux; elsewhere the platform's word for the processor)."""
    from attention_jax.runtime.cpus import usable_cpus

    name, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    isa = next((label for flag, label in _ISA if flag in flags), None)
    return ", ".join([name, *([isa] if isa else []), f"{usable_cpus()} cores"])


_ISA = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"))  # widest first


def device_info() -> dict[str, Any]:
    import jax

    d = jax.devices()[0]
    return {
        "platform": d.platform,
        "device_kind": d.device_kind,
        "host_cpu": host_cpu(),
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


def measure_matmul_peak(n: int = 8192, dtype: str = "bfloat16", *, chain: int = 20) -> float:
    """FLOP/s of an n x n x n matmul on random data (the measured ceiling for MFU).

    `chain` products are dispatched back to back and the device is synchronized
    once, after the last (the median of 5 such rounds): a product of 8192^3 in
    bf16 takes ~1.4 ms on an H100/H200, and synchronizing after each one, as
    this function first did, added the host's round trip to every product and
    measured 486-650 TFLOP/s on H200s where 769-798 is the chip's rate (so the
    MFU against it came out 1.2-1.6x too high).
    """
    import jax

    if jax.default_backend() == "cpu":
        n = min(n, 1024)
        dtype = "float32"
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    mm = jax.jit(lambda a, b: a @ b)

    def products():
        out = None
        for _ in range(chain):
            out = mm(a, b)  # async dispatch: queued behind the previous product
        return out

    seconds = time_fn(products, warmup=1, iters=5) / chain
    return 2 * n**3 / seconds


def _children(root: int) -> list[int]:
    """root and every process below it (from /proc; Linux)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


def _rss_gb(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of a process in GB: all its resident pages, and the private ones
    (not file pages such as shared libraries or mapped files, which a sum over processes
    would count once per process)."""
    out = {"VmRSS:": 0.0, "RssAnon:": 0.0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0] + ":"
                if key in out:
                    out[key] = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return out["VmRSS:"], out["RssAnon:"]


def run_sampled(
    cmd: Sequence[str], log_path: str, *, env: dict | None = None, cwd: str | None = None
) -> dict[str, Any]:
    """Runs cmd, sampling the RSS of its process tree every 0.1 s (Linux /proc).

    Its stderr goes to `log_path`, each line prefixed with the seconds since the start
    (for phase timings). Returns wall_s, peak_rss_gb (the largest single process, what
    /usr/bin/time reports) and peak_tree_rss_gb (all its processes together: the cache
    build's workers included), peak_tree_anon_gb (their private memory together),
    cpu_s. Raises RuntimeError if cmd fails.
    """
    import resource
    import subprocess
    import threading

    peak = {"one": 0.0, "tree": 0.0, "tree_anon": 0.0}
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log_path, "w") as log, open(log_path + ".stdout", "w+") as out:
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.PIPE, text=True
        )

        def sample() -> None:
            while proc.poll() is None:
                rss = [_rss_gb(p) for p in _children(proc.pid)]
                peak["one"] = max(peak["one"], max((r for r, _ in rss), default=0.0))
                peak["tree"] = max(peak["tree"], sum(r for r, _ in rss))
                peak["tree_anon"] = max(peak["tree_anon"], sum(a for _, a in rss))
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for line in proc.stderr or ():
            log.write(f"{time.perf_counter() - t0:8.2f} {line}")
            log.flush()
        proc.wait()
        sampler.join(1.0)
        out.seek(0)
        stdout = out.read()
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed; see {log_path}")
    return {
        "wall_s": wall,
        # User + system seconds of cmd and every descendant it waited for (the cache
        # build's workers): next to wall_s, it shows how much the shared cores held us back.
        "cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "peak_rss_gb": peak["one"],
        "peak_tree_rss_gb": peak["tree"],
        "peak_tree_anon_gb": peak["tree_anon"],
        "stdout": stdout,
    }


def _has_package_dirs(checkout: str) -> bool:
    """Whether `checkout` maps its folders onto one import name (pyproject.toml)."""
    try:
        package_dirs(checkout)
    except (OSError, KeyError):
        return False
    return True


def failure(stderr: str, size: int = 3000) -> str:
    """What of a failed process's stderr to show, at most `size` characters: after a crash
    ("Fatal Python error", then every Python thread's stack), its first line and the
    stack of the thread that crashed ("Current thread"), else the stacks from the start;
    otherwise the end, where an error's message is."""
    crash = stderr.rfind("Fatal Python error")
    if crash < 0:
        return stderr[-size:]
    head = stderr[crash:].split("\n", 1)[0]
    current = stderr.find("Current thread", crash)
    return head + "\n" + stderr[current if current >= 0 else crash + len(head) :][:size]


def run_decode(args: Sequence[str], *, decode_py: str = DECODE_PY) -> dict[str, Any]:
    """One decode.py process (this checkout's, or `decode_py` of another), run to its end.

    Returns wall_s, cpu_s (user + system of all its threads: the work done, much less
    sensitive than wall time to other processes on the cores), peak_rss_mb, stdout,
    stderr, and from its summary line lines, translate_s, sentences_per_s and
    tokens_per_s. Exits the benchmark with decode.py's error if it fails.
    """
    # The checkout first, then the caller's path (e.g. where a GPU machine's wheels are).
    checkout = os.path.dirname(os.path.abspath(decode_py))
    with (
        tempfile.TemporaryDirectory() as site,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        paths = [checkout, os.environ.get("PYTHONPATH", "")]
        if checkout != ROOT and _has_package_dirs(checkout):
            link_package(site, checkout)  # its code, not this checkout's editable install
            paths.insert(0, site)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, decode_py, *args], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = (f.read().decode("utf-8", "replace") for f in (out, err))
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"decode.py {' '.join(args)} failed ({code}): {failure(stderr)}")
    row: dict[str, Any] = {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # Linux: KiB
        "stdout": stdout,
        "stderr": stderr,
    }
    if m := DECODE_SUMMARY.search(stderr):
        row.update(
            lines=int(m.group(1)),
            translate_s=float(m.group(2)),
            sentences_per_s=float(m.group(3)),
            tokens_per_s=float(m.group(4)),
        )
    return row

"""decode.py for the tests: in this process where the point is not the process, in a child
where it is (another environment, module stubs on the path).

    r = run_decode("--workdir=W", "--input=in.de", stdin=b"...")   # a CompletedProcess

In this process, decode.py's own `main` runs on the parsed flags with stdin, stdout
and stderr swapped for buffers, and exits are caught: the same code as the command,
without ~2.5 s of imports per run. What a run leaves behind is reset (the flags,
decode.py's --stats timing); compiled programs stay loaded, as a second job of a
long-lived process would find them. Kills, several processes and other device
counts run in children (`run_killed` below, test_decode_pace).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_decode(*args, stdin=None, pythonpath="", env=None) -> subprocess.CompletedProcess:
    """decode.py with `args`: in this process, or in a child for `pythonpath` (goes before
    the repository, e.g. module stubs) or `env` (the child's environment, before
    JAX_PLATFORMS and PYTHONPATH are set)."""
    if pythonpath or env is not None:
        env = {**(env or os.environ), "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath + ROOT}
        return subprocess.run(
            [sys.executable, os.path.join(ROOT, "decode.py"), *args],
            input=stdin,
            capture_output=True,
            cwd=ROOT,
            env=env,
            timeout=300,
        )
    return _in_process(list(args), stdin or b"")


def _in_process(args: list[str], stdin: bytes) -> subprocess.CompletedProcess:
    import jax
    from absl import flags

    import decode  # defines decode.py's flags (once)
    from attention_jax.search import timing

    out, err = io.BytesIO(), io.BytesIO()
    streams = [io.TextIOWrapper(b, encoding="utf-8", write_through=True) for b in (out, err)]
    code = 0
    saved = sys.stdin, sys.stdout, sys.stderr
    # decode.py sets these for its process: the tests' own, and their children's, stay
    xla_flags = os.environ.get("XLA_FLAGS")
    cache = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    sys.stdout, sys.stderr = streams
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["decode.py", *args])
        decode.main(["decode.py"])
    except flags.Error as e:
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        code = 1
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush(), sys.stderr.flush()
        sys.stdin, sys.stdout, sys.stderr = saved
        flags.FLAGS.unparse_flags()
        _reset_timing(timing)
        if xla_flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = xla_flags
        for name, value in cache.items():
            jax.config.update(name, value)
    return subprocess.CompletedProcess(["decode.py", *args], code, out.getvalue(), err.getvalue())


_CACHE_SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


def _reset_timing(timing) -> None:
    """--stats turns timing on for the process: a next run starts from scratch."""
    if timing.enabled():
        timing._state.queue.put(None)  # the watcher thread ends
        listening = timing._state.listening
        timing._state = timing._State()
        timing._state.listening = listening


# Runs decode.py in a child that SIGKILLs itself in the append that would record `lines`
# lines: before writing (0), after half the chunk's bytes (1), or after all of them but
# before their record (2).
KILLER = """
import os, runpy, signal, sys
from attention_jax.inference import output
lines, where = int(sys.argv[1]), int(sys.argv[2])
append = output.PartialOutput.append
def killing_append(self, data, done):
    if done["lines"] >= lines:
        if where >= 1:
            self._file.write(data if where == 2 else data[: len(data) // 2])
            self._file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    append(self, data, done)
output.PartialOutput.append = killing_append
sys.argv = ["decode.py", *sys.argv[3:]]
runpy.run_path("decode.py", run_name="__main__")
"""


def run_killed(lines, where, *args) -> subprocess.CompletedProcess:
    """decode.py with `args` in a child that SIGKILLs itself in the append that would
    record `lines` lines, at `where` (KILLER)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-c", KILLER, str(lines), str(where), *args],
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )

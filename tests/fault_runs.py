"""The fault tests' training runs (test_faults, test_restore_faults): the config of their
finished 20-step run (tests/conftest.py's `corpus` and `base` fixtures), a copy of a
run to damage, and train.py in a child."""

import os
import shutil
import subprocess
import sys

from tests.conftest import small_train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(corpus, **overrides):
    base = dict(dataset=corpus, num_train_steps=20, final_eval_max_examples=2)
    return small_train_config(**{**base, **overrides})


def copy(base, tmp_path, name="w"):
    dest = tmp_path / name
    shutil.copytree(base, dest)
    return dest


def run_train_py(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`train.py ARGS` on the CPU (or `python -c CODE ARGS`, CODE running train.py)."""
    program = ["-c", code] if code else ["train.py"]
    return subprocess.run(
        [sys.executable, *program, *args],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )

"""Preemption and death in a 2-process job of `train.py` (CPU, gloo): a stop on one
host stops both at the same step with one checkpoint; a killed host makes the other
stop with a clear error in bounded time; re-running both processes resumes.

Slow (each runs two jobs of two processes): `make test-slow`.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import train_rows, write_reversal_tsv
from tests.cpu_jobs import start_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    return f"tsv:{write_reversal_tsv(path, num_pairs=400, max_words=3, seed=1)}"


def start(workdir, overrides, nproc=2):
    """`train.py` on every process of the job (2 CPU devices each), not waited for."""
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    return start_job(
        nproc,
        lambda i, port: [
            sys.executable,
            "train.py",
            "--config=tests/small_config.py",
            f"--workdir={workdir}",
            f"--coordinator_address=127.0.0.1:{port}",
            f"--num_processes={nproc}",
            f"--process_id={i}",
            *flags,
        ],
    )


def wait_for_step(workdir, step, procs, timeout=240):
    """Block until process 0 has logged `step` (metrics.jsonl)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a process ended early: " + procs[0].communicate()[1][-3000:])
        try:
            if max(train_rows(workdir), default=0) >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def finish(procs, timeout=240):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a process hung") from None
    return outs


def saved_steps(workdir) -> list[int]:
    return sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())


def job(corpus, **overrides):
    base = {
        "dataset": corpus,
        "length_buckets": "(16,)",
        "long_pairs": "truncate",
        "num_train_steps": 400,
        "log_every_steps": 1,
        "checkpoint_every_steps": 0,
        "final_eval_max_examples": 2,
    }
    return {**base, **overrides}


@pytest.mark.parametrize(("target", "sig"), [(1, signal.SIGTERM), (0, signal.SIGINT)])
def test_a_stop_on_one_process_stops_both_at_one_step(corpus, tmp_path, target, sig):
    procs = start(tmp_path, job(corpus))
    wait_for_step(tmp_path, 5, procs)
    procs[target].send_signal(sig)
    outs = finish(procs)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    (stopped,) = saved_steps(tmp_path)  # one cooperative checkpoint, at the same step
    assert 5 <= stopped < 400
    assert f"saved a checkpoint at step {stopped}" in outs[0][1]
    assert max(train_rows(tmp_path)) <= stopped

    # Re-running both processes resumes there.
    procs = start(tmp_path, job(corpus, num_train_steps=stopped + 2))
    outs = finish(procs)
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:]
    assert f"resumed from step {stopped}" in outs[0][1]
    assert saved_steps(tmp_path)[-1] == stopped + 2


def test_a_killed_process_ends_the_other_with_a_clear_error(corpus, tmp_path):
    overrides = job(corpus, checkpoint_every_steps=3, peer_timeout_seconds=10.0)
    procs = start(tmp_path, overrides)
    wait_for_step(tmp_path, 7, procs)  # checkpoints at 3 and 6 are written or in flight
    procs[1].kill()  # the process of host 1, as a lost host (its child dies with it)
    killed_at = time.time()
    _, err = procs[0].communicate(timeout=120)
    waited = time.time() - killed_at
    assert procs[0].returncode == 75, err[-3000:]  # EXIT_PEER_LOST
    assert "re-run the same command on every host to resume" in err.lower()
    last = err.strip().splitlines()[-1]
    assert last.startswith("[job") and "ERROR" in last, err[-3000:]  # ours, and last
    assert "Traceback" not in err
    assert waited < 40, waited  # peer_timeout_seconds (10) + a few heartbeats, at most
    procs[1].communicate()

    # Re-running both resumes from the newest complete checkpoint.
    procs = start(tmp_path, {**overrides, "num_train_steps": 10})
    outs = finish(procs)
    assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:]
    assert "resumed from step" in outs[0][1]
    assert saved_steps(tmp_path)[-1] == 10

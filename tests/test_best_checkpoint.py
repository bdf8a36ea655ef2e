"""train.py keeps the checkpoint of the best dev evaluation and stops early
(config.best_metric, config.early_stop_patience), with a scripted dev metric: the
real evaluation runs, and its chrF is replaced by the script's value for its step."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from attention_jax.training import checkpoints, evaluate
from attention_jax.training.resume import RunTotals
from attention_jax.training.workdir import restore_model
from tests.best_runs import OVERRIDES, scripted
from tests.conftest import small_train_config, write_reversal_tsv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train_and_evaluate in a child with the scripted metric, SIGKILLed in the evaluation of
# step `at` once the checkpoint of step `done` is on disk and the rotation after it has
# deleted step `gone` (Orbax deletes in the background after a save: without the wait the
# kill could land before the deletion, and the steps kept at the kill would vary by chance).
CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from attention_jax.training import evaluate, loop
    from tests.conftest import small_train_config
    from tests.best_runs import OVERRIDES, scripted

    dataset, workdir, at, done, gone = sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:]
    real = scripted(evaluate.evaluate)

    def evaluate_(state, *args, **kwargs):
        out = real(state, *args, **kwargs)
        if int(state.step) == at:
            saved, deleted = (os.path.join(workdir, "checkpoints", s) for s in (done, gone))
            deadline = time.time() + 120
            while not os.path.isdir(saved) or os.path.isdir(deleted):
                if time.time() > deadline:
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    evaluate.evaluate = evaluate_
    loop.train_and_evaluate(small_train_config(dataset=dataset, **OVERRIDES), workdir)
    """
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    return "tsv:" + write_reversal_tsv(path, num_pairs=600, max_words=4, seed=3)


def train(dataset, workdir, monkeypatch) -> dict:
    from attention_jax.training import train_and_evaluate

    monkeypatch.setattr(evaluate, "evaluate", scripted(evaluate.evaluate))
    return train_and_evaluate(small_train_config(dataset=dataset, **OVERRIDES), str(workdir))


def state_of(workdir) -> tuple[list[int], tuple | None, dict]:
    """(the kept checkpoint steps, the best with its metrics, the totals of the newest)."""
    kept = checkpoints.Checkpoints(str(workdir), best_metric="chrf", create=False)
    best = kept.best()
    newest = os.path.join(str(workdir), "checkpoints", str(kept.all_steps()[-1]), "data")
    with open(os.path.join(newest, os.listdir(newest)[0])) as f:
        data = json.load(f)
    totals = {k: data[k] for k in ("best", "best_step", "evals_since_best")}
    return kept.all_steps(), best and (best[0], best[1]["eval_chrf"]), totals


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    with pytest.MonkeyPatch.context() as monkeypatch:
        summary = train(dataset, workdir, monkeypatch)
    return workdir, summary


def test_the_best_is_kept_while_newer_ones_rotate_and_patience_stops_training(
    uninterrupted, caplog
):
    workdir, summary = uninterrupted
    assert summary["stopped_early"] and summary["step"] == 12 and summary["best_step"] == 6
    kept, best, totals = state_of(workdir)
    assert kept == [6, 8, 12]  # the last two (max_checkpoints_to_keep) and the best
    assert best == (6, 30.0)  # the tie at step 12 does not displace the first 30
    assert totals == {"best": 30.0, "best_step": 6, "evals_since_best": 3}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert max(r["step"] for r in rows if "train_loss" in r) == 12  # nothing after the stop
    _, _, step = restore_model(str(workdir), step="best")
    assert step == 6


@pytest.mark.slow  # ~20 s (a child killed, then a resume); the run's own checks are in make test
def test_a_kill_and_a_resume_in_between_change_nothing(
    uninterrupted, dataset, tmp_path, monkeypatch
):
    """Killed at step 10, after the checkpoint of step 8 (which holds 1 evaluation
    without a better one), then resumed: the same stop, best and kept checkpoints."""
    workdir, summary = uninterrupted
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    child = subprocess.run(
        [sys.executable, "-c", CHILD, dataset, str(tmp_path), "10", "8", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert checkpoints.Checkpoints(str(tmp_path), create=False).all_steps() == [6, 8]
    resumed = train(dataset, tmp_path, monkeypatch)
    assert resumed["stopped_early"] and resumed["step"] == summary["step"]
    assert state_of(tmp_path) == state_of(workdir)
    again = train(dataset, tmp_path, monkeypatch)  # a run that stopped early stays stopped
    assert again["stopped_early"] and again["step"] == 12


def test_the_count_of_evaluations_without_a_better_one():
    totals = RunTotals()
    chrf = [10.0, 12.0, 12.0, 11.0, 13.0]
    better = [totals.evaluated("chrf", {"eval_chrf": v}, 2 * i) for i, v in enumerate(chrf)]
    assert better == [True, True, False, False, True] and totals.best_step == 8
    loss = RunTotals()
    better = [loss.evaluated("loss", {"eval_loss": v}, i) for i, v in enumerate([3.0, 2.0, 2.5])]
    assert better == [True, True, False] and (loss.best, loss.evals_since_best) == (2.0, 1)


def test_decode_py_checkpoint_best(uninterrupted, tmp_path):
    from tests.decode_runs import run_decode

    workdir, _ = uninterrupted
    src = tmp_path / "in.txt"
    src.write_text("abc def\n")
    r = run_decode(f"--workdir={workdir}", f"--input={src}", "--checkpoint=best", "--beam_size=1")
    assert r.returncode == 0, r.stderr.decode()
    assert "from step 6" in r.stderr.decode()
    r = run_decode(f"--workdir={workdir}", f"--input={src}", "--checkpoint=best",
                   "--average_last=2")  # fmt: skip
    assert r.returncode == 1 and "drop --checkpoint_step and --average_last" in r.stderr.decode()

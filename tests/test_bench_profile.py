"""bench/profile.py on CPU: every piece is timed, the step-only mode times the step alone,
and the model's FLOP formula (training.metrics.train_flops) agrees with XLA's own count of
the compiled train step (on CPU XLA counts every dot; on a GPU cuBLAS calls are left
out). --host: the batch's copy and every way of calling the step are timed."""

import json

import pytest

from bench import profile


def _reports(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow  # ~6-13 s each: a benchmark's measures; the step is test_train_steps'
@pytest.mark.parametrize("step_only", [False, True])
def test_profile_times_the_pieces_and_counts_the_step_flops(capsys, step_only):
    argv = ["--config=tiny", "--batch_tokens=256", "--length=16"]
    profile.main(argv + (["--step_only"] if step_only else []))
    (report,) = _reports(capsys.readouterr().out)
    pieces = {r["piece"]: r["ms"] for r in report["results"]}
    want = {"train_step"}
    if not step_only:
        want |= {"encoder_fwd", "fwd_loss", "head_loss_fwd_bwd", "fwd_bwd"}
        want |= {"backward (fwd_bwd - fwd_loss)", "optimizer (train_step - fwd_bwd)"}
    assert set(pieces) == want
    assert pieces["train_step"] > 0
    assert report["batch"] == [16, 16]
    assert report["xla_flops_per_step"] == pytest.approx(report["model_flops_per_step"], rel=0.05)


@pytest.mark.slow  # ~8 s: a benchmark's measure; the step's ways are tested in test_train_steps
def test_host_mode_reports_every_way_of_calling_the_step(capsys):
    profile.main(["--host", "--config=tiny", "--batch_tokens=64", "--length=8", "--iters=2"])
    (report,) = _reports(capsys.readouterr().out)
    assert report["benchmark"] == "host_step"
    parts = [r["part"] for r in report["results"]]
    assert parts[:2] == ["batch to device (shard_batch)", "step call, TrainState"]
    leaves, packed = (int(p.split("(")[1].split()[0]) for p in parts[2:])
    assert parts[2].startswith("step call, leaves") and parts[3].startswith("step call, packed")
    assert leaves == report["state_arrays"] and packed < leaves / 10
    assert all(r["ms"] > 0 for r in report["results"])
    assert report["batch"] == [8, 8] and report["state_arrays"] > 100

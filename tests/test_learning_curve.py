"""tools/learning_curve.py: minutes rebuilt from a metrics.jsonl, and the picture written."""

import json

import pytest

from tools import learning_curve


def _rows():
    return [  # as training/loop.py writes them: windows of steps, evaluations
        {"step": 100, "train_loss": 9.0, "steps_per_sec": 2.0},
        {"step": 200, "train_loss": 7.0, "steps_per_sec": 10.0},
        {"step": 200, "eval_loss": 6.0, "eval_bleu": 1.0, "eval_chrf": 10.0, "eval_seconds": 30.0},
        {"step": 300, "train_loss": 5.0, "steps_per_sec": 5.0},
        {"step": 300, "avg_eval_bleu": 9.9, "avg_eval_seconds": 600.0},  # an average: left out
    ]


def test_minutes_are_windows_over_their_rate_plus_evaluation_time():
    points = learning_curve.curve_points(_rows())
    # 100/2 = 50 s, + 100/10 = 10 s, + 30 s evaluating, + 100/5 = 20 s
    assert [p["step"] for p in points] == [100, 200, 200, 300]
    assert [p["minutes"] * 60 for p in points] == pytest.approx([50, 60, 90, 110])
    assert points[2] == {
        "step": 200,
        "minutes": 1.5,
        "eval_loss": 6.0,
        "eval_bleu": 1.0,
        "eval_chrf": 10.0,
    }
    assert points[3]["train_loss"] == 5.0


def test_main_draws_a_png_and_refuses_a_run_without_evaluations(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    png = tmp_path / "curve.png"
    assert learning_curve.main([f"--metrics={metrics}", f"--output={png}"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 200 | 1.50 |  | 6.00 | 1.00 | 10.00 |" in capsys.readouterr().out

    metrics.write_text(json.dumps(_rows()[0]) + "\n")
    assert learning_curve.main([f"--metrics={metrics}", f"--output={png}"]) == 1
    assert "holds no evaluation rows" in capsys.readouterr().err
    assert learning_curve.main([f"--metrics={tmp_path}/missing", f"--output={png}"]) == 1

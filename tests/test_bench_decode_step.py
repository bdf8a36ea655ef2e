"""bench/decode_step.py on CPU: every piece of a beam step is timed for every batch size,
the step's time is fitted to a fixed cost plus a cost per beam row, and with --trace_dir
the step loop's time is summed by XLA operation."""

import json

import pytest

from bench import decode_step


@pytest.mark.slow  # ~20 s: a benchmark's measures; the step itself is test_stages'
def test_every_piece_is_timed_per_batch_size(capsys, tmp_path):
    args = ["--config=tiny", "--sources=2,4", "--room=8", "--steps=4"]
    decode_step.main([*args, f"--trace_dir={tmp_path}"])
    report, kinds, top = [
        json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")
    ]
    assert kinds["benchmark"] == "trace_summary" and top["benchmark"] == "trace_top"
    assert kinds["busy_ms"] > 0 and any(r["count"] >= 4 for r in top["results"])
    assert report["benchmark"] == "decode_step"
    assert [(r["sources"], r["beam_rows"]) for r in report["rows"]] == [(2, 8), (4, 16)]
    for row in report["rows"]:
        for piece in ("step", "decoder", "top_k", "reorder"):
            assert row[f"{piece}_ms"] > 0, piece
        assert "rest_ms" in row
    assert set(report["fit"]) == {"fixed_ms", "per_row_ms"}


def test_more_steps_than_room_is_refused():
    with pytest.raises(SystemExit):
        decode_step.main(["--room=4", "--steps=8"])

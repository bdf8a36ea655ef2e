"""docs/results.md is generated from bench/results/ (tools/results_page.py) and kept current."""

import json

from tools import results_page


def test_the_results_page_is_up_to_date():
    with open(results_page.PAGE, encoding="utf-8") as f:
        assert f.read() == results_page.render(), "run: python tools/results_page.py"


def test_every_results_file_is_named_machine_date_commit(tmp_path):
    import os

    for name in os.listdir(results_page.RESULTS):
        assert results_page.NAME.match(name.split(".")[0]), name
    rows = [{"benchmark": "decode", "command": "x", "results": [{"tokens_per_s": 12345.6}]}]
    (tmp_path / "cpu-zen5-20261127-abcdef0-pace.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n"
    )
    page = results_page.render(str(tmp_path))
    assert "## cpu-zen5, 2026-11-27, commit abcdef0: pace" in page
    assert "| tokens_per_s |" in page and "| 12,346 |" in page

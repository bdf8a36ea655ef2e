"""docs/results.md and the README's results table are generated from bench/results/
(tools/results_page.py) and kept current."""

import json
import os

from tools import results_page


def test_the_results_page_and_the_readme_table_are_up_to_date():
    with open(results_page.PAGE, encoding="utf-8") as f:
        assert f.read() == results_page.render(), "run: python tools/results_page.py"
    with open(results_page.README, encoding="utf-8") as f:
        readme = f.read()
    assert readme == results_page.with_table(readme, results_page.headline_table()), (
        "run: python tools/results_page.py"
    )


def test_every_results_file_is_named_machine_date_commit_and_shown(tmp_path):
    for name in os.listdir(results_page.RESULTS):
        assert results_page.NAME.match(name.split(".")[0]), name
    rows = [
        {"benchmark": "decode", "command": "x", "results": [{"tokens_per_s": 12345.6}]},
        {"benchmark": "make train", "command": "make train", "wall_s": 222},
    ]
    (tmp_path / "cpu-zen5-20261127-abcdef0-pace.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n"
    )
    page = results_page.render(str(tmp_path))
    assert "## cpu-zen5" in page and "- 2026-11-27, abcdef0, pace:" in page
    assert "**decode** `x`: tokens_per_s 12,346" in page
    assert "**make train** `make train`: wall_s 222" in page


def test_every_headline_is_a_value_of_its_file():
    table = results_page.headline_table()
    assert len(table.splitlines()) == 2 + len(results_page.HEADLINES)
    for what, stem, _, _, _ in results_page.HEADLINES:
        assert what in table and f"bench/results/{stem}.jsonl" in table

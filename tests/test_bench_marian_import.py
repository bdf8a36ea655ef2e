"""bench/marian_import.py: it writes an OPUS-MT-shaped model, imports it, and reports
each import's time (a small vocabulary here; the benchmark's default is opus-mt-de-en's)."""

import json

import pytest

from bench import marian_import


@pytest.mark.slow  # ~8 s: a benchmark's run; the import itself is test_marian's in make test
def test_marian_import_times_each_import_of_an_opus_mt_shaped_model(capsys):
    marian_import.main(["--vocab=300", "--repeats=2"])
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[0])
    assert result["benchmark"] == "marian_import" and result["vocab"] == 300
    assert result["npz_mb"] > 100  # 6 + 6 layers, 512 wide: OPUS-MT's shape whatever the vocab
    assert [r["run"] for r in result["results"]] == [0, 1]
    assert all(r["load_s"] > 0 for r in result["results"])
    assert lines[1].split() == ["run", "load_s"]

"""bench/constraints.py on the trained digit workdir: its constraints are met and found in
the text on every line (the beam, 4, exceeds every line's 1 or 2 phrases), every output
starts with its prefix, and the figures it reports are the runs'."""

import json

import pytest

from bench import constraints


def test_wanted_phrases_are_the_longest_words_one_or_two_a_line():
    assert constraints.wanted("one three seven, two", 0) == ["seven"]
    assert constraints.wanted("one three seven, two", 1) == ["seven", "three"]
    assert constraints.first_word("four five") == "four" and constraints.first_word("") == ""


@pytest.mark.slow  # ~30 s: six decode.py runs; the search itself is test_constraints's
def test_every_constraint_and_prefix_is_honoured(workdir, tmp_path, capsys):
    constraints.main([f"--workdir={workdir}", f"--scratch={tmp_path}"])
    out = capsys.readouterr().out
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    refs = (tmp_path / "test.ref").read_text().splitlines()
    assert row["lines"] == len(refs) > 0
    assert row["phrases"] == sum(len(constraints.wanted(r, i)) for i, r in enumerate(refs))
    assert row["met_share"] == 1.0 and row["in_text_share"] == 1.0
    assert row["prefix_share"] == 1.0
    assert row["translate_s_plain"] > 0 and row["cost_constrained"] > 0
    assert 0 <= row["bleu_plain"] <= 100 and 0 <= row["bleu_constrained"] <= 100

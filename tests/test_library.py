"""Translating strings from Python (attention_jax.Translator) gives decode.py's output for
the same lines and settings, byte for byte: from a training workdir, an exported
translator and an OPUS-MT directory; with n-best, prefixes and constraints."""

from __future__ import annotations

import json

import numpy as np
import pytest

import attention_jax
from attention_jax import Translator
from attention_jax.inference.lines import output_text
from attention_jax.runtime.errors import UserError
from tests.decode_runs import run_decode
from tests.digits import digit_pairs
from tests.marian_files import opus_mt_directory


def _lines(seed: int, n: int) -> list[str]:
    lines = [s for s, _ in digit_pairs(np.random.default_rng(seed), n)]
    return [*lines[:3], "", "   ", *lines[3:], "eins " * 40]  # empty lines and a long one


def _decoded(tmp_path, name, lines, *flags):
    """decode.py's output of `lines` (text, or jsonl's objects)."""
    src = tmp_path / f"{name}.in"
    src.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / f"{name}.out"
    r = run_decode(f"--input={src}", f"--output={out}", *flags)
    assert r.returncode == 0, r.stderr.decode()
    return out.read_bytes()


def _as_jsonl(results) -> list[dict]:
    return [
        {"hypotheses": [
            {"text": t, "score": s, "tokens": k}
            for t, s, k in zip(r.hypotheses, r.scores, r.tokens, strict=True)
        ]}
        for r in results
    ]  # fmt: skip


def test_a_workdir_translates_from_python_as_decode_py_does(workdir, tmp_path):
    lines = _lines(5, 30)
    translator = Translator(workdir, batch_tokens=64)
    assert translator.kind == "workdir" and translator.settings.beam_size == 4
    texts = translator.translate(lines)
    want = _decoded(tmp_path, "text", lines, f"--workdir={workdir}", "--batch_tokens=64")
    assert output_text(texts).encode() == want
    assert texts[3] == texts[4] == ""  # an empty line gives an empty translation
    # n-best per call, over the translator's own settings; jsonl's texts, scores, tokens
    flags = ["--n_best=2", "--beam_size=3", "--output_format=jsonl", "--batch_tokens=64"]
    results = translator.translate_batch(lines, beam_size=3, n_best=2)
    want = _decoded(tmp_path, "jsonl", lines, f"--workdir={workdir}", *flags)
    assert _as_jsonl(results) == [json.loads(line) for line in want.decode().splitlines()]
    assert [len(r.hypotheses) for r in results[:5]] == [2, 2, 2, 0, 0]
    assert translator.settings.beam_size == 4  # a call's settings are that call's


def test_prefixes_and_constraints_from_python_are_decode_py_s(workdir, tmp_path):
    lines = [s for s, _ in digit_pairs(np.random.default_rng(8), 12)]
    prefixes = ["one" if i % 3 == 0 else "" for i in range(len(lines))]
    constraints = [["seven"] if i % 2 else [] for i in range(len(lines))]
    (tmp_path / "p.txt").write_text("".join(p + "\n" for p in prefixes))
    (tmp_path / "c.tsv").write_text("".join("\t".join(c) + "\n" for c in constraints))
    translator = Translator(workdir)
    results = translator.translate_batch(lines, prefixes=prefixes, constraints=constraints)
    flags = [f"--prefix={tmp_path}/p.txt", f"--constraints={tmp_path}/c.tsv"]
    want = _decoded(tmp_path, "t", lines, f"--workdir={workdir}", "--output_format=jsonl", *flags)
    got = [
        {"hypotheses": [
            {"text": t, "score": s, "tokens": k, "constraints_met": m}
            for t, s, k, m in zip(r.hypotheses, r.scores, r.tokens, r.constraints_met, strict=True)
        ]}
        for r in results
    ]  # fmt: skip
    assert got == [json.loads(line) for line in want.decode().splitlines()]
    assert all(
        r.hypotheses[0].startswith("one") for r, p in zip(results, prefixes, strict=True) if p
    )


def test_an_export_translates_from_python_and_keeps_its_settings(digit_export, tmp_path):
    export_dir = digit_export
    lines = _lines(6, 10)
    translator = Translator(str(export_dir))
    assert translator.kind == "exported"
    want = _decoded(tmp_path, "e", lines, f"--exported={export_dir}")
    assert output_text(translator.translate(lines)).encode() == want
    assert translator.translate(lines, batch_tokens=32) == translator.translate(lines)
    with pytest.raises(ValueError, match="exported with beam_size=4") as e:
        translator.translate(lines, beam_size=2)
    assert "--" not in str(e.value)  # from Python the message names arguments, not flags


def test_an_opus_mt_directory_translates_from_python_as_decode_py_does(tmp_path):
    directory, lines, _ = opus_mt_directory(tmp_path)
    translator = Translator(directory, beam_size=2)
    assert translator.kind == "marian"
    want = _decoded(tmp_path, "m", lines[:40], f"--marian={directory}", "--beam_size=2")
    assert output_text(translator.translate(lines[:40])).encode() == want


def test_mistakes_are_one_value_error_that_says_what_to_do(workdir, tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        Translator(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no model this library reads"):
        Translator(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="n_best must be in"):
        Translator(workdir, beam_size=2, n_best=3)
    translator = Translator(workdir)
    with pytest.raises(ValueError, match="no search setting named beam"):
        translator.translate(["eins"], beam=2)
    with pytest.raises(ValueError, match="fewer lines than the input"):
        translator.translate_batch(["eins", "zwei"], prefixes=["one"])


def test_the_package_offers_its_public_names():
    for name in attention_jax.__all__:
        assert getattr(attention_jax, name) is not None, name
    with open(attention_jax.__file__.replace("__init__.py", "__init__.pyi")) as f:
        stub = f.read()
    named = {line.split(" as ")[-1].strip() for line in stub.splitlines() if " as " in line}
    assert named == set(attention_jax.__all__)

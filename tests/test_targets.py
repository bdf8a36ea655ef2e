"""decode.py --prefix and --constraints end to end on the trained digit workdir: every
output honours them, the jsonl says which phrases each hypothesis holds, a killed job's
re-run and eight devices write what one uninterrupted device writes, and bad files are
one clear line before anything is written."""

import json
import os
import signal

import numpy as np
import pytest

from tests.decode_runs import run_decode, run_killed
from tests.digits import EN, digit_pairs

FILES = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """40 digit sentences; a prefix file (the reference's first word, or none) and a
    constraints file (one or two words of the reference, some a word it lacks)."""
    d = tmp_path_factory.mktemp("targets")
    rng = np.random.default_rng(12)
    pairs = digit_pairs(rng, FILES, max_words=5)
    prefixes, constraints = [], []
    for i, (_, en) in enumerate(pairs):
        words = en.split()
        prefixes.append(words[0] if i % 3 else "")
        wanted = [words[-1]] if i % 2 else [words[0], str(EN[(i // 2) % 10])]
        constraints.append("\t".join(wanted) if i % 5 else "")
    (d / "in.de").write_text("".join(de + "\n" for de, _ in pairs))
    (d / "prefix.en").write_text("".join(p + "\n" for p in prefixes))
    (d / "terms.tsv").write_text("".join(c + "\n" for c in constraints))
    return d, prefixes, constraints


def jsonl(r):
    return [json.loads(x)["hypotheses"] for x in r.stdout.decode().split("\n")[:-1]]


def test_every_output_starts_with_its_prefix_and_holds_its_phrases(workdir, files):
    d, prefixes, constraints = files
    r = run_decode(
        f"--workdir={workdir}", f"--input={d / 'in.de'}", f"--prefix={d / 'prefix.en'}",
        f"--constraints={d / 'terms.tsv'}", "--output_format=jsonl", "--n_best=2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    lines = jsonl(r)
    assert len(lines) == FILES
    for hyps, prefix, wanted in zip(lines, prefixes, constraints, strict=True):
        phrases = wanted.split("\t") if wanted else []
        for h in hyps:
            assert h["text"].startswith(prefix)
            assert h["constraints_met"] == [True] * len(phrases)
            assert all(p in h["text"].split() for p in phrases), (h["text"], phrases)
    # Where a phrase is not in the source, the search adds it: the outputs differ from
    # the unconstrained ones there, and only there is the translation not the reference.
    free = run_decode(f"--workdir={workdir}", f"--input={d / 'in.de'}")
    assert free.returncode == 0, free.stderr.decode()
    free_lines = free.stdout.decode().split("\n")[:-1]
    changed = sum(a[0]["text"] != b for a, b in zip(lines, free_lines, strict=True))
    assert changed > 0


def job_args(wd, d):
    return [f"--workdir={wd}", f"--input={d / 'in.de'}", f"--prefix={d / 'prefix.en'}",
            f"--constraints={d / 'terms.tsv'}", "--output_format=jsonl",
            "--read_lines=8"]  # fmt: skip


def test_a_killed_job_writes_the_uninterrupted_output(workdir, files, tmp_path):
    d, _, _ = files
    args = job_args(workdir, d)
    whole = run_decode(*args)
    assert whole.returncode == 0, whole.stderr.decode()
    out = tmp_path / "out.jsonl"
    assert run_killed(16, 1, *args, f"--output={out}").returncode == -signal.SIGKILL
    r = run_decode(*args, f"--output={out}")
    # (the chunk being written when it was killed is lost: 8 lines are kept)
    assert r.returncode == 0 and "8 lines were done" in r.stderr.decode(), r.stderr.decode()
    assert out.read_bytes() == whole.stdout


@pytest.mark.slow  # ~8 s: 8 devices without constraints are test_decode_pace's in make test
def test_eight_devices_write_the_single_devices_output(workdir, files):
    from attention_jax.training.workdir import load_workdir
    from tests.parity import NearTies, source_ids

    d, _, _ = files
    args = job_args(workdir, d)
    one = run_decode(*args)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    eight = run_decode(*args, env={**os.environ, "XLA_FLAGS": flags})
    assert one.returncode == 0 and eight.returncode == 0, eight.stderr.decode()
    tokens = lambda run: [[h["tokens"] for h in hyps] for hyps in jsonl(run)]
    model, config, _, tokenizer = load_workdir(workdir)
    sources = source_ids(tokenizer, (d / "in.de").read_bytes(), config.max_length)
    starts = [x[:-1] for x in source_ids(tokenizer, (d / "prefix.en").read_bytes(), 64)]
    result = NearTies(model).compare(sources, tokens(eight), tokens(one), prefixes=starts)
    assert result.ok, result.report()


@pytest.mark.parametrize(
    ("write", "flags", "message"),
    [
        ({"prefix.en": "one\n"}, ["--prefix={d}/prefix.en"],
         "--prefix has 1 lines but the input 2"),
        ({"t.tsv": "one\n\n\n"}, ["--constraints={d}/t.tsv"], "--constraints has 3 lines"),
        ({"t.tsv": "one\u200b\t\u200b\n\n"}, ["--constraints={d}/t.tsv"],
         "--constraints line 1: '\\u200b' encodes to no tokens"),
        ({"t.tsv": "one\ttwo\tthree\n\n"}, ["--constraints={d}/t.tsv", "--max_constraints=2"],
         "line 1 has 3 phrases, more than --max_constraints=2"),
        ({"t.tsv": "one two three four\n\n"}, ["--constraints={d}/t.tsv", "--constraint_tokens=2"],
         "more than --constraint_tokens=2"),
        ({}, ["--prefix={d}/missing"], "--prefix {d}/missing does not exist"),
        ({"t.tsv": "one\n\n"}, ["--constraints={d}/t.tsv", "--long_lines=split"],
         "need --long_lines=truncate or sentences"),
        ({"t.tsv": "one\n\n"}, ["--constraints={d}/t.tsv", "--max_constraints=0"],
         "--max_constraints must be >= 1"),
    ],
)  # fmt: skip
def test_bad_files_and_settings_are_one_line_before_anything_is_written(
    workdir,
    tmp_path,
    write,
    flags,
    message,
):
    for name, text in write.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "in.de").write_text("eins\nzwei\n")
    out = tmp_path / "out.en"
    flags = [f.format(d=tmp_path) for f in flags]
    r = run_decode(
        f"--workdir={workdir}", f"--input={tmp_path / 'in.de'}", f"--output={out}", *flags
    )
    err = r.stderr.decode()
    assert r.returncode == 1 and message.format(d=tmp_path) in err and "Traceback" not in err, err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_backends_that_cannot_honour_them_refuse(workdir, tmp_path):
    (tmp_path / "t.tsv").write_text("one\n")
    for backend, message in (
        ("--ct2={d}", "CTranslate2 (--ct2) has no terminology constraints"),
        ("--exported={d}", "an exported translator takes no --constraints"),
    ):
        r = run_decode(
            backend.format(d=tmp_path), f"--constraints={tmp_path / 't.tsv'}", stdin=b"eins\n"
        )
        err = r.stderr.decode()
        assert r.returncode == 1 and message in err and "Traceback" not in err, err


def test_a_prefix_and_phrases_appear_as_the_user_wrote_them(workdir, tmp_path):
    """The tokenizer's NFKC turns 'ｎｉｎｅ' into 'nine' and '…' into '...': the output keeps
    the user's text wherever the decoded pieces are its normalized form."""
    from attention_jax import Translator

    pairs = digit_pairs(np.random.default_rng(17), 6, max_words=4)
    (tmp_path / "in.de").write_text("".join(s + "\n" for s, _ in pairs))
    (tmp_path / "prefix.en").write_text("ｎｉｎｅ\n\nfive…\n\n\n\n")
    (tmp_path / "terms.tsv").write_text("\nｔｗｏ\n\n\n\n\n")
    files = [f"--input={tmp_path / 'in.de'}", f"--prefix={tmp_path / 'prefix.en'}"]
    r = run_decode(f"--workdir={workdir}", *files, f"--constraints={tmp_path / 'terms.tsv'}")
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().split("\n")[:-1]
    assert lines[0].startswith("ｎｉｎｅ") and lines[2].startswith("five…"), lines
    assert "ｔｗｏ" in lines[1] and "two" not in lines[1], lines[1]
    translator = Translator(workdir)
    got = translator.translate([pairs[0][0]], prefixes=["ｎｉｎｅ"])
    assert (
        got[0].startswith("ｎｉｎｅ") and got[0][len("ｎｉｎｅ") :] == lines[0][len("ｎｉｎｅ") :]
    )

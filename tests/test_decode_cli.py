"""decode.py end to end on a workdir trained in-test (German digit words -> English).

The `workdir` fixture (tests/conftest.py) trains a SentencePiece tokenizer and a
small Transformer for a few hundred Adam steps on a synthetic word-for-word task,
then saves them as train.py would (config.json, checkpoints/, tokenizer.model):
tests/digits.py.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from attention_jax import BOS_ID, EOS_ID
from attention_jax.data import Tokenizer
from attention_jax.inference.plots import attention_maps
from attention_jax.search import decoding
from attention_jax.training.workdir import restore_model
from tests.decode_runs import ROOT, run_decode
from tests.digits import TRAIN_STEPS, digit_pairs, pad
from tests.models import make


def test_trained_model_translates_synthetic_task_exactly(workdir):
    model, _, step = restore_model(workdir)
    assert step == TRAIN_STEPS
    tok = Tokenizer.load(os.path.join(workdir, "tokenizer.model"))
    pairs = digit_pairs(np.random.default_rng(123), 40)
    src = pad([[*tok.encode(s), EOS_ID] for s, _ in pairs], 24)
    for beam_size in (1, 4):
        out = np.asarray(decoding.translate(model, src, beam_size=beam_size))
        assert [tok.decode(r.tolist()) for r in out] == [t for _, t in pairs]


def test_cli_translates_in_order_with_bad_lines(workdir, tmp_path):
    rng = np.random.default_rng(7)
    pairs = digit_pairs(rng, 30)  # shuffled lengths
    lines = [s.encode() for s, _ in pairs]
    expected = [t for _, t in pairs]
    # Bad lines: empty, whitespace-only, invalid UTF-8, a vertical tab (not a line
    # break here), CRLF, and one far longer than the model's max_len.
    bad = {
        3: (b"", ""),
        5: (b"   \t ", ""),
        9: (b"eins \xff\xfe zwei", None),
        12: (b"drei\x0bvier", None),
        15: ("fünf".encode(), "five"),
        20: (b"sechs\r", "six"),
        25: (b" ".join([b"sieben"] * 200), None),
    }
    for i, (line, want) in sorted(bad.items()):
        lines.insert(i, line)
        expected.insert(i, want)
    src = tmp_path / "in.de"
    src.write_bytes(b"\n".join(lines))  # no newline at the end of the last line
    out = tmp_path / "out.en"
    out.write_text("old content\n")
    r = run_decode(f"--workdir={workdir}", f"--input={src}", f"--output={out}", "--batch_tokens=64")
    assert r.returncode == 0, r.stderr.decode()
    got = out.read_text().split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)
    for i, want in enumerate(expected):
        if want is not None:
            assert got[i] == want, (i, lines[i])
    err = r.stderr.decode()
    assert "1 line(s) had invalid UTF-8" in err
    assert "1 line(s) over 64 tokens truncated" in err
    assert "sentences/s" in err and "tokens/s" in err


def test_cli_stdin_stdout_reference_and_plots(workdir, tmp_path):
    pairs = digit_pairs(np.random.default_rng(3), 6)
    ref = tmp_path / "ref.en"
    ref.write_text("".join(t + "\n" for _, t in pairs))
    plots = tmp_path / "plots"
    r = run_decode(
        f"--workdir={workdir}",
        "--beam_size=1",
        f"--reference={ref}",
        f"--plot_attention={plots}",
        "--num_plots=2",
        stdin="".join(s + "\n" for s, _ in pairs).encode(),
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().splitlines() == [t for _, t in pairs]
    err = r.stderr.decode()
    assert "BLEU = 100.00" in err and "nrefs:1" in err and "chrF = 100.00" in err
    pngs = sorted(os.listdir(plots))
    assert pngs == ["attention_000.png", "attention_001.png"]
    for name in pngs:
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_shows_each_layers_cross_attention_averaged_over_heads():
    model = make(seed=2)  # 12 tokens, 2 decoder layers, 4 heads
    src, out = [5, 6, 7, 8, 9, EOS_ID], [9, 4, 10]
    maps = attention_maps(model, src, out)  # computed at width 8 for both, then cut
    tgt_in = np.asarray([[BOS_ID, *out]], np.int32)  # row t predicts token t
    whole = jax.jit(model.cross_attention_weights)(np.asarray([src], np.int32), tgt_in)
    assert maps.shape == (2, len(out) + 1, len(src))
    np.testing.assert_allclose(maps, np.asarray(whole)[:, 0].mean(axis=1), atol=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workdir=/nonexistent/wd"], "does not exist"),
        (["--checkpoint_step=7"], "no checkpoint for step 7"),
        (["--input=/nonexistent/in.txt"], "--input /nonexistent/in.txt does not exist"),
    ],
)
def test_cli_user_errors_give_one_clear_line(workdir, args, message):
    if not any(a.startswith("--workdir") for a in args):
        args = [f"--workdir={workdir}", *args]
    r = run_decode(*args, stdin=b"eins\n")
    err = r.stderr.decode()
    assert r.returncode == 1
    assert message in err and "Traceback" not in err
    assert r.stdout == b""


def test_cli_missing_tokenizer(workdir, tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    os.symlink(os.path.join(workdir, "checkpoints"), wd / "checkpoints")
    os.symlink(os.path.join(workdir, "config.json"), wd / "config.json")
    r = run_decode(f"--workdir={wd}", stdin=b"eins\n")
    assert r.returncode == 1
    assert "tokenizer.model is missing" in r.stderr.decode()
    assert "Traceback" not in r.stderr.decode()


def test_cli_split_scores_the_held_out_set_and_splits_long_lines(workdir, tmp_path):
    out = tmp_path / "test.hyp"
    r = run_decode(f"--workdir={workdir}", "--split=test", f"--output={out}")
    assert r.returncode == 0, r.stderr.decode()
    assert "BLEU = 100.00" in r.stdout.decode()
    assert len(out.read_text().splitlines()) == 10  # 5% of the 200 TSV pairs

    # Segments of at most 6 words (+ EOS), the lengths the model was trained on.
    long = " ".join(["eins zwei drei"] * 6)
    r = run_decode(
        f"--workdir={workdir}",
        "--long_lines=split",
        "--max_length=7",
        stdin=f"{long}\nvier\n".encode(),
    )
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == " ".join(["one two three"] * 6) + "\nfour\n"
    assert "1 line(s) over 7 tokens split" in r.stderr.decode()


def test_cli_n_best_jsonl_and_alignments(workdir, tmp_path):
    pairs = digit_pairs(np.random.default_rng(11), 8)
    lines = [s for s, _ in pairs]
    lines.insert(3, "")  # a blank line: an object with no hypotheses
    stdin = "".join(x + "\n" for x in lines).encode()
    text = run_decode(f"--workdir={workdir}", stdin=stdin)
    r = run_decode(
        f"--workdir={workdir}", "--n_best=3", "--output_format=jsonl", "--alignment", stdin=stdin
    )
    assert r.returncode == 0 and text.returncode == 0, r.stderr.decode()
    objects = [json.loads(x) for x in r.stdout.decode().splitlines()]
    best = text.stdout.decode().splitlines()
    assert len(objects) == len(lines) and objects[3] == {"hypotheses": []}
    tok = Tokenizer.load(os.path.join(workdir, "tokenizer.model"))
    for obj, line, want in zip(objects, lines, best, strict=True):
        hyps = obj["hypotheses"]
        if not line:
            continue
        assert 1 <= len(hyps) <= 3 and hyps[0]["text"] == want  # the 1-best is the text line
        assert [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)
        for h in hyps:
            assert tok.decode(h["tokens"]) == h["text"] and h["score"] < 0
            # Word-for-word task: every output word links to a source word in range.
            links = [tuple(map(int, x.split("-"))) for x in h["alignment"].split()]
            assert [j for _, j in links] == list(range(len(h["text"].split())))
            assert all(0 <= i < len(line.split()) for i, _ in links)
        # The best translation is word for word, and cross-attention finds it.
        assert hyps[0]["alignment"] == " ".join(f"{k}-{k}" for k in range(len(line.split())))


def test_cli_export_translates_like_the_live_model(workdir, digit_export, tmp_path):
    export_dir = pathlib.Path(digit_export)  # decode.py --export --n_best=2 (tests/conftest.py)
    meta = json.loads((export_dir / "metadata.json").read_text())
    assert meta["beam_size"] == 4 and meta["n_best"] == 2 and meta["jax_version"] == jax.__version__
    assert meta["stop"] == "bound"
    assert {"tokenizer.model", "params.npz", "search_S8.jax"} <= set(os.listdir(export_dir))
    pairs = digit_pairs(np.random.default_rng(12), 25)
    stdin = "".join(s + "\n" for s, _ in pairs).encode() + b"\n" + b"eins " * 40 + b"\n"
    args = ["--n_best=2", "--output_format=jsonl", "--batch_tokens=64"]
    live = run_decode(f"--workdir={workdir}", *args, stdin=stdin)
    exported = run_decode(f"--exported={export_dir}", *args, stdin=stdin)
    assert live.returncode == 0 and exported.returncode == 0, exported.stderr.decode()
    assert exported.stdout == live.stdout  # texts, tokens and scores, line for line
    assert "from the translator exported in" in exported.stderr.decode()
    # docs/decoding.md's plain-JAX snippet runs as written on this directory.
    with open(os.path.join(ROOT, "docs", "decoding.md")) as f:
        doc = f.read()
    snippet = doc.split("From plain JAX, without this repository:")[1].split("```python")[1]
    snippet = snippet.split("```")[0].replace('d = "translator"', f'd = "{export_dir}"')
    snippet = snippet.replace("Das Haus ist sehr alt.", "eins zwei drei")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:3] == ["one", "two", "three"]
    # A different beam needs a new export; the model-only flags need the workdir.
    for bad, message in (
        ("--beam_size=2", "exported with beam_size=4"),
        ("--stop=heuristic", "exported with stop=bound"),
        ("--alignment", ""),
    ):
        r = run_decode(f"--exported={export_dir}", bad, "--output_format=jsonl", stdin=b"eins\n")
        assert r.returncode == 1 and message in r.stderr.decode()
        assert "Traceback" not in r.stderr.decode()


# A second export (~50 s): test_cli_export_translates_like_the_live_model is in make test.
@pytest.mark.slow
def test_cli_export_keeps_the_heuristic_stop(workdir, tmp_path):
    export_dir = tmp_path / "translator"
    flags = ("--n_best=2", "--stop=heuristic")
    r = run_decode(f"--workdir={workdir}", f"--export={export_dir}", *flags)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads((export_dir / "metadata.json").read_text())["stop"] == "heuristic"
    pairs = digit_pairs(np.random.default_rng(13), 25)
    stdin = "".join(s + "\n" for s, _ in pairs).encode()
    args = ["--n_best=2", "--output_format=jsonl", "--batch_tokens=64"]
    live = run_decode(f"--workdir={workdir}", *args, "--stop=heuristic", stdin=stdin)
    exported = run_decode(f"--exported={export_dir}", *args, stdin=stdin)
    assert live.returncode == 0 and exported.returncode == 0, exported.stderr.decode()
    assert "heuristic stop" in exported.stderr.decode()
    # The same hypotheses; scores as the live model's up to float32 rounding (batches
    # of other shapes), as test_stages compares the exact rule's.
    for got, want in zip(exported.stdout.splitlines(), live.stdout.splitlines(), strict=True):
        got, want = json.loads(got)["hypotheses"], json.loads(want)["hypotheses"]
        assert [h["tokens"] for h in got] == [h["tokens"] for h in want]
        np.testing.assert_allclose(
            [h["score"] for h in got], [h["score"] for h in want], rtol=1e-5, atol=1e-6
        )
    r = run_decode(f"--exported={export_dir}", "--stop=bound", stdin=b"eins\n")
    assert r.returncode == 1 and "exported with stop=heuristic" in r.stderr.decode()


def test_cli_average_last_says_how_many_it_averaged(workdir):
    r = run_decode(f"--workdir={workdir}", "--average_last=5", stdin=b"eins zwei\n")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert "asked to average the last 5 checkpoints" in err
    assert "only 1 exist" in err and "averaged the parameters of 1 checkpoint(s)" in err


@pytest.mark.slow  # ~12 s
def test_cli_compilation_cache_is_filled_and_reused(workdir, tmp_path):
    cache = tmp_path / "xla"
    args = [f"--workdir={workdir}", f"--compilation_cache={cache}", "--beam_size=2"]
    first = run_decode(*args, stdin=b"eins zwei drei\n")
    assert first.returncode == 0, first.stderr.decode()
    entries = set(os.listdir(cache))
    assert entries  # compiled programs were written
    second = run_decode(*args, stdin=b"eins zwei drei\n")
    assert second.stdout == first.stdout == b"one two three\n"
    assert set(os.listdir(cache)) == entries  # nothing new to compile the second time


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n_best=5"], "--n_best must be in [1, --beam_size=4]"),
        (["--n_best=2"], "needs --output_format=jsonl"),
        (["--alignment"], "--alignment needs --output_format=jsonl"),
        (["--exported=/nonexistent"], "--exported translates on its own"),
        (["--stop=never"], "--stop"),
    ],
)
def test_cli_translation_flag_mistakes(workdir, args, message):
    r = run_decode(f"--workdir={workdir}", *args, stdin=b"eins\n")
    assert r.returncode == 1 and message in r.stderr.decode()
    assert "Traceback" not in r.stderr.decode() and r.stdout == b""


def test_cli_heuristic_stop_translates_as_the_exact_rule(workdir):
    # The digit task's translations are certain: stopping once no live beam would win at
    # the next step gives the same lines, and the summary says which rule ran.
    r = run_decode(f"--workdir={workdir}", "--stop=heuristic", stdin=b"eins zwei drei\nvier\n")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"one two three\nfour\n"
    assert "heuristic stop" in r.stderr.decode()

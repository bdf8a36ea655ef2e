"""decode.py end to end on a workdir trained in-test (German digit words -> English).

The fixture trains a SentencePiece tokenizer and a small Transformer for a few
hundred Adam steps on a synthetic word-for-word task, then saves them as
train.py would (config.json, checkpoints/, tokenizer.model).
"""

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attention_jax import EOS_ID, shift_right
from attention_jax.configs import tiny
from attention_jax.data import Tokenizer
from attention_jax.data.tokenizer import train_tokenizer
from attention_jax.search import decoding
from attention_jax.training import checkpoints, steps
from attention_jax.training import config as config_lib
from attention_jax.training.workdir import restore_model
from tests import decode_runs
from tests.conftest import session_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Enough Adam steps that the exact-translation test does not hinge on float rounding
# (at 350 steps jax 0.8 and 0.10 trained models that differed on one repeated word).
TRAIN_STEPS = 600
DE = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"]
EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digit_pairs(rng, n, max_words=6):
    """n (German, English) sentences of 1..max_words digit words."""
    out = []
    for _ in range(n):
        d = rng.integers(0, 10, size=rng.integers(1, max_words + 1))
        out.append((" ".join(DE[i] for i in d), " ".join(EN[i] for i in d)))
    return out


def pad(rows, width):
    a = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        a[i, : len(r)] = r
    return a


def train_digits(model, tok, num_steps=TRAIN_STEPS, batch=64, width=24, seed=0):
    """A plain Adam loop on random digit sentences (teacher forcing, no label smoothing)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 30, num_steps, 3e-4))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, src, tgt):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p, rest)(src, shift_right(tgt))
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
            w = tgt != 0
            return jnp.sum(ce * w) / jnp.sum(w)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(num_steps):
        pairs = digit_pairs(rng, batch)
        src = pad([[*tok.encode(s), EOS_ID] for s, _ in pairs], width)
        tgt = pad([[*tok.encode(t), EOS_ID] for _, t in pairs], width)
        params, opt_state, loss = step(params, opt_state, src, tgt)
    nnx.update(model, params)
    return float(loss)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The trained digit workdir, a copy of its own for each test module: trained once per
    test session (~1 min on 2 cores), by the first xdist worker that needs it, and used
    by test_decode_cli, test_decode_stream and test_ct2_decode."""
    shared = session_dir(tmp_path_factory, "digit-workdir")
    build_digit_workdir(shared)  # or wait for the worker that builds it
    wd = str(tmp_path_factory.mktemp("workdir") / "w")
    shutil.copytree(shared, wd)
    config = config_lib.load_config(wd)
    config.dataset = f"tsv:{os.path.join(wd, 'digits.tsv')}"  # this copy's (--split=test)
    config_lib.save_config(config, wd)
    return wd


def build_digit_workdir(shared: str) -> None:
    """The trained digit workdir in `shared`, built once by whichever process comes first
    (a lock: the others wait for it), in a child with JAX state of its own. Its 600 steps
    run compiled with LLVM's optimizations (8 s instead of 18 without, as the tests
    compile: few programs, run many times); the parity checks against CTranslate2
    allow near-ties (tests/parity.py), so its rounding does not matter."""
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(shared):
            building = f"{shared}.building"
            shutil.rmtree(building, ignore_errors=True)
            os.makedirs(building)
            code = f"from tests.test_decode_cli import train_digit_workdir as t; t({building!r})"
            level = "--xla_backend_optimization_level"
            flags = re.sub(rf"{level}=\d+", "", os.environ.get("XLA_FLAGS", ""))
            env = {**os.environ, "XLA_FLAGS": f"{flags} {level}=2".strip()}
            subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
            os.rename(building, shared)  # complete, or not there


def train_digit_workdir(wd: str) -> None:
    """Train a tokenizer and a model on the digit task into wd, as train.py lays it out."""
    texts = [s for pair in digit_pairs(np.random.default_rng(1), 400) for s in pair]
    proto = train_tokenizer(texts, 320)  # room for every word as one piece
    with open(os.path.join(wd, "tokenizer.model"), "wb") as f:
        f.write(proto)
    tok = Tokenizer.load(os.path.join(wd, "tokenizer.model"))

    config = tiny.get_config()
    tsv = os.path.join(wd, "digits.tsv")
    with open(tsv, "w") as f:
        f.writelines(f"{s}\t{t}\n" for s, t in digit_pairs(np.random.default_rng(2), 200))
    config.dataset = f"tsv:{tsv}"
    config.vocab_size = tok.vocab_size
    config.max_length = 24
    config.model.update(
        d_model=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=128
    )
    config.model.update(dropout_rate=0.0, max_len=64)
    config_lib.save_config(config, wd)
    model = config_lib.build_model(config, config_lib.model_config(config))
    loss = train_digits(model, tok)
    assert loss < 0.05, f"the digit task did not train (loss {loss})"

    _, params, rngs = nnx.split(model, nnx.Param, ...)
    state = steps.TrainState(
        jnp.asarray(TRAIN_STEPS, jnp.int32), params, optax.sgd(1.0).init(params), rngs
    )
    manager = checkpoints.Checkpoints(wd)
    manager.save(state, {})
    manager.wait()
    manager.close()


def run_decode(*args, stdin=None, pythonpath="", env=None):
    """decode.py with `args` (tests/decode_runs.py: in this process, or in a child for
    `pythonpath` or `env`)."""
    return decode_runs.run_decode(*args, stdin=stdin, pythonpath=pythonpath, env=env)


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


def test_cli_export_translates_like_the_live_model(workdir, tmp_path):
    export_dir = tmp_path / "translator"
    r = run_decode(f"--workdir={workdir}", f"--export={export_dir}", "--n_best=2")
    assert r.returncode == 0, r.stderr.decode()
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

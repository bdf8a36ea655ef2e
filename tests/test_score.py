"""Scoring given translations (search/likelihood.py, decode.py --score, Translator.score).

References: each token's log-probability computed one step at a time through the
decoder's cache in float64 NumPy (a path that shares nothing with the teacher-forced
forward pass but the weights), and the scores beam search itself reports (at alpha 0
a hypothesis's score is its log-probability). CTranslate2's `score_batch` is the
reference of the CTranslate2 backend (tests/test_ct2_decode.py) and of imported
OPUS-MT models (tests/test_marian.py).
"""

import json
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from attention_jax import EOS_ID, Transformer, TransformerConfig
from attention_jax.inference.output import PARTIAL, RECORD
from attention_jax.search.decoding import translate_beams
from attention_jax.search.likelihood import score_ids, token_log_probs
from attention_jax.training.workdir import load_workdir
from tests.decode_runs import run_decode, run_killed
from tests.digits import digit_pairs, hostile_input
from tests.models import cache_of, step_of
from tests.parity import source_ids


def tiny_model(seed: int = 0) -> Transformer:
    config = TransformerConfig(
        vocab_size=40, d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
        d_ff=64, max_len=32, dropout_rate=0.0,
    )  # fmt: skip
    return Transformer(config, rngs=nnx.Rngs(seed))


def random_pairs(seed: int, n: int, most: int = 12) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    ids = lambda: [*rng.integers(4, 40, size=rng.integers(0, most)).tolist(), EOS_ID]
    sources = [ids() for _ in range(n)]
    sources = [s if len(s) > 1 else [7, EOS_ID] for s in sources]  # a source has a token
    return sources, [ids() for _ in range(n)]


def stepwise_log_probs(model, source, target) -> np.ndarray:
    """log P(target[t] | source, target[:t]) by feeding one token at a time through the
    decoder's cache (Transformer.decode_step), log-softmax in float64."""
    src = np.zeros((1, model.config.max_len), np.int32)  # one shape: one compile
    src[0, : len(source)] = source
    cache = cache_of(model, src, model.config.max_len)
    out, prev = [], 2  # BOS
    for token in target:
        logits, cache = step_of(model, np.asarray([prev], np.int32), cache)
        z = np.asarray(logits[0], np.float64)
        out.append(z[token] - z.max() - np.log(np.exp(z - z.max()).sum()))
        prev = token
    return np.asarray(out)


def test_each_token_log_prob_is_the_decoder_steps_one():
    model = tiny_model()
    sources, targets = random_pairs(1, 6)
    scored = score_ids(model, sources, targets, batch_tokens=64)
    for source, target, (hyp,) in zip(sources, targets, scored, strict=True):
        want = stepwise_log_probs(model, source, target)
        np.testing.assert_allclose(hyp.token_log_probs, want, rtol=1e-5, atol=1e-5)
        assert hyp.tokens == target[:-1]
        assert hyp.score == pytest.approx(float(np.sum(hyp.token_log_probs)), abs=1e-9)


def test_a_pairs_scores_do_not_depend_on_its_batch_or_padding():
    model = tiny_model(3)
    sources, targets = random_pairs(4, 24, most=14)
    alone = [score_ids(model, [s], [t], batch_tokens=4096)[0] for s, t in zip(sources[:5],
             targets[:5], strict=True)]  # fmt: skip
    for budget in (64, 4096):
        together = score_ids(model, sources, targets, batch_tokens=budget)
        for a, b in zip(alone, together[:5], strict=True):
            np.testing.assert_allclose(a[0].token_log_probs, b[0].token_log_probs, atol=2e-5)
    # padding beyond the target is masked: 0 there, and the pads change nothing
    src = np.asarray([sources[0] + [0] * 4], np.int32)
    tgt = np.asarray([targets[0] + [0] * 4], np.int32)
    logp = np.asarray(token_log_probs(model, src, tgt))[0]
    assert np.all(logp[len(targets[0]) :] == 0)
    np.testing.assert_allclose(logp[: len(targets[0])], alone[0][0].token_log_probs, atol=2e-5)


def test_empty_sources_get_no_result_and_bad_targets_are_refused():
    model = tiny_model()
    scored = score_ids(model, [[], [5, EOS_ID]], [[EOS_ID], [EOS_ID]], batch_tokens=64)
    assert scored[0] == [] and len(scored[1][0].token_log_probs) == 1  # EOS alone
    with pytest.raises(ValueError, match="does not end in EOS"):
        score_ids(model, [[5, EOS_ID]], [[6]])
    with pytest.raises(ValueError, match="1 sources but 2 targets"):
        score_ids(model, [[5, EOS_ID]], [[EOS_ID], [EOS_ID]])


@pytest.mark.parametrize("which", ["trained", "random"])
def test_a_beam_outputs_score_is_what_the_search_reported_at_alpha_0(workdir, which):
    """Every one of the K hypotheses, those the length limit ended too (the random model
    reaches it on most lines)."""
    if which == "trained":
        model, _, _, tokenizer = load_workdir(workdir)
        pairs = digit_pairs(np.random.default_rng(8), 24, max_words=8)
        sources = [[*ids, EOS_ID] for ids in tokenizer.encode_batch([s for s, _ in pairs])]
    else:
        model = tiny_model(5)
        sources, _ = random_pairs(6, 24)
    width = max(len(s) for s in sources)
    src = np.zeros((len(sources), width), np.int32)
    for i, s in enumerate(sources):
        src[i, : len(s)] = s
    tokens, scores = translate_beams(model, src, beam_size=4, alpha=0.0)
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    pairs = [(i, k) for i in range(len(sources)) for k in range(4) if np.isfinite(scores[i, k])]
    given = []
    for i, k in pairs:
        row = tokens[i, k].tolist()
        given.append(row[: row.index(EOS_ID) + 1])
    scored = score_ids(model, [sources[i] for i, _ in pairs], given, batch_tokens=256)
    got = np.asarray([h[0].score for h in scored])
    want = np.asarray([scores[i, k] for i, k in pairs])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(pairs) >= 3 * len(sources)


# --- decode.py --score and the library ---------------------------------------------------


def score_lines(out: bytes) -> list[dict]:
    return [json.loads(line) for line in out.decode().split("\n")[:-1]]


@pytest.fixture(scope="module")
def pairs_files(workdir, tmp_path_factory):
    """Hostile sources and, line by line, translations to score (references, an empty
    one, one against an empty source), and decode.py --score's whole-file output."""
    d = tmp_path_factory.mktemp("score")
    data, expected = hostile_input(seed=9, n=40)
    (d / "in.de").write_bytes(data)
    given = [want if want is not None else "one two" for want in expected]
    given[5] = ""  # an empty translation: log P(EOS | source)
    (d / "given.en").write_text("\n".join(given) + "\n", encoding="utf-8")
    args = (f"--workdir={workdir}", f"--input={d / 'in.de'}", f"--score={d / 'given.en'}")
    r = run_decode(*args, "--read_lines=100000")
    assert r.returncode == 0, r.stderr.decode()
    return d, args, given, r


def test_decode_score_writes_each_lines_log_probability(workdir, pairs_files):
    d, _, given, r = pairs_files
    err = r.stderr.decode()
    rows = score_lines(r.stdout)
    lines = (d / "in.de").read_bytes().split(b"\n")
    assert len(rows) == len(lines) == len(given)
    assert f"decode.py: {len(rows)} lines (3 empty)" in err and "scored 43 translations" in err
    assert "1 source(s) over 64 tokens or translation(s) over" in err
    model, _, _, tokenizer = load_workdir(workdir)
    sources = source_ids(tokenizer, (d / "in.de").read_bytes() + b"\n", 64)
    for source, text, row in zip(sources, given, rows, strict=True):
        if not source:  # an empty or blank line: nothing to score
            assert row == {"score": None, "token_log_probs": [], "tokens": []}
            continue
        target = tokenizer.encode_target_batch([text])[0]
        assert row["tokens"] == target and len(row["token_log_probs"]) == len(target) + 1
        assert row["score"] == pytest.approx(sum(row["token_log_probs"]), abs=1e-9)
        assert all(np.isfinite(row["token_log_probs"])) and row["score"] < 0
    picked = [i for i, s in enumerate(sources) if s][:4]  # and the decoder, a step at a time
    for i in picked:
        target = [*rows[i]["tokens"], EOS_ID]
        want = stepwise_log_probs(model, sources[i], target)
        np.testing.assert_allclose(rows[i]["token_log_probs"], want, rtol=1e-4, atol=1e-4)
    assert rows[5]["tokens"] == [] and len(rows[5]["token_log_probs"]) == 1


def test_the_library_scores_as_decode_py(workdir, pairs_files):
    from attention_jax import Translator

    d, _, given, r = pairs_files
    lines = (d / "in.de").read_bytes().decode("utf-8", errors="replace").split("\n")
    results = Translator(workdir).score([x.rstrip("\r") for x in lines], given)
    for result, row in zip(results, score_lines(r.stdout), strict=True):
        assert [result.score, result.token_log_probs, result.tokens] == list(row.values())
    with pytest.raises(ValueError, match="1 translations for 2 lines"):
        Translator(workdir).score(["eins", "zwei"], ["one"])


@pytest.mark.slow  # ~15 s (a child killed); translation's resume is in make test
def test_streamed_chunks_and_a_resume_after_sigkill_give_an_uninterrupted_runs_output(
    pairs_files,
):
    """Chunks of 8 lines score as the whole file (to float32 rounding: other batch
    shapes), and a run killed mid-write goes on to the uninterrupted run's bytes."""
    d, args, _, whole = pairs_files
    chunked = run_decode(*args, "--read_lines=8")
    assert chunked.returncode == 0, chunked.stderr.decode()
    for got, want in zip(score_lines(chunked.stdout), score_lines(whole.stdout), strict=True):
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["token_log_probs"], want["token_log_probs"], atol=1e-5)
    out = d / "out.jsonl"
    killed = run_killed(16, 1, *args, "--read_lines=8", f"--output={out}")
    assert killed.returncode == -signal.SIGKILL
    assert json.loads((d / f"out.jsonl{RECORD}").read_text())["done"]["lines"] == 8
    r = run_decode(*args, "--read_lines=8", f"--output={out}")
    assert r.returncode == 0, r.stderr.decode()
    assert "8 lines were done by an earlier run" in r.stderr.decode()
    assert out.read_bytes() == chunked.stdout
    assert not (d / f"out.jsonl{PARTIAL}").exists()


@pytest.mark.slow  # ~10 s (an export); scoring's CLI and library are in make test
def test_the_export_scores_as_the_live_model(workdir, pairs_files, tmp_path):
    _, args, _, whole = pairs_files
    made = run_decode(f"--workdir={workdir}", f"--export={tmp_path / 'exp'}")
    assert made.returncode == 0, made.stderr.decode()
    r = run_decode(f"--exported={tmp_path / 'exp'}", *args[1:])
    assert r.returncode == 0, r.stderr.decode()
    for got, want in zip(score_lines(r.stdout), score_lines(whole.stdout), strict=True):
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["token_log_probs"], want["token_log_probs"], atol=1e-5)
    os.remove(tmp_path / "exp" / "score_S8.jax")  # an export without its programs ...
    meta = json.loads((tmp_path / "exp" / "metadata.json").read_text())
    del meta["score_programs"]  # ... as written before scoring existed
    (tmp_path / "exp" / "metadata.json").write_text(json.dumps(meta))
    r = run_decode(f"--exported={tmp_path / 'exp'}", *args[1:])
    assert r.returncode == 1 and "exported without scoring programs: export it again" in (
        r.stderr.decode()
    )


@pytest.mark.parametrize(
    ("lines", "flags", "message"),
    [
        ("one\n", [], "--score has 1 lines but the input 2"),
        ("one\ntwo\nthree\n", [], "--score has 3 lines but the input 2"),
        ("one\ntwo\n", ["--reference={d}/given.en"], "drop --reference"),
        ("one\ntwo\n", ["--prefix={d}/given.en"], "drop --prefix"),
        ("one\ntwo\n", ["--long_lines=split"], "drop --long_lines=split"),
        ("one\ntwo\n", ["--export={d}/x"], "--score is for scoring translations"),
    ],
)
def test_score_user_errors_are_one_line_and_write_nothing(workdir, tmp_path, lines, flags, message):
    (tmp_path / "in.de").write_text("eins\nzwei\n")
    (tmp_path / "given.en").write_text(lines)
    out = tmp_path / "out.jsonl"
    args = [f"--input={tmp_path / 'in.de'}", f"--score={tmp_path / 'given.en'}", f"--output={out}"]
    r = run_decode(f"--workdir={workdir}", *args, *[f.format(d=tmp_path) for f in flags])
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and message.format(d=tmp_path) in err, err
    assert len(err.splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["given.en", "in.de"]


def test_scores_from_stdin_refuse_a_short_file_at_the_line_they_part(workdir, tmp_path):
    (tmp_path / "given.en").write_text("one\n")
    r = run_decode(
        f"--workdir={workdir}", f"--score={tmp_path / 'given.en'}", stdin=b"eins\nzwei\n"
    )
    assert r.returncode == 1
    assert "--score has fewer lines than the input (they part at line 2)" in r.stderr.decode()


@pytest.mark.slow  # a child with 8 CPU devices
def test_every_device_scores_as_one(pairs_files):
    _, args, _, whole = pairs_files
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    r = run_decode(*args, env={**os.environ, "XLA_FLAGS": flags})
    assert r.returncode == 0, r.stderr.decode()
    assert jax.device_count() == 1  # the child had the 8
    for got, want in zip(score_lines(r.stdout), score_lines(whole.stdout), strict=True):
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["token_log_probs"], want["token_log_probs"], atol=1e-5)

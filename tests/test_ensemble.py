"""Ensembles (model/ensemble.py, decode.py --workdir=A,B): several models decode as one.

References: each member's full forward pass, its log-probabilities averaged and
normalized again in float64 NumPy (the definition, computed without the ensemble's
cache or the search); and a model alone, which an ensemble of it with itself must
match bit for bit.
"""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from attention_jax import EOS_ID, Transformer, TransformerConfig, shift_right
from attention_jax.ensemble import Ensemble
from attention_jax.search.decoding import translate_beams, translate_greedy
from attention_jax.search.likelihood import score_ids
from tests.decode_runs import run_decode
from tests.digits import digit_pairs
from tests.models import forward

SRC = np.asarray([[5, 6, 7, 8, 1, 0], [9, 10, 1, 0, 0, 0], [11, 1, 0, 0, 0, 0]], np.int32)


def members() -> list[Transformer]:
    """Two models of one vocabulary and other sizes."""
    common = dict(vocab_size=40, dropout_rate=0.0)
    a = TransformerConfig(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                          d_ff=64, max_len=24, **common)  # fmt: skip
    b = TransformerConfig(d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=3,
                          d_ff=48, max_len=32, **common)  # fmt: skip
    return [Transformer(a, rngs=nnx.Rngs(0)), Transformer(b, rngs=nnx.Rngs(1))]


def ensemble_log_probs(models, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """[B, T, V] float64: log_softmax of the mean of the members' log-probabilities, each
    from its own full forward pass over tgt [B, T] (shifted right)."""
    mean = 0.0
    for m in models:
        z = np.asarray(forward(m, src, shift_right(tgt)), np.float64)
        mean = mean + (z - _logsumexp(z)) / len(models)
    return mean - _logsumexp(mean)


def _logsumexp(z: np.ndarray) -> np.ndarray:
    top = z.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(z - top).sum(axis=-1, keepdims=True))


def test_an_ensemble_of_a_model_with_itself_is_the_model():
    """The mean of two equal logits is the logits: the same tokens, and the same scores
    to float32's rounding (two programs that XLA fuses otherwise may round otherwise in
    the last bit)."""
    model = members()[0]
    twice = Ensemble([model, model])
    (tokens2, scores2), (tokens1, scores1) = (
        translate_beams(m, SRC, beam_size=4, n_best=4) for m in (twice, model)
    )
    np.testing.assert_array_equal(tokens2, tokens1)
    np.testing.assert_allclose(scores2, scores1, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(translate_greedy(twice, SRC), translate_greedy(model, SRC))
    sources = [[5, 6, 1], [9, 1]]
    targets = [[7, 7, 8, 1], [1]]
    got_all, want_all = (score_ids(m, sources, targets) for m in (twice, model))
    for got, want in zip(got_all, want_all, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        for g, w in zip(got, want, strict=True):
            assert g.score == pytest.approx(w.score, rel=1e-6, abs=0)
            np.testing.assert_allclose(g.token_log_probs, w.token_log_probs, rtol=1e-6, atol=1e-7)


def test_beam_search_scores_are_the_averaged_log_probabilities_of_its_outputs():
    """At alpha 0 a hypothesis's score is its log-probability: here the ensemble's, from
    the members' forward passes alone. Every hypothesis of the n-best, including those
    the length limit ended; and their scoring agrees."""
    models = members()
    ensemble = Ensemble(models)
    assert ensemble.config.max_len == 24  # the shorter of the two
    tokens, scores = translate_beams(ensemble, SRC, beam_size=4, n_best=4, alpha=0.0)
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    checked = 0
    for b in range(SRC.shape[0]):
        for k in range(4):
            if not np.isfinite(scores[b, k]):
                continue
            row = tokens[b, k].tolist()
            tgt = np.asarray([row[: row.index(EOS_ID) + 1]], np.int32)
            logp = ensemble_log_probs(models, SRC[b : b + 1], tgt)[0]
            want = logp[np.arange(tgt.shape[1]), tgt[0]].sum()
            assert scores[b, k] == pytest.approx(want, rel=1e-5, abs=1e-5)
            scored = score_ids(ensemble, [SRC[b][SRC[b] > 0].tolist()], [tgt[0].tolist()])
            assert scored[0][0].score == pytest.approx(want, rel=1e-5, abs=1e-5)
            checked += 1
    assert checked >= 8


def test_greedy_search_takes_the_averaged_argmax_at_each_step():
    models = members()
    out = np.asarray(translate_greedy(Ensemble(models), SRC, max_decode_len=10))
    for b in range(SRC.shape[0]):
        prefix = []
        for t in range(10):
            tgt = np.zeros((1, 10), np.int32)  # causal: what follows position t is unseen
            tgt[0, :t] = prefix
            logp = ensemble_log_probs(models, SRC[b : b + 1], tgt)[0, t]
            logp[[0, 2]] = -np.inf  # searches never emit PAD or BOS ...
            logp[EOS_ID] = -np.inf if t == 0 else logp[EOS_ID]  # ... nor EOS first (min_length)
            best = int(np.argmax(logp)) if t < 9 else EOS_ID  # EOS at the limit
            gap = np.sort(logp)[-1] - np.sort(logp)[-2]
            assert out[b, t] == best or gap < 1e-4, (b, t)
            prefix.append(int(out[b, t]))
            if out[b, t] == EOS_ID:
                break


def test_models_of_different_vocabularies_are_refused():
    a = members()[0]
    config = TransformerConfig(vocab_size=41, d_model=16, num_heads=2, num_encoder_layers=1,
                               num_decoder_layers=1, d_ff=32)  # fmt: skip
    c = Transformer(config, rngs=nnx.Rngs(2))
    with pytest.raises(ValueError, match=r"share a vocabulary; their sizes: \[40, 41\]"):
        Ensemble([a, c])
    with pytest.raises(ValueError, match="at least one model"):
        Ensemble([])


# --- decode.py --workdir=A,B ---------------------------------------------------------------


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    d = tmp_path_factory.mktemp("ensemble")
    pairs = digit_pairs(np.random.default_rng(21), 16, max_words=7)
    (d / "in.de").write_text("".join(s + "\n" for s, _ in pairs) + "\n")  # and an empty line
    (d / "prefix.en").write_text("".join(t.split()[0] + "\n" for _, t in pairs) + "\n")
    (d / "ref.en").write_text("".join(t + "\n" for _, t in pairs) + "\n")
    (d / "terms.tsv").write_text("".join(t.split()[-1] + "\n" for _, t in pairs) + "\n")
    return d


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--output_format=jsonl",
            "--n_best=2",
            "--prefix={d}/prefix.en",
            "--constraints={d}/terms.tsv",
        ],
        # make test has these over an Ensemble in memory (score_ids, translate_greedy)
        pytest.param(["--score={d}/ref.en"], marks=pytest.mark.slow),
        pytest.param(["--beam_size=1"], marks=pytest.mark.slow),
    ],
)
def test_decode_py_with_a_workdir_twice_writes_what_it_writes_with_it_once(workdir, lines, flags):
    args = [f"--input={lines / 'in.de'}", *[f.format(d=lines) for f in flags]]
    once = run_decode(f"--workdir={workdir}", *args)
    twice = run_decode(f"--workdir={workdir},{workdir}", *args)
    assert once.returncode == 0 and twice.returncode == 0, twice.stderr.decode()
    assert twice.stdout == once.stdout
    assert "from an ensemble of" in twice.stderr.decode()


@pytest.mark.slow  # a child with 8 CPU devices
def test_an_ensemble_on_every_device_writes_what_one_device_writes(workdir, lines):
    args = [f"--workdir={workdir},{workdir}", f"--input={lines / 'in.de'}", "--n_best=2",
            "--output_format=jsonl"]  # fmt: skip
    one = run_decode(*args)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    eight = run_decode(*args, env={**os.environ, "XLA_FLAGS": flags})
    assert one.returncode == 0 and eight.returncode == 0, eight.stderr.decode()
    from attention_jax.training.workdir import load_workdir
    from tests.parity import NearTies, source_ids

    tokens = lambda r: [[h["tokens"] for h in json.loads(x)["hypotheses"]]
                        for x in r.stdout.decode().splitlines()]  # fmt: skip
    model, config, _, tokenizer = load_workdir(workdir)
    sources = source_ids(tokenizer, (lines / "in.de").read_bytes(), config.max_length)
    result = NearTies(Ensemble([model, model])).compare(sources, tokens(eight), tokens(one))
    assert result.ok, result.report()


def test_the_library_takes_a_list_of_workdirs(workdir):
    from attention_jax import Translator

    texts = [s for s, _ in digit_pairs(np.random.default_rng(2), 6)]
    assert Translator([workdir, workdir]).translate(texts) == Translator(workdir).translate(texts)


def test_an_ensemble_refuses_another_tokenizer_and_what_needs_one_model(workdir, tmp_path):
    from attention_jax.data.tokenizer import train_tokenizer

    other = tmp_path / "other"
    shutil.copytree(workdir, other)
    texts = [f"{s} {t}" for s, t in digit_pairs(np.random.default_rng(3), 300)]
    (other / "tokenizer.model").write_bytes(train_tokenizer(texts, 320))
    src = tmp_path / "in.de"
    src.write_text("eins zwei\n")
    r = run_decode(f"--workdir={workdir},{other}", f"--input={src}")
    assert r.returncode == 1
    assert f"{other} has another tokenizer than {workdir}" in r.stderr.decode()
    r = run_decode(f"--workdir={workdir},{workdir}", f"--export={tmp_path / 'x'}")
    assert r.returncode == 1 and "--export need one model" in r.stderr.decode()
    assert not os.path.exists(tmp_path / "x")

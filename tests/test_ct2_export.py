"""The CTranslate2 conversion (backends/ct2_export.py) against CTranslate2 itself.

CTranslate2 is an independent implementation of the Transformer: scoring the same
pairs with the converted model must give our log-probabilities, for every
architecture option the converter accepts. Skipped without ctranslate2
(`pip install '.[serve]'`).
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from attention_jax import EOS_ID, Transformer, TransformerConfig, shift_right
from attention_jax.backends import ct2_export
from tests import conftest

ctranslate2 = pytest.importorskip("ctranslate2")

PIECES = ["<pad>", "</s>", "<s>", "<unk>"] + [f"▁w{i}" for i in range(36)]


def perturbed_model(seed: int, **overrides) -> Transformer:
    """conftest's, with two layers each side."""
    layers = dict(num_encoder_layers=2, num_decoder_layers=2)
    return conftest.perturbed_model(seed, **{**layers, **overrides})


def pairs(seed: int, n: int, vocab: int = 40):
    rng = np.random.default_rng(seed)
    make = lambda: rng.integers(4, vocab, size=rng.integers(1, 12)).tolist()
    return [(make(), make()) for _ in range(n)]


def our_log_probs(model, data):
    """Per pair, log P(target token | source, prefix) for every target token and EOS."""
    width = 16
    src = np.zeros((len(data), width), np.int32)
    tgt = np.zeros((len(data), width), np.int32)
    for i, (s, t) in enumerate(data):
        src[i, : len(s) + 1] = [*s, EOS_ID]
        tgt[i, : len(t) + 1] = [*t, EOS_ID]
    logp = np.asarray(jax.nn.log_softmax(model(src, shift_right(tgt))))  # [B, T, V]
    picked = np.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]  # [B, T]
    return [picked[i, : len(t) + 1] for i, (_, t) in enumerate(data)]


@pytest.mark.parametrize(
    "options",
    [
        dict(norm="post", activation="relu"),  # the paper's
        dict(norm="pre", activation="gelu", tie_output=False, share_embeddings=False),
        dict(norm="post", activation="gelu", tie_output=False),
        dict(norm="pre", activation="relu", layer_norm_epsilon=1e-2),
        # Marian's (OPUS-MT): biases everywhere, swish, its sinusoid layout, a zero start
        dict(
            activation="swish", attention_bias=True, logits_bias=True,
            positions="sinusoid_halves", zero_start=True,
        ),
        dict(norm="pre", positions="table", attention_bias=True, logits_bias=True,
             tie_output=False),
    ],
)  # fmt: skip
def test_converted_model_scores_as_ours(tmp_path, options):
    model = perturbed_model(3, **options)
    out = tmp_path / "ct2"
    settings = ct2_export.export_ct2(model, PIECES, {"tokenizer.model": b"spm"}, str(out))
    data = pairs(5, 12)
    ours = our_log_probs(model, data)
    translator = ctranslate2.Translator(str(out), device="cpu")
    # The converted model appends EOS to the source itself (config.json add_source_eos).
    results = translator.score_batch(
        [[PIECES[i] for i in s] for s, _ in data], [[PIECES[i] for i in t] for _, t in data]
    )
    for want, got in zip(ours, results, strict=True):
        np.testing.assert_allclose(got.log_probs, want, atol=2e-5)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_norm_epsilon"] == model.config.layer_norm_epsilon
    assert config["add_source_eos"] and config["decoder_start_token"] == "<s>"
    assert settings["never_generate"] == ["<pad>", "<s>"]
    assert (out / "tokenizer.model").read_bytes() == b"spm"
    assert sorted(os.listdir(tmp_path)) == ["ct2"]  # no temporary directory left behind


def ct2_log_probs(directory: str, data, env: dict[str, str]) -> list[list[float]]:
    """CTranslate2's log-probabilities of the pairs, scored in a fresh process with `env`
    (it picks its matrix-product kernels from the environment once per process)."""
    script = (
        "import json, sys, ctranslate2\n"
        "directory, sources, targets = json.load(sys.stdin)\n"
        "translator = ctranslate2.Translator(directory, device='cpu')\n"
        "results = translator.score_batch(sources, targets)\n"
        "print(json.dumps([r.log_probs for r in results]))\n"
    )
    sources = [[PIECES[i] for i in s] for s, _ in data]
    targets = [[PIECES[i] for i in t] for _, t in data]
    r = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([directory, sources, targets]),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_int8_scores_stay_close(tmp_path):
    model = perturbed_model(4)
    ct2_export.export_ct2(
        model, PIECES, {"tokenizer.model": b"spm"}, str(tmp_path / "q"), quantization="int8"
    )
    data = pairs(6, 8)
    ours = our_log_probs(model, data)
    # Where CTranslate2's default int8 kernels saturate (x86 without VNNI, not Intel:
    # `int8_saturates`), its scores say more about those kernels than about the export:
    # MKL's kernels are asked for there; elsewhere CTranslate2 runs as it chooses.
    env = {"CT2_USE_MKL": "1"} if ct2_export.int8_saturates() else {}
    for want, got in zip(ours, ct2_log_probs(str(tmp_path / "q"), data, env), strict=True):
        assert np.all(np.isfinite(got))
        # 8-bit weights: close to, not equal to, the float32 log-probabilities.
        np.testing.assert_allclose(got, want, atol=0.3)
    # With its default kernels: finite scores (here the warning of decode.py --ct2 holds).
    for got in ct2_log_probs(str(tmp_path / "q"), data, {}):
        assert np.all(np.isfinite(got))


@pytest.mark.parametrize(
    ("cpuinfo", "env", "want"),
    [
        ("vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse4_1 avx avx2 fma\n", {}, True),
        ("vendor_id\t: AuthenticAMD\nflags\t\t: avx2 avx512f avx512_vnni\n", {}, False),
        ("vendor_id\t: AuthenticAMD\nflags\t\t: avx2 avx_vnni\n", {}, False),
        ("vendor_id\t: GenuineIntel\nflags\t\t: avx2\n", {}, False),  # MKL by default
        ("vendor_id\t: AuthenticAMD\nflags\t\t: avx2\n", {"CT2_USE_MKL": "1"}, False),
    ],
)
def test_int8_saturation_is_told_from_the_cpu(monkeypatch, cpuinfo, env, want):
    monkeypatch.setattr(ct2_export.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("CT2_USE_MKL", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ct2_export.int8_saturates(cpuinfo) is want
    monkeypatch.setattr(ct2_export.platform, "machine", lambda: "aarch64")
    assert ct2_export.int8_saturates(cpuinfo) is False  # no oneDNN u8s8 kernels there


def test_placeholders_fill_a_vocabulary_larger_than_the_tokenizer(tmp_path):
    model = perturbed_model(5)
    settings = ct2_export.export_ct2(
        model, PIECES[:30], {"tokenizer.model": b"spm"}, str(tmp_path / "m")
    )
    vocab = json.loads((tmp_path / "m" / "shared_vocabulary.json").read_text())
    assert vocab[:30] == PIECES[:30] and len(vocab) == len(set(vocab)) == 40
    assert settings["vocab_limit"] == 30
    assert settings["never_generate"] == ["<pad>", "<s>", *vocab[30:]]


def test_unsupported_configs_are_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Future(TransformerConfig):
        rotary: bool = False

    assert ct2_export.unsupported(Future(vocab_size=40)) == []
    assert ct2_export.unsupported(Future(vocab_size=40, rotary=True)) == [
        "rotary=True (unknown to the converter)"
    ]
    odd = TransformerConfig(vocab_size=40)
    object.__setattr__(odd, "activation", "mish")  # as a later version might allow
    assert ct2_export.unsupported(odd) == ["activation='mish' (supported: relu, gelu, swish)"]
    model = perturbed_model(6)
    object.__setattr__(model.config, "norm", "sandwich")
    with pytest.raises(ValueError, match="cannot express this model: norm='sandwich'"):
        ct2_export.transformer_spec(model, PIECES)


def test_export_replaces_only_an_earlier_export(tmp_path):
    model = perturbed_model(7)
    target = tmp_path / "m"
    ct2_export.export_ct2(model, PIECES, {"tokenizer.model": b"one"}, str(target))
    ct2_export.export_ct2(
        model, PIECES, {"tokenizer.model": b"two"}, str(target), quantization="int8"
    )
    assert (target / "tokenizer.model").read_bytes() == b"two"
    assert json.loads((target / "decoding.json").read_text())["quantization"] == "int8"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no earlier CTranslate2 export"):
        ct2_export.export_ct2(model, PIECES, {"tokenizer.model": b"x"}, str(other))
    assert os.listdir(other) == ["notes.txt"]
    with pytest.raises(ValueError, match="quantization must be one of"):
        ct2_export.export_ct2(
            model, PIECES, {"tokenizer.model": b"x"}, str(tmp_path / "n"), quantization="int4"
        )


def test_missing_ctranslate2_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install '\.\[serve\]'"):
        ct2_export.import_ctranslate2()

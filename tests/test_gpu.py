"""GPU checks the CPU suite cannot make: cuDNN attention, bf16 training, bf16 cached decoding.

The GPU tests are marked `gpu` and skipped unless JAX's default backend is a
GPU. tests/conftest.py pins JAX to the CPU unless JAX_PLATFORMS is set, so run

    JAX_PLATFORMS=cuda python -m pytest -p no:xdist -m gpu tests/test_gpu.py

as `bench/gpu/suite.sh` does. With GPU_SUITE_ON_CPU=1 (the suite's --dry-run)
the tests that do not need cuDNN itself also run on the CPU, in bf16, which
checks their plumbing and tolerances; the cuDNN ones stay skipped there. The
last test (marked slow, CPU only) runs that dry run of the whole suite.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_jax import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Transformer,
    TransformerConfig,
    attention,
)
from attention_jax.attention import dot_product_attention, resolve_impl
from attention_jax.search import decoding
from tests.conftest import model_fields
from tests.masks import length_mask

ON_GPU = jax.default_backend() == "gpu"
DRY_RUN = os.environ.get("GPU_SUITE_ON_CPU") == "1"


def needs_gpu(test):
    """Marked `gpu`; skipped unless JAX runs on a GPU."""
    skip = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (run with JAX_PLATFORMS=cuda)")
    return pytest.mark.gpu(skip(test))


def gpu_or_dry_run(test):
    """Marked `gpu`; skipped unless JAX runs on a GPU or GPU_SUITE_ON_CPU=1 (a dry run)."""
    reason = "needs a GPU (or GPU_SUITE_ON_CPU=1 for a CPU dry run)"
    return pytest.mark.gpu(pytest.mark.skipif(not (ON_GPU or DRY_RUN), reason=reason)(test))


@pytest.fixture(autouse=True)
def _fresh_cudnn_probe():
    attention._cudnn_works.cache_clear()
    yield
    attention._cudnn_works.cache_clear()


# --- cuDNN flash attention against XLA, bf16 -----------------------------------------------

# name: (T, S, causal, query lengths, key lengths). The length-11 rows are what
# tests/test_attention.py shows our Transformer derives from a real bucketed batch
# (odd lengths, length 1, two all-padding filler rows); the others are a full
# 256 bucket and a cross-attention whose source is longer than its target.
FILLER = [0, 0]
MASK_CASES = {
    "encoder_11": (11, 11, False, [1, 5, 8, 11, *FILLER], [1, 5, 8, 11, *FILLER]),
    "decoder_11": (11, 11, True, [3, 1, 10, 11, *FILLER], [3, 1, 10, 11, *FILLER]),
    "cross_11": (11, 11, False, [3, 1, 10, 11, *FILLER], [1, 5, 8, 11, *FILLER]),
    "encoder_256": (256, 256, False, [256, 255, 129, 1, *FILLER], [256, 255, 129, 1, *FILLER]),
    "decoder_256": (256, 256, True, [256, 200, 65, 1, *FILLER], [256, 200, 65, 1, *FILLER]),
    "cross_128x256": (128, 256, False, [128, 77, 1, 9, *FILLER], [256, 131, 3, 1, *FILLER]),
}


def _max_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@needs_gpu
@pytest.mark.parametrize("case", MASK_CASES)
def test_cudnn_matches_xla_in_bf16(case, record_property):
    """impl='cudnn' (lengths) vs impl='xla' (dense mask), bf16, Transformer-base heads (8 x 64).

    Forward output and dq, dk, dv are finite everywhere (filler rows included),
    exactly zero at padded rows, and as close to a float32 evaluation of the
    same bf16 inputs as XLA's own bf16 path is: error <= 2 x XLA's + 1% of the
    values' scale (both round attention probabilities to bf16 before P @ V; they
    differ in summation order). What the raw kernel leaves in padded rows,
    which `_fused_attention` masks, is recorded as a test property.
    """
    t, s, causal, q_len, kv_len = MASK_CASES[case]
    mask = length_mask(q_len, kv_len, t, s, causal)
    rng = np.random.default_rng(0)
    b, n, h = len(q_len), 8, 64
    q, k, v, g = (
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        for shape in [(b, t, n, h), (b, s, n, h), (b, s, n, h), (b, t, n, h)]
    )

    def run(impl, dtype):
        attend = lambda *a: dot_product_attention(*a, mask, impl=impl)
        args = [x.astype(dtype) for x in (q, k, v)]
        out, vjp = jax.vjp(attend, *args)
        return (out, *vjp(g.astype(dtype)))

    fused = jax.jit(lambda: run("cudnn", jnp.bfloat16))()
    plain = jax.jit(lambda: run("xla", jnp.bfloat16))()
    exact = jax.jit(lambda: run("xla", jnp.float32))()
    q_pad = np.arange(t)[None, :] >= np.asarray(q_len)[:, None]  # [B, T]
    kv_pad = np.arange(s)[None, :] >= np.asarray(kv_len)[:, None]  # [B, S]
    pads = (q_pad, q_pad, kv_pad, kv_pad)
    for name, f, p, e, pad in zip(
        ("output", "dq", "dk", "dv"), fused, plain, exact, pads, strict=True
    ):
        f = np.asarray(f, np.float32)
        assert np.isfinite(f).all(), name
        assert not f[pad].any(), f"{name} is not zero at padded rows"
        scale = float(np.abs(np.asarray(e)).max())
        bound = 2 * _max_err(p, e) + 0.01 * scale
        assert _max_err(f, e) <= bound, (name, _max_err(f, e), _max_err(p, e), scale)

    def raw(q, k, v):  # at even lengths, as `_fused_attention` calls it; back to T and S
        out = attention._cudnn_kernel(*map(attention._pad_to_even, (q, k, v)), mask)
        return out[:, :t]

    out, vjp = jax.vjp(raw, q, k, v)
    dq, dk, dv = vjp(g)
    finite = lambda x, pad: bool(np.isfinite(np.asarray(x, np.float32)[pad]).all())
    raw_finite = {
        "output": finite(out, q_pad),
        "dq": finite(dq, q_pad),
        "dk": finite(dk, kv_pad),
        "dv": finite(dv, kv_pad),
    }
    record_property("raw_kernel_padded_rows_finite", raw_finite)


@needs_gpu
def test_auto_picks_cudnn_on_this_gpu(caplog):
    """The probe passes here, so 'auto' (the default) trains and decodes on cuDNN in bf16.

    A failure means 'auto' fell back to XLA attention on this machine, and the
    benchmarks measured that; the message gives the reason the probe logged.
    """
    with caplog.at_level("WARNING", logger="attention_jax.attention"):
        impl = resolve_impl("auto", jnp.bfloat16, 64)
    assert impl == "cudnn", [r.getMessage() for r in caplog.records]


def _raising_kernel(q, k, v, mask):
    raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED (planted by tests/test_gpu.py)")


def _bf16_config(**overrides) -> TransformerConfig:
    sizes = dict(vocab_size=64, d_model=128, num_encoder_layers=2, num_decoder_layers=2, d_ff=256)
    return TransformerConfig(
        **model_fields(**{**sizes, "max_len": 64, "dtype": "bfloat16", **overrides})
    )


def _ragged(rng, lengths, width, vocab, prefix=None, suffix=None) -> np.ndarray:
    """[B, width] rows of random ids 4..V-1 with optional BOS/EOS, zero-padded."""
    rows = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        if n <= 0:
            continue  # an all-padding filler row
        ids = list(rng.integers(4, vocab, n))
        ids = ([prefix] if prefix is not None else []) + ids + ([suffix] if suffix else [])
        rows[i, : len(ids)] = ids
    return rows


@gpu_or_dry_run
def test_auto_falls_back_to_xla_when_cudnn_raises(monkeypatch, caplog):
    """cuDNN raising (as reported for its fused attention under CUDA 13): 'auto' trains on
    XLA attention, with one warning, whatever the number of attention calls."""
    monkeypatch.setattr(attention, "_on_gpu", lambda: True)  # a no-op on a GPU
    monkeypatch.setattr(attention, "_cudnn_kernel", _raising_kernel)
    rng = np.random.default_rng(0)
    src = jnp.asarray(_ragged(rng, [9, 4, 1, 0], 12, 64, suffix=EOS_ID))
    tgt = jnp.asarray(_ragged(rng, [7, 11, 0, 0], 12, 64, prefix=BOS_ID))
    model = Transformer(_bf16_config(), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(src, tgt)
        return jnp.where(tgt != PAD_ID, jax.nn.logsumexp(logits, axis=-1), 0.0).sum()

    with caplog.at_level("WARNING", logger="attention_jax.attention"):
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        value_again = jax.jit(loss)(params)
    assert np.isfinite(float(value)) and float(value) == pytest.approx(float(value_again))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    warnings = [r.getMessage() for r in caplog.records if r.name == "attention_jax.attention"]
    assert len(warnings) == 1 and "CUDNN_STATUS_NOT_SUPPORTED" in warnings[0], warnings


# --- bf16 training and decoding ------------------------------------------------------------

TRAIN_STEPS = 20
# Largest |bf16 loss - float32 loss| / float32 loss allowed at any of the 20 steps.
# Params, LayerNorm, softmax and the loss are float32 in both runs; bf16 holds the
# matmul inputs and activations (8 significant bits, rounding ~0.2%), with float32
# accumulation, so the runs drift apart slowly. Measured on the CPU dry run (XLA
# attention): 0.02% at most while the loss falls from 6.1 to 4.8. 1% leaves room
# for cuDNN's and cuBLAS's summation orders and still catches a wrong mask (a
# row attending padding) or a step poisoned by NaN.
TRAIN_RTOL = 0.01


def _train_losses(dtype: str, batches) -> list[float]:
    from attention_jax.training import mesh as mesh_lib
    from bench import harness
    from tests.conftest import small_train_config

    config = small_train_config()
    config.model.dtype = dtype
    config.model.dropout_rate = 0.0  # the same function in both runs, up to rounding
    config.model.attention_impl = "auto"
    config.mesh_data, config.mesh_fsdp, config.mesh_tensor = -1, 1, 1
    mesh, _, state, train_step = harness.build_train_step(config)
    losses = []
    for batch in batches:
        state, metrics = train_step(state, mesh_lib.shard_batch(batch, mesh))
        assert int(metrics["nonfinite"]) == 0, f"non-finite step {len(losses)} in {dtype}"
        losses.append(float(metrics["loss"]))
    return losses


def _synthetic_batches(num: int, rows: int = 16, length: int = 16, vocab: int = 300):
    """A copy task laid out by data.pipeline: ragged rows of 0..15 Zipf-distributed ids
    before EOS/BOS (odd lengths, length 1 included), two all-padding filler rows each.
    Learnable enough that 20 steps move the loss, so the two runs are compared in motion."""
    from attention_jax.data.batches import assemble_bucketed
    from attention_jax.data.tokenized import TokenizedCorpus

    rng = np.random.default_rng(0)
    real = rows - 2
    n = num * real
    lens = rng.integers(0, length, n).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int64)
    zipf = 1.0 / np.arange(1, vocab - 3)
    ids = 4 + rng.choice(vocab - 4, int(lens.sum()), p=zipf / zipf.sum()).astype(np.int32)
    tc = TokenizedCorpus(ids, starts, lens, ids, starts, lens, np.arange(n, dtype=np.int64))
    return [
        assemble_bucketed(tc, np.arange(i * real, (i + 1) * real), rows, length) for i in range(num)
    ]


@gpu_or_dry_run
def test_bf16_training_tracks_float32(record_property):
    """20 train steps (the real `training.steps` step, Adam, label smoothing) of a small
    model on the same padded batches in bf16 and float32: every loss finite, no step
    skipped as non-finite, and the bf16 loss within TRAIN_RTOL of float32's at every step."""
    batches = _synthetic_batches(TRAIN_STEPS)
    f32 = np.array(_train_losses("float32", batches))
    bf16 = np.array(_train_losses("bfloat16", batches))
    rel = np.abs(bf16 - f32) / f32
    record_property("max_rel_loss_diff", float(rel.max()))
    record_property("losses_f32", [round(x, 4) for x in f32.tolist()])
    record_property("losses_bf16", [round(x, 4) for x in bf16.tolist()])
    assert np.isfinite(bf16).all() and np.isfinite(f32).all()
    assert f32[-1] < f32[0] - 0.5, "float32 did not learn: a comparison at rest means little"
    assert rel.max() <= TRAIN_RTOL, rel


# Largest |cached - full| logit difference allowed in bf16. Both passes see bf16
# activations, but the full pass attends over whole [T, T] blocks (on a GPU, by
# cuDNN with lengths) and the cached one row by row over a cache (dense mask, XLA),
# so they round differently. Logits here are O(1) (a LayerNorm'd state against
# the tied embedding); measured on the CPU dry run: 0.024.
DECODE_ATOL = 0.15


@gpu_or_dry_run
def test_cached_bf16_decoding_equals_full_forward(record_property):
    """bf16, attention_impl='auto': step-by-step decoding with the KV cache gives the
    full forward pass's logits (teacher forcing, within DECODE_ATOL), and greedy
    search emits the full pass's argmax wherever its top-2 margin exceeds 2 x DECODE_ATOL."""
    cfg = _bf16_config(vocab_size=32)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    src = jnp.asarray(_ragged(rng, [13, 5, 1, 9, 0, 0], 16, cfg.vocab_size, suffix=EOS_ID))
    length = 12

    # Teacher forcing: full pass over tgt_in vs. one decode_step per position.
    tgt_in = jnp.asarray(_ragged(rng, [11] * 6, length, cfg.vocab_size, prefix=BOS_ID))
    full = np.asarray(nnx.jit(lambda m, s, t: m(s, t))(model, src, tgt_in))  # [B, T, V]
    step = nnx.jit(lambda m, tok, c: m.decode_step(tok, c))
    cache = model.init_cache(src, max_decode_len=length)
    cached = []
    for t in range(length):
        logits, cache = step(model, tgt_in[:, t], cache)
        cached.append(np.asarray(logits))
    cached = np.stack(cached, axis=1)  # [B, T, V]
    real = np.asarray(src).any(axis=1)  # filler rows have nothing to compare
    err = float(np.abs(cached - full)[real].max())
    record_property("max_logit_diff", err)
    assert np.isfinite(cached).all() and err <= DECODE_ATOL, err

    # Greedy search (cached, in a while loop) against argmax of one full pass.
    tokens = np.asarray(decoding.translate_greedy(model, src, max_decode_len=length))  # [B, L]
    tgt = np.zeros_like(tokens)
    tgt[:, 0], tgt[:, 1:] = BOS_ID, tokens[:, :-1]
    logits = np.array(nnx.jit(lambda m, s, t: m(s, t))(model, src, jnp.asarray(tgt)), np.float32)
    logits[..., [PAD_ID, BOS_ID]] = -np.inf  # searches never emit these
    top2 = np.sort(logits, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * DECODE_ATOL
    checked = 0
    for b in np.flatnonzero(real):
        row = tokens[b].tolist()
        last = row.index(EOS_ID) if EOS_ID in row else length - 1
        for t in range(min(last + 1, length - 1)):  # the last column is a forced EOS
            if clear[b, t]:
                checked += 1
                assert row[t] == int(np.argmax(logits[b, t])), (b, t)
    record_property("greedy_positions_checked", checked)
    assert checked >= 5, "too few clear-cut positions for the comparison to mean anything"


# --- The suite's plumbing, on the CPU ---------------------------------------------------------


@pytest.mark.slow  # 3-5 minutes: the dry run compiles and runs every step on the CPU
@pytest.mark.skipif(ON_GPU or DRY_RUN, reason="the dry run is the CPU stand-in for the suite")
def test_gpu_suite_dry_run(tmp_path):
    """bench/gpu/suite.sh --dry-run: every step runs and lands where the GPU run's would."""
    import json
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "suite"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    env |= {"PYTHON": sys.executable, "GPU_SUITE_SITE": str(tmp_path / "site")}
    proc = subprocess.run(
        ["bash", "bench/gpu/suite.sh", str(out), "--dry-run", "--commit", "abc1234"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["dry_run"], summary
    steps = {s["step"]: s["status"] for s in summary["steps"]}
    assert steps["setup"] == steps["pytest"] == steps["train_base"] == "ok", steps
    assert steps["decode_base"] == steps["train_big"] == "ok", steps
    assert summary["tests"].get("passed", 0) >= 3 and "failed" not in summary["tests"]
    assert re.fullmatch(r"cpu-\d{8}-abc1234\.jsonl", summary["results_file"]), summary
    rows = [json.loads(line) for line in (out / summary["results_file"]).read_text().splitlines()]
    ran = [s for s, status in steps.items() if s.startswith(("train", "decode")) and status == "ok"]
    assert [r["suite"]["step"] for r in rows] == ran
    assert {r["benchmark"] for r in rows} == {"train", "decode"}
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["backend"] == "cpu" and env_json["versions"]["jax"] == jax.__version__
    tests = [json.loads(line) for line in (out / "pytest.jsonl").read_text().splitlines()]
    assert tests[-1]["exitstatus"] == 0
    assert {t["nodeid"].split("::")[1].split("[")[0] for t in tests[:-1]} >= {
        "test_cudnn_matches_xla_in_bf16",
        "test_bf16_training_tracks_float32",
        "test_cached_bf16_decoding_equals_full_forward",
    }
    logged = sorted(f"{s}.log" for s, status in steps.items() if status != "skipped")
    assert sorted(p.name for p in (out / "logs").iterdir()) == logged


@pytest.mark.skipif(ON_GPU or DRY_RUN, reason="the dry run is the CPU stand-in for the suite")
def test_gpu_suite_only_reruns_the_steps_named(tmp_path):
    """--only runs setup and the steps named, the rest are skipped; an unknown name is refused."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    env |= {"PYTHON": sys.executable, "GPU_SUITE_SITE": str(tmp_path / "site")}
    env |= {"PYTEST_K": "auto_picks"}  # one GPU test, which skips on the CPU
    suite = ["bash", "bench/gpu/suite.sh", str(tmp_path / "suite"), "--dry-run"]
    run = lambda *args: subprocess.run(
        [*suite, *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )

    refused = run("--only", "pytest,train_huge")
    assert refused.returncode == 2 and "no step train_huge" in refused.stderr, refused.stderr
    proc = run("--only", "pytest")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "suite" / "summary.json").read_text())
    steps = {s["step"]: s["status"] for s in summary["steps"]}
    assert steps.pop("setup") == steps.pop("pytest") == "ok", steps
    assert set(steps.values()) == {"skipped"} and len(steps) == 5, steps
    assert summary["tests"] == {"skipped": 1} and summary["benchmarks"] == 0, summary

"""Train step pieces against independent references: the paper's schedule, NumPy
cross-entropy, FLOPs from the parameter count, gradient accumulation, and learning."""

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_jax import Transformer
from attention_jax.runtime.errors import UserError
from attention_jax.training import metrics, optim, steps, validate
from attention_jax.training.config import model_config
from attention_jax.training.mesh import mesh_shape, shard_batch
from attention_jax.training.state_buffers import BufferLayout
from tests.conftest import small_train_config
from tests.training import numpy_smoothed_ce, reverse_batch, setup_train_step

# --- Schedules --------------------------------------------------------------------


def test_rsqrt_schedule_is_the_papers_formula():
    cfg = small_train_config(schedule="rsqrt", learning_rate=1.0, warmup_steps=4000)
    cfg.model.d_model = 512
    schedule = optim.make_schedule(cfg)
    for step in (1, 2, 100, 3999, 4000, 4001, 10_000, 100_000):
        paper = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)  # eq. (3), step counted from 1
        assert float(schedule(step - 1)) == pytest.approx(paper, rel=1e-6)
    # The peak is at step = warmup, where both branches agree.
    assert float(schedule(3999)) == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-6)


def test_linear_rsqrt_and_cosine_schedules():
    cfg = small_train_config(
        schedule="linear_rsqrt", learning_rate=2e-3, warmup_steps=100, num_train_steps=1000
    )
    s = optim.make_schedule(cfg)
    assert float(s(49)) == pytest.approx(2e-3 * 50 / 100, rel=1e-6)
    assert float(s(99)) == pytest.approx(2e-3, rel=1e-6)
    assert float(s(399)) == pytest.approx(2e-3 * math.sqrt(100 / 400), rel=1e-6)
    cfg.schedule = "cosine"
    s = optim.make_schedule(cfg)
    assert float(s(100)) == pytest.approx(2e-3, rel=1e-6)
    assert float(s(550)) == pytest.approx(2e-3 * 0.5, rel=1e-5)
    assert float(s(1000)) == pytest.approx(0.0, abs=1e-9)
    cfg.schedule = "nope"  # caught before anything is built
    with pytest.raises(UserError, match="schedule"):
        validate(cfg)


# --- Loss -------------------------------------------------------------------------


def test_loss_matches_numpy_label_smoothing():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(1, 11, size=(3, 5)).astype(np.int32)
    targets[0, 3:] = 0  # padding: weight 0
    targets[2, 1:] = 0
    sums = steps.loss_sums(jnp.asarray(logits), jnp.asarray(targets), 0.1)
    out = steps.summarize(sums)
    want_loss, want_ppl = numpy_smoothed_ce(logits, targets, 0.1)
    assert float(out["loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(out["perplexity"]) == pytest.approx(want_ppl, rel=1e-5)
    assert float(sums["tokens"]) == (targets != 0).sum()
    hits = (logits.argmax(-1) == targets) & (targets != 0)
    assert float(out["accuracy"]) == pytest.approx(hits.sum() / (targets != 0).sum())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_logits_at_padded_positions_change_nothing(bad):
    """Fused attention kernels may leave garbage in rows they skip: the loss must select
    real positions, not multiply by zero weights (0 * NaN = NaN, in the value and the
    gradient)."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 6, 11)).astype(np.float32) * 3
    targets = rng.integers(1, 11, size=(3, 6)).astype(np.int32)
    targets[0, 4:] = 0
    targets[1, 1:] = 0
    targets[2, :] = 0  # an all-padding filler row
    poisoned = np.where((targets == 0)[..., None], np.float32(bad), logits)
    want_loss, want_ppl = numpy_smoothed_ce(logits, targets, 0.1)

    def total(x):
        return steps.loss_sums(x, jnp.asarray(targets), 0.1)["loss"]

    out = steps.summarize(steps.loss_sums(jnp.asarray(poisoned), jnp.asarray(targets), 0.1))
    assert float(out["loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(out["perplexity"]) == pytest.approx(want_ppl, rel=1e-5)
    grad = np.asarray(jax.grad(total)(jnp.asarray(poisoned)))
    assert np.isfinite(grad).all()
    np.testing.assert_array_equal(grad[targets == 0], 0.0)
    clean = np.asarray(jax.grad(total)(jnp.asarray(logits)))
    np.testing.assert_allclose(grad, clean, rtol=1e-6, atol=1e-7)
    # Through the model: parameters feeding the poisoned logits get finite gradients.
    cfg = small_train_config(vocab_size=11)
    model = Transformer(model_config(cfg), rngs=nnx.Rngs(0))
    src = jnp.asarray(rng.integers(4, 11, size=(3, 6)), jnp.int32)
    tgt_in = jnp.asarray(np.where(targets > 0, 5, 0), jnp.int32)

    def param_loss(m):
        out = m(src, tgt_in)
        return total(jnp.where(jnp.asarray(targets == 0)[..., None], bad, out))

    grads = nnx.jit(nnx.grad(param_loss))(model)  # one program, not one per operation
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


# --- FLOPs ------------------------------------------------------------------------


def test_flops_are_six_times_matmul_params_for_short_sequences():
    cfg = small_train_config()
    mcfg = model_config(cfg)
    params = nnx.state(Transformer(mcfg, rngs=nnx.Rngs(0)), nnx.Param)
    # Matmul weights: every >= 2-D kernel except the embedding table, which is used once
    # as the output projection (tied); biases/LayerNorms are not matmuls.
    kernels = [
        x.size
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if x.ndim >= 2 and "embedding" not in jax.tree_util.keystr(path)
    ]
    d, v = mcfg.d_model, mcfg.vocab_size
    # One source + one target token, attention over length 0 (no attention FLOPs):
    # every kernel touches one token, except cross-attention K/V which read the source.
    assert metrics.train_flops(mcfg, 1, 1, 0, 0) == pytest.approx(6 * (sum(kernels) + d * v))


def test_train_window_bounds_the_steps_in_flight():
    """After wait(), every step but the last `in_flight` has finished: a SIGTERM is
    answered within those steps, not after every step JAX's async dispatch queued;
    `in_flight` is about a second of steps at the last window's pace, at least 2."""

    @jax.jit
    def slow_step(x):  # ~10 ms on CPU; each step needs the one before (like the state)
        for _ in range(4):
            x = jnp.tanh(x @ x)
        return x, {"loss": x[0, 0], "nonfinite": False, "tokens": 10, "src_tokens": 10}

    window = metrics.TrainWindow(model_config(small_train_config()), None, 1)
    assert window.in_flight == metrics.MIN_RUN_AHEAD_STEPS == 2
    x = jnp.full((512, 512), 0.01)
    slow_step(x)[0].block_until_ready()  # compiled before the loop
    for n in range(12):
        x, step_metrics = slow_step(x)
        window.add(step_metrics, 1, 1)
        window.wait()
        assert all(m["loss"].is_ready() for m in window.steps[: max(0, n - 1)]), n
    assert len(window.steps) == 12  # waiting fetches nothing: the window keeps them all

    for key in ("accuracy", "perplexity", "grad_norm", "learning_rate"):
        for m in window.steps:
            m[key] = 0.0
    window.start -= 12 / 40 - (time.time() - window.start)  # 12 steps in 0.3 s: 40/s
    _, row = window.flush()  # (a loaded box adds its delay to the 0.3 s)
    assert 3 <= row["steps_per_sec"] <= 40  # above the floor of 2 steps
    assert window.in_flight == int(row["steps_per_sec"] * metrics.RUN_AHEAD_SECONDS)
    window.add(step_metrics, 1, 1)
    window.start -= 10.0  # one step in 10 s: the floor
    window.flush()
    assert window.in_flight == 2


def test_peak_flops_lookup():
    cfg = small_train_config()
    assert metrics.peak_flops_per_device(cfg) is None  # CPU: unknown
    cfg.peak_flops_per_device = 1e12
    assert metrics.peak_flops_per_device(cfg) == 1e12


def test_mesh_shape():
    assert mesh_shape((-1, 1, 1), 8) == (8, 1, 1)
    assert mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    with pytest.raises(UserError, match="multiply to 4"):
        mesh_shape((2, 2, 1), 8)
    with pytest.raises(UserError):
        mesh_shape((-1, -1, 1), 8)
    with pytest.raises(UserError, match="divide"):
        mesh_shape((3, -1, 1), 8)


# --- Steps ------------------------------------------------------------------------


@pytest.mark.slow  # ~40 s: two train steps compiled
def test_grad_accumulation_equals_one_big_batch():
    rng = np.random.default_rng(1)
    batches = [reverse_batch(rng, 8, 10, 40) for _ in range(3)]
    results = []
    for k in (1, 4):
        cfg = small_train_config(grad_accum_steps=k, grad_clip_norm=0.5)
        cfg.model.dropout_rate = 0.0  # dropout masks differ by micro-batch split
        mesh, train_step, state = setup_train_step(cfg)
        losses = []
        for b in batches:
            state, m = train_step(state, shard_batch(b, mesh))
            losses.append(float(m["loss"]))
        results.append((losses, jax.device_get(state.params)))
    (l1, p1), (l4, p4) = results
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_packed_step_is_the_step_on_the_state():
    """The loop's step (on the state packed into a few buffers, or on its leaves; dropout
    on) against make_train_step's: on the leaves the same program, bit for bit; packed,
    XLA fuses the Adam update into the packing, so the same to float32 rounding; and
    unpacking gives the state back."""
    rng = np.random.default_rng(2)
    batches = [reverse_batch(rng, 8, 10, 40) for _ in range(3)]
    cfg = small_train_config()
    mesh, train_step, start = setup_train_step(cfg)
    setup = steps.train_setup(cfg, mesh)
    wants, state = [], start
    for b in batches:
        state, metrics = train_step(state, shard_batch(b, mesh))
        wants.append(jax.device_get(metrics))
    for pack in (True, False):
        same = np.testing.assert_array_equal
        if pack:
            same = functools.partial(np.testing.assert_allclose, rtol=2e-6, atol=1e-7)
        fresh = steps.init_train_state(setup)
        leaves, treedef = jax.tree.flatten(fresh)
        layout = BufferLayout.of(leaves, pack=pack)
        # params and both Adam moments in one float32 buffer; typed PRNG keys stay apart
        assert (layout.num_buffers < 10) == pack
        packed = steps.make_buffered_steps(setup, treedef, layout)
        buffers, packed_step = packed.pack(fresh), packed.step
        for b, want in zip(batches, wants, strict=True):
            buffers, got = packed_step(buffers, shard_batch(b, mesh))
            assert got.keys() == want.keys()
            for k in want:
                tolerance = dict(rtol=1e-4) if pack and k == "perplexity" else {}  # exp(loss)
                same(np.asarray(got[k]), np.asarray(want[k]), **tolerance)
        assert len(buffers) == layout.num_buffers
        unpacked = packed.unpack(buffers)
        for a, b in zip(jax.tree.leaves(unpacked), jax.tree.leaves(state), strict=True):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            assert a.shape == b.shape and a.dtype == b.dtype
            same(np.asarray(a), np.asarray(b))
        assert int(unpacked.step) == 3
        buffers, _ = packed_step(buffers, shard_batch(batches[0], mesh))  # still valid


# ~60 s of training; in make test, test_decode_cli's fixture trains a model that must
# then translate its task exactly.
@pytest.mark.slow
def test_tiny_model_learns_to_reverse_sequences():
    cfg = small_train_config(
        vocab_size=16, learning_rate=3e-3, warmup_steps=50, num_train_steps=600, grad_clip_norm=1.0
    )
    cfg.model.d_model = 64
    cfg.model.num_heads = 4
    cfg.model.d_ff = 128
    cfg.model.num_encoder_layers = 2
    cfg.model.num_decoder_layers = 2
    cfg.model.dropout_rate = 0.0
    mesh, train_step, state = setup_train_step(cfg)
    rng = np.random.default_rng(0)
    for _ in range(cfg.num_train_steps):
        state, _ = train_step(state, shard_batch(reverse_batch(rng, 64, 10, 16), mesh))
    # Held-out batch, teacher forcing: token accuracy >= 99%.
    held_out = shard_batch(reverse_batch(np.random.default_rng(99), 256, 10, 16), mesh)
    eval_step = steps.make_eval_step(steps.train_setup(cfg, mesh))
    acc = float(steps.summarize(eval_step(state.params, state.rngs, held_out))["accuracy"])
    assert acc >= 0.99, acc

"""The chunked loss, float32-output matmuls with a low-precision backward pass, and the
model pieces they read (hidden states, the output matrix, one lookup of a shared table),
each against an independent reference: NumPy float64, or plain autodiff of the whole."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_jax import Transformer, TransformerConfig
from attention_jax.precision import einsum_f32
from attention_jax.training import loss, steps
from attention_jax.training.loss import chunked_loss_sums
from attention_jax.training.mesh import shard_batch
from tests.conftest import small_train_config
from tests.training import numpy_smoothed_ce, reverse_batch, setup_train_step


def _problem(seed=0, b=3, t=7, d=16, v=50):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((b, t, d)).astype(np.float32)
    w = (rng.standard_normal((v, d)) * 0.3).astype(np.float32)
    targets = rng.integers(1, v, (b, t)).astype(np.int32)
    targets[0, 5:] = 0
    targets[2, :] = 0  # an all-padding filler row
    return y, w, targets


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_chunked_loss_equals_numpy_and_whole_autodiff(chunk):
    y, w, targets = _problem()
    sums = chunked_loss_sums(jnp.asarray(y), jnp.asarray(w), jnp.asarray(targets), 0.1,
                             chunk_tokens=chunk)  # fmt: skip
    logits = np.einsum("btd,vd->btv", y.astype(np.float64), w.astype(np.float64))
    want_loss, want_ppl = numpy_smoothed_ce(logits, targets, 0.1)
    out = steps.summarize(sums)
    assert float(out["loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(out["perplexity"]) == pytest.approx(want_ppl, rel=1e-5)
    assert float(sums["tokens"]) == (targets != 0).sum()
    hits = ((logits.argmax(-1) == targets) & (targets != 0)).sum()
    assert float(sums["correct"]) == hits

    def whole(y, w):
        return loss.loss_sums(jnp.einsum("BTD,VD->BTV", y, w), jnp.asarray(targets), 0.1)

    def chunked(y, w):
        return chunked_loss_sums(y, w, jnp.asarray(targets), 0.1, chunk_tokens=chunk)

    args = (jnp.asarray(y), jnp.asarray(w))
    want = jax.grad(lambda y, w: 3.0 * whole(y, w)["loss"], argnums=(0, 1))(*args)
    got = jax.jit(jax.grad(lambda y, w: 3.0 * chunked(y, w)["loss"], argnums=(0, 1)))(*args)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_bf16_logits_stay_within_bf16_rounding_of_float64():
    """loss_logits_dtype='bfloat16' (bf16 operands, as on an accelerator): each logit
    rounded once, the statistics in float32. The loss and its gradients stay within bf16's
    rounding of a float64 NumPy reference, and the rounding does happen."""
    y, w, targets = _problem(seed=3, t=9, v=300)
    y16, w16 = jnp.asarray(y, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    yr, wr = np.asarray(y16, np.float64), np.asarray(w16, np.float64)  # what bf16 holds
    logits = np.einsum("btd,vd->btv", yr, wr)
    want_loss, _ = numpy_smoothed_ce(logits, targets, 0.1)
    # d(summed smoothed loss)/d(logits) = p - q at real tokens, by hand
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    v = logits.shape[-1]
    q = np.where(np.arange(v) == targets[..., None], 0.9, 0.1 / (v - 1))
    g = np.where((targets != 0)[..., None], p - q, 0.0)
    want_grads = (np.einsum("btv,vd->btd", g, wr), np.einsum("btv,btd->vd", g, yr))

    def run(dtype):
        def loss(y, w):
            sums = chunked_loss_sums(
                y, w, jnp.asarray(targets), 0.1, chunk_tokens=5, logits_dtype=dtype
            )
            return sums["loss"], sums

        (_, sums), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(y16, w16)
        err = abs(float(steps.summarize(sums)["loss"]) - want_loss) / want_loss
        rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
        return err, [rel(a, b) for a, b in zip(grads, want_grads, strict=True)]

    err32, grads32 = run("float32")
    err16, grads16 = run("bfloat16")
    assert err32 < 1e-5 and err16 < 1e-3
    assert err16 > err32  # the logits really were rounded
    for e in grads32 + grads16:  # every gradient is bf16 in both (as the model's are)
        assert e < 2e-2


def test_chunked_loss_ignores_garbage_at_padded_positions():
    """NaN in the states of padding tokens (a fused kernel's leftovers) changes nothing."""
    y, w, targets = _problem(seed=1)
    poisoned = np.where((targets == 0)[..., None], np.nan, y).astype(np.float32)

    def loss(y):
        return chunked_loss_sums(y, jnp.asarray(w), jnp.asarray(targets), 0.1, chunk_tokens=4)

    clean, dirty = loss(jnp.asarray(y)), loss(jnp.asarray(poisoned))
    assert jax.tree.map(float, clean) == jax.tree.map(float, dirty)
    poisoned, targets = jnp.asarray(poisoned), jnp.asarray(targets)
    grad_w = jax.grad(
        lambda w: chunked_loss_sums(poisoned, w, targets, 0.1, chunk_tokens=4)["loss"]
    )(jnp.asarray(w))
    assert np.isfinite(np.asarray(grad_w)).all()


def test_einsum_f32_returns_float32_and_keeps_the_backward_in_bf16():
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((10, 8)), jnp.bfloat16)
    out = einsum_f32("BTD,VD->BTV", a, b)
    assert out.dtype == jnp.float32
    ref = np.einsum("btd,vd->btv", np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)  # bf16 inputs, f32 sums
    g = rng.standard_normal(out.shape)

    def f(a, b):
        return (einsum_f32("BTD,VD->BTV", a, b) * jnp.asarray(g, jnp.float32)).sum()

    da, db = jax.grad(f, argnums=(0, 1))(a, b)
    assert da.dtype == db.dtype == jnp.bfloat16
    want_a = np.einsum("btv,vd->btd", g, np.asarray(b, np.float64))
    want_b = np.einsum("btv,btd->vd", g, np.asarray(a, np.float64))
    np.testing.assert_allclose(np.asarray(da, np.float64), want_a, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(db, np.float64), want_b, rtol=2e-2, atol=5e-2)
    # Every matmul of the gradient takes bf16 operands (float32 ones would run ~15x slower
    # on an H100's tensor cores, and in several passes on a TPU).
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(a, b)
    kinds = [tuple(str(v.aval.dtype) for v in e.invars) for e in _dots(jaxpr.jaxpr)]
    # forward, two gradient matmuls (and the backward rule's unused primal, which XLA drops)
    assert len(kinds) >= 3 and all(k == ("bfloat16", "bfloat16") for k in kinds), kinds


def _dots(jaxpr):
    """Every dot_general equation of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _dots(inner)


def test_einsum_f32_on_float32_is_the_plain_einsum():
    rng = np.random.default_rng(3)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 5), (5, 4)))
    f = lambda a, b: einsum_f32("ij,jk->ik", a, b).sum()
    g = lambda a, b: jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32).sum()
    for x, y in zip(jax.grad(f, (0, 1))(a, b), jax.grad(g, (0, 1))(a, b), strict=True):
        np.testing.assert_array_equal(x, y)


SMALL = dict(vocab_size=40, d_model=16, num_heads=2, num_encoder_layers=1,
             num_decoder_layers=1, d_ff=32, dropout_rate=0.0, max_len=32)  # fmt: skip


@pytest.mark.parametrize("tied", [True, False])
def test_hidden_then_project_is_the_forward_pass(tied):
    cfg = TransformerConfig(**SMALL, tie_output=tied, share_embeddings=tied, norm="pre")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    src = jnp.asarray(rng.integers(4, 40, (2, 6)), jnp.int32)
    tgt = jnp.asarray(rng.integers(4, 40, (2, 5)), jnp.int32)
    y = model.hidden(src, tgt)
    np.testing.assert_array_equal(model.project(y), model(src, tgt))
    manual = np.einsum("btd,vd->btv", np.asarray(y, np.float64), np.asarray(model.output_matrix()))
    np.testing.assert_allclose(model(src, tgt), manual, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~25 s
def test_one_lookup_of_a_shared_table_has_the_gradient_of_two():
    """__call__ reads source and target rows of a shared table in one lookup; its
    gradient must equal that of encode + decode, which look up each side apart."""
    model = Transformer(TransformerConfig(**SMALL), rngs=nnx.Rngs(1))
    rng = np.random.default_rng(5)
    src = jnp.asarray(rng.integers(4, 40, (3, 6)), jnp.int32)
    tgt = jnp.asarray(rng.integers(4, 40, (3, 4)), jnp.int32)
    joint = nnx.grad(lambda m: m(src, tgt).sum())(model)
    apart = nnx.grad(lambda m: m.decode(tgt, m.encode(src), src).sum())(model)
    for a, b in zip(jax.tree.leaves(joint), jax.tree.leaves(apart), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ~45 s (two train steps compiled); the loss itself is checked against NumPy in make test.
@pytest.mark.slow
def test_train_step_with_a_chunked_loss_equals_the_whole():
    rng = np.random.default_rng(6)
    batches = [reverse_batch(rng, 8, 10, 40) for _ in range(3)]
    results = []
    for chunk in (0, 24):
        cfg = small_train_config(loss_chunk_tokens=chunk)
        cfg.model.dropout_rate = 0.0
        mesh, train_step, state = setup_train_step(cfg)
        losses = []
        for b in batches:
            state, m = train_step(state, shard_batch(b, mesh))
            losses.append((float(m["loss"]), float(m["accuracy"]), float(m["grad_norm"])))
        results.append((losses, jax.device_get(state.params)))
    (l0, p0), (l1, p1) = results
    np.testing.assert_allclose(l0, l1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# Two train steps compiled: the config reaches the step.
@pytest.mark.slow
def test_train_step_reads_loss_logits_dtype():
    batch = reverse_batch(np.random.default_rng(7), 8, 10, 40)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        cfg = small_train_config(loss_chunk_tokens=24, loss_logits_dtype=dtype)
        cfg.model.dropout_rate = 0.0
        mesh, train_step, state = setup_train_step(cfg)
        _, m = train_step(state, shard_batch(batch, mesh))
        losses[dtype] = float(m["loss"])
    assert losses["bfloat16"] != losses["float32"]  # rounded logits...
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=1e-3)  # ...only rounded

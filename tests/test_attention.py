"""Attention and masks against a NumPy float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.attention import (
    attention_weights,
    causal_mask,
    dot_product_attention,
    padding_mask,
    segment_mask,
)


def reference_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(H)) v per head in float64; fully masked rows -> 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    s = k.shape[1]
    mask = np.broadcast_to(np.asarray(mask), (b, n, t, s))
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        for ni in range(n):
            logits = q[bi, :, ni] @ k[bi, :, ni].T / np.sqrt(h)  # [T, S]
            for ti in range(t):
                allowed = mask[bi, ni, ti]
                if not allowed.any():
                    continue
                x = np.where(allowed, logits[ti], -np.inf)
                w = np.exp(x - x.max())
                w /= w.sum()
                out[bi, ti, ni] = w @ v[bi, :, ni]
    return out


def _random_qkv(seed, b=2, t=5, s=7, n=3, h=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, n, h)).astype(np.float32)
    v = rng.normal(size=(b, s, n, h)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mask_shape", ["full", "broadcast_heads"])
def test_matches_numpy_reference(seed, mask_shape):
    q, k, v = _random_qkv(seed)
    rng = np.random.default_rng(100 + seed)
    shape = (2, 3, 5, 7) if mask_shape == "full" else (2, 1, 5, 7)
    mask = rng.random(shape) > 0.3
    mask[0, 0, 1] = False  # one fully masked row
    got = dot_product_attention(q, k, v, jnp.asarray(mask))
    np.testing.assert_allclose(got, reference_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_no_mask_equals_all_true_mask():
    q, k, v = _random_qkv(3)
    mask = np.ones((2, 1, 5, 7), bool)
    np.testing.assert_allclose(
        dot_product_attention(q, k, v), reference_attention(q, k, v, mask), atol=1e-5
    )


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _random_qkv(4)
    mask = jnp.zeros((2, 1, 5, 7), bool)
    for impl in ("xla", "jax"):
        out = dot_product_attention(q, k, v, mask, impl=impl)
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_array_equal(out, 0.0)
    w = attention_weights(q, k, mask)
    np.testing.assert_array_equal(w, 0.0)


def test_gradients_finite_with_fully_masked_rows():
    q, k, v = _random_qkv(5)
    mask = jnp.zeros((2, 1, 5, 7), bool).at[:, :, :2].set(True)
    grads = jax.grad(lambda q, k, v: dot_product_attention(q, k, v, mask).sum(), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_implementations_agree(seed):
    q, k, v = _random_qkv(seed)
    mask = np.random.default_rng(seed).random((2, 1, 5, 7)) > 0.4
    mask[1, 0, 2] = False
    a = dot_product_attention(q, k, v, jnp.asarray(mask), impl="xla")
    b = dot_product_attention(q, k, v, jnp.asarray(mask), impl="jax")
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_attention_dropout_is_inverted_and_deterministic_per_key():
    q, k, v = _random_qkv(6, t=4, s=4, n=1, h=4)
    v = np.ones_like(v)
    outs = [
        dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(i))
        for i in range(200)
    ]
    # Each weight is kept with p=0.5 and scaled by 2, so E[out] = 1 for all-ones values.
    np.testing.assert_allclose(np.mean(outs, axis=0), 1.0, atol=0.15)
    again = dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
    np.testing.assert_array_equal(outs[0], again)


def test_padding_and_causal_masks():
    tokens = jnp.array([[5, 6, 7, 0], [8, 0, 0, 0]])
    pad = np.asarray(padding_mask(tokens, tokens))
    assert pad.shape == (2, 1, 4, 4)
    valid = np.asarray(tokens) != 0
    np.testing.assert_array_equal(pad[:, 0], valid[:, :, None] & valid[:, None, :])
    causal = np.asarray(causal_mask(tokens))
    lower = np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(causal[:, 0], pad[:, 0] & lower)
    assert not causal[0, 0, 0, 1]  # no look-ahead
    assert not causal[0, 0, 3, 0]  # a padded query attends nowhere


def test_segment_mask():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    m = np.asarray(segment_mask(seg, seg))[0, 0]
    expected = np.array(
        [[a == b and a > 0 for b in [1, 1, 2, 2, 2, 0]] for a in [1, 1, 2, 2, 2, 0]]
    )
    np.testing.assert_array_equal(m, expected)

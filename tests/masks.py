"""Attention masks built from lengths, for the attention tests (test_attention, test_gpu):
the dense boolean mask, and the Mask the Transformer builds (dense + lengths)."""

import jax.numpy as jnp
import numpy as np

from attention_jax.attention import Mask


def dense_from_lengths(q_len, kv_len, t: int, s: int, causal: bool) -> np.ndarray:
    """[B, 1, T, S] bool: query t < q_len, key s < kv_len, and s <= t if causal."""
    q_len, kv_len = np.asarray(q_len), np.asarray(kv_len)
    m = (np.arange(t)[None, :, None] < q_len[:, None, None]) & (
        np.arange(s)[None, None, :] < kv_len[:, None, None]
    )
    if causal:
        m &= np.tril(np.ones((t, s), bool))[None]
    return m[:, None]


def length_mask(q_len, kv_len, t: int, s: int, causal: bool) -> Mask:
    """A Mask in the form the Transformer builds (dense + lengths), from lengths."""
    dense = jnp.asarray(dense_from_lengths(q_len, kv_len, t, s, causal))
    return Mask(dense, jnp.asarray(q_len, jnp.int32), jnp.asarray(kv_len, jnp.int32), causal)

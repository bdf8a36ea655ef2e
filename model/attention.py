"""Scaled dot-product attention and its masks (paper section 3.2), as pure functions.

Layout: q [B, T, N, H], k and v [B, S, N, H]. Masks are boolean and broadcast
to [B, N, T, S]; True means "may attend". A `Mask` carries the same mask in the
compact form fused kernels want (sequence lengths + causal flag) beside the dense one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from model.config import PAD_ID


@struct.dataclass
class Mask:
    """A dense mask plus, for right-padded unpacked rows, its compact equivalent.

    dense: [B, 1, T, S] bool, always present (the 'xla' path and fallbacks use it).
    q_lengths, kv_lengths: [B] int32 real-token counts, or None (e.g. packed rows).
      Only valid when every row's real tokens come first, as our batches do.
    causal: whether key position <= query position is also required.
    XLA drops whichever form an implementation leaves unused.
    """

    dense: jax.Array
    q_lengths: jax.Array | None = None
    kv_lengths: jax.Array | None = None
    causal: bool = struct.field(pytree_node=False, default=False)

    @property
    def has_lengths(self) -> bool:
        return self.q_lengths is not None and self.kv_lengths is not None


def resolve_impl(impl: str, dtype, head_dim: int, has_lengths: bool) -> str:
    """'auto' -> 'cudnn' on GPUs where cuDNN flash attention applies, else 'xla'."""
    if impl != "auto":
        return impl
    fast_dtype = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    ok_head = head_dim <= 128 and head_dim % 8 == 0
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and fast_dtype and ok_head and has_lengths else "xla"


def padding_mask(q_tokens: jax.Array, k_tokens: jax.Array, pad_id: int = PAD_ID) -> jax.Array:
    """[B, T], [B, S] token ids -> [B, 1, T, S]: both query and key are real tokens."""
    return (q_tokens != pad_id)[:, None, :, None] & (k_tokens != pad_id)[:, None, None, :]


def causal_mask(tokens: jax.Array, pad_id: int = PAD_ID) -> jax.Array:
    """[B, T] token ids -> [B, 1, T, T]: look-ahead mask (key <= query) AND the padding mask."""
    t = tokens.shape[1]
    lower = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, T]
    return padding_mask(tokens, tokens, pad_id) & lower[None, None]


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """[B, T], [B, S] segment ids (0 = padding) -> [B, 1, T, S]: same packed pair only."""
    same = q_segments[:, None, :, None] == k_segments[:, None, None, :]
    return same & (q_segments > 0)[:, None, :, None] & (k_segments > 0)[:, None, None, :]


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(H)) in float32: q [B, T, N, H], k [B, S, N, H] -> [B, N, T, S].

    Rows whose mask is all False get all-zero weights (not NaN, not uniform).
    """
    if isinstance(mask, Mask):
        mask = mask.dense
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
    q = q * scale.astype(q.dtype)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
    if mask is None:
        return jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.where(mask.any(axis=-1, keepdims=True), weights, 0.0)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | Mask | None = None,
    *,
    impl: str = "xla",
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(H)) V, per head.

    Args:
      q: [B, T, N, H]; k, v: [B, S, N, H].
      mask: boolean, broadcastable to [B, N, T, S]; True = may attend. Or a
        `Mask`, whose sequence lengths let cuDNN skip padding without a dense mask.
      impl: 'xla' (einsum + float32 softmax, supports attention dropout),
        'jax' (`jax.nn.dot_product_attention`, XLA on CPU/TPU), 'cudnn'
        (`jax.nn.dot_product_attention(implementation='cudnn')`, GPU, bf16/fp16)
        or 'auto' (cuDNN where it applies, else 'xla').
      dropout_rate, dropout_rng: dropout on the attention weights ('xla' only).

    Returns:
      [B, T, N, H] in v's dtype. Query rows with no allowed key give zeros.
    """
    structured = mask if isinstance(mask, Mask) else None
    if structured is not None:
        mask = structured.dense
    has_lengths = structured is not None and structured.has_lengths
    impl = resolve_impl(impl, q.dtype, q.shape[-1], has_lengths)
    if impl == "xla" or (dropout_rate > 0.0 and dropout_rng is not None):
        weights = attention_weights(q, k, mask)  # [B, N, T, S] float32
        if dropout_rate > 0.0 and dropout_rng is not None:
            keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
            weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
        return jnp.einsum("BNTS,BSNH->BTNH", weights.astype(v.dtype), v)
    if impl not in ("jax", "cudnn"):
        raise ValueError(f"attention impl must be 'auto', 'xla', 'jax' or 'cudnn', got {impl!r}")
    implementation = "cudnn" if impl == "cudnn" else None
    if impl == "cudnn" and has_lengths:
        # Flash attention skips padded keys (and future keys) by length: no dense mask.
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=structured.causal,
            query_seq_lengths=structured.q_lengths.astype(jnp.int32),
            key_value_seq_lengths=structured.kv_lengths.astype(jnp.int32),
            implementation="cudnn",
        )
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    if mask is None:
        return out
    # jax.nn spreads a fully masked row uniformly over the keys; we return zeros
    # there, like the 'xla' path, so that both implementations agree.
    any_key = jnp.broadcast_to(mask, (*mask.shape[:-1], k.shape[1])).any(axis=-1)  # [B, N|1, T]
    return jnp.where(jnp.swapaxes(any_key, 1, 2)[..., None], out, 0).astype(out.dtype)

"""Scaled dot-product attention and its masks (paper section 3.2), as pure functions.

Layout: q [B, T, N, H], k and v [B, S, N, H]. Masks are boolean and broadcast
to [B, N, T, S]; True means "may attend". A `Mask` carries the same mask in the
compact form fused kernels want (sequence lengths + causal flag) beside the dense one.

impl='cudnn' runs cuDNN flash attention from those lengths, with padded rows
zeroed in both passes (`_fused_attention`); `resolve_impl` turns 'auto' into
'cudnn' on GPUs in bf16/fp16 once a one-time probe has shown that cuDNN works
here (`_cudnn_works`), and otherwise into the einsum path ('xla'), with one
logged warning. Models resolve 'auto' once, before tracing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from attention_jax.config import TransformerConfig
from attention_jax.precision import einsum_f32
from attention_jax.tokens import PAD_ID

log = logging.getLogger(__name__)


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


def _on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (a function, so tests can pretend it is)."""
    return jax.default_backend() == "gpu"


def resolve_impl(impl: str, dtype, head_dim: int, platform: str | None = None) -> str:
    """The attention implementation a model uses: 'auto' -> 'cudnn' or 'xla'; others as is.

    'auto' picks 'cudnn' on GPUs, in bf16/fp16, for head dims cuDNN's flash
    kernels take (<= 128, multiple of 8), where cuDNN works: decided once per
    (dtype, head dim) by a probe (`_cudnn_works`) that runs a tiny attention
    forward and backward here, logging one warning and giving 'xla' if it fails.
    `platform` is where the model will run (default: this process's backend);
    compiling for a GPU from another machine (train.py --compile_for=gpu:...)
    cannot probe, and gets what a GPU whose probe passes would use.

    Models resolve once, before tracing (training.config.model_config, or
    Transformer's constructor), so a traced model never probes.
    """
    if impl != "auto":
        return impl
    dtype = jnp.dtype(dtype)
    fast_dtype = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    ok_head = head_dim <= 128 and head_dim % 8 == 0
    on_gpu = _on_gpu()
    for_gpu = on_gpu if platform is None else platform == "gpu"
    if not (fast_dtype and ok_head and for_gpu):
        return "xla"
    if not on_gpu:  # compiling for a GPU elsewhere: the probe will run there, at start
        return "cudnn"
    return "cudnn" if _cudnn_works(dtype.name, head_dim) else "xla"


def resolve_config(cfg: TransformerConfig, platform: str | None = None) -> TransformerConfig:
    """`cfg` with attention_impl resolved (`resolve_impl`): what a Transformer stores."""
    impl = resolve_impl(cfg.attention_impl, cfg.dtype, cfg.head_dim, platform)
    return cfg if impl == cfg.attention_impl else dataclasses.replace(cfg, attention_impl=impl)


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


# --- The model's three masks (dense, plus lengths for cuDNN) -----------------------


def _lengths(tokens: jax.Array) -> jax.Array:
    return (tokens != PAD_ID).sum(axis=-1).astype(jnp.int32)  # [B]


def source_mask(src: jax.Array, src_segments: jax.Array | None) -> Mask:
    """The encoder's self-attention mask: padding, or a packed row's pairs."""
    if src_segments is None:
        n = _lengths(src)
        return Mask(padding_mask(src, src), q_lengths=n, kv_lengths=n)
    return Mask(segment_mask(src_segments, src_segments))


def target_source_mask(
    tgt: jax.Array, src: jax.Array, tgt_segments: jax.Array | None, src_segments: jax.Array | None
) -> Mask:
    """Cross-attention: target positions to source positions of the same pair."""
    if tgt_segments is None or src_segments is None:
        return Mask(padding_mask(tgt, src), q_lengths=_lengths(tgt), kv_lengths=_lengths(src))
    return Mask(segment_mask(tgt_segments, src_segments))


def target_mask(tgt: jax.Array, tgt_segments: jax.Array | None) -> Mask:
    """The decoder's self-attention mask: causal, within a packed row's pair."""
    if tgt_segments is None:
        n = _lengths(tgt)
        return Mask(causal_mask(tgt), q_lengths=n, kv_lengths=n, causal=True)
    dense = causal_mask(tgt) & segment_mask(tgt_segments, tgt_segments)
    return Mask(dense, causal=True)


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(H)) in float32: q [B, T, N, H], k [B, S, N, H] -> [B, N, T, S].

    Rows whose mask is all False get all-zero weights (not NaN, not uniform).
    """
    if isinstance(mask, Mask):
        mask = mask.dense
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
    q = q * scale.astype(q.dtype)
    logits = einsum_f32("BTNH,BSNH->BNTS", q, k)  # [B, N, T, S]
    if mask is None:
        return jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.where(mask.any(axis=-1, keepdims=True), weights, 0.0)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Attention of a few queries over a decoding cache: the 'xla' path in its layout.

    Args:
      q: [B, T, N, H] (T = 1 per step, or a source's K beams, for cross-attention).
      k, v: [B, N, L, H], heads before positions: the scores and the weighted sum
        are then matmuls batched over (B, N) that read the cache as it is stored;
        in [B, L, N, H] XLA on CPU transposes the whole cache first, every step.
      mask: boolean, broadcastable to [B, N, T, L]; True = may attend.
    Returns:
      [B, T, N, H] in v's dtype; softmax in float32, a query with no allowed key
      gives zeros, as `attention_weights`.
    """
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], jnp.float32))
    logits = einsum_f32("BTNH,BNLH->BNTL", q * scale.astype(q.dtype), k)  # [B, N, T, L]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = jnp.where(mask.any(axis=-1, keepdims=True), weights, 0.0)
    # [B, N, T, H] then swapped: asked for [B, T, N, H] directly, XLA on CPU runs this
    # batched matmul through a generic loop, much slower at a source's K beams (T = 4).
    o = jnp.einsum("BNTL,BNLH->BNTH", weights.astype(v.dtype), v)  # [B, N, T, H]
    return jnp.swapaxes(o, 1, 2)


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
        'jax' (`jax.nn.dot_product_attention`, XLA on CPU/TPU), 'cudnn' (cuDNN
        flash attention driven by the `Mask`'s lengths, GPU, bf16/fp16; calls
        without lengths, i.e. packed rows and one-token decoding steps, use
        'xla': a dense mask would have to be materialized anyway) or 'auto'
        (`resolve_impl`; models pass an implementation resolved beforehand).
      dropout_rate, dropout_rng: dropout on the attention weights ('xla' only).

    Returns:
      [B, T, N, H] in v's dtype. Query rows with no allowed key give zeros.
    """
    structured = mask if isinstance(mask, Mask) else None
    if structured is not None:
        mask = structured.dense
    has_lengths = structured is not None and structured.has_lengths
    impl = resolve_impl(impl, q.dtype, q.shape[-1])
    if impl == "cudnn" and not has_lengths:
        impl = "xla"
    if impl == "xla" or (dropout_rate > 0.0 and dropout_rng is not None):
        weights = attention_weights(q, k, mask)  # [B, N, T, S] float32
        if dropout_rate > 0.0 and dropout_rng is not None:
            keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
            weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
        return jnp.einsum("BNTS,BSNH->BTNH", weights.astype(v.dtype), v)
    if impl not in ("jax", "cudnn"):
        raise ValueError(f"attention impl must be 'auto', 'xla', 'jax' or 'cudnn', got {impl!r}")
    if impl == "cudnn":
        return _fused_attention(q, k, v, structured)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask)
    if mask is None:
        return out
    # jax.nn spreads a fully masked row uniformly over the keys; we return zeros
    # there, like the 'xla' path, so that both implementations agree.
    any_key = jnp.broadcast_to(mask, (*mask.shape[:-1], k.shape[1])).any(axis=-1)  # [B, N|1, T]
    return jnp.where(jnp.swapaxes(any_key, 1, 2)[..., None], out, 0).astype(out.dtype)


# --- cuDNN flash attention by sequence lengths ----------------------------------


def _cudnn_kernel(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> jax.Array:
    """cuDNN flash attention that skips padded (and future) keys by length: no dense mask.

    What it returns at padded query rows (t >= q_length, every row of a length-0
    row) is unspecified, and so are its gradients there: `_fused_attention`
    never lets either reach the model. Tests replace this function with a CPU
    stand-in that writes NaN into exactly those places.
    """
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=mask.causal,
        query_seq_lengths=mask.q_lengths.astype(jnp.int32),
        key_value_seq_lengths=mask.kv_lengths.astype(jnp.int32),
        implementation="cudnn",
    )


def _zero_invalid(x: jax.Array, valid: jax.Array) -> jax.Array:
    """x at valid rows, 0 elsewhere. A select, so NaN at invalid rows does not leak."""
    return jnp.where(valid, x, jnp.zeros((), x.dtype))


def _grad_only_where(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Identity forward; backward passes the cotangent of x at valid rows only (a select).

    The VJP of `where(valid, x, stop_gradient(x))` is `where(valid, g, 0)`, and
    XLA folds the forward select of x with itself away.
    """
    return jnp.where(valid, x, jax.lax.stop_gradient(x))


def _fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: Mask) -> jax.Array:
    """`_cudnn_kernel` made safe at padded rows, in both passes: [B, T, N, H].

    Feed-forward and LayerNorm are per position and later attention gives
    padded keys zero weight, so finite junk in a padded query row never reaches
    a real one. NaN does: the next attention's P @ V multiplies those zero
    weights by it, and backward, a weight gradient dW = sum_t x_t^T dy_t
    multiplies activations at padded positions by their zero cotangents
    (0 * NaN = NaN), poisoning every weight. So padded query rows are set to
    zero here (what the 'xla' path returns there), and the kernel's dq, dk, dv
    at padded rows, whose true value is zero, are replaced by zero too (flash
    kernels may leave them unwritten). A query row also counts as padded when
    its row has no key at all, where the dense reference gives zeros and
    kernels differ. Both selects are elementwise and fuse into neighbours.
    Odd lengths get one more padded position, which cuDNN needs (`_pad_to_even`).
    """
    t = q.shape[1]
    q, k, v = _pad_to_even(q), _pad_to_even(k), _pad_to_even(v)
    t_even, s = q.shape[1], k.shape[1]
    q_len = mask.q_lengths.astype(jnp.int32)  # [B]
    kv_len = mask.kv_lengths.astype(jnp.int32)  # [B]
    q_valid = (jnp.arange(t_even)[None, :] < q_len[:, None]) & (kv_len > 0)[:, None]  # [B, T]
    kv_valid = jnp.arange(s)[None, :] < kv_len[:, None]  # [B, S]
    q_valid = q_valid[:, :, None, None]  # [B, T, 1, 1]
    kv_valid = kv_valid[:, :, None, None]  # [B, S, 1, 1]
    q = _grad_only_where(q, q_valid)
    k = _grad_only_where(k, kv_valid)
    v = _grad_only_where(v, kv_valid)
    return _zero_invalid(_cudnn_kernel(q, k, v, mask), q_valid)[:, :t]


def _pad_to_even(x: jax.Array) -> jax.Array:
    """x [B, T, N, H] with one zero position appended when T is odd: [B, T + T % 2, N, H].

    JAX's cuDNN flash attention takes even sequence lengths only where it will be
    differentiated (`check_is_flash_attention` raises "Unsupported sequence
    length Q 93, KV 93" for bucket length 93, seen with jax 0.11.2 on an H200).
    The appended position lies past every row's length, so the kernel ignores
    it as a key and `_fused_attention` zeroes it as a query, then slices it off.
    """
    if x.shape[1] % 2 == 0:
        return x
    return jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))


# Probe shapes: B = 3 rows (full, partial, empty), lengths off the kernels' 64-token tiles
# and odd, so that the probe also runs the padding cuDNN's training kernels need.
_PROBE_T, _PROBE_S, _PROBE_N = 23, 39, 2


def _probe_case(dtype: jnp.dtype, head_dim: int, causal: bool) -> str | None:
    """Run the fused path forward + backward against 'xla'; a problem, or None if it agrees."""
    t = _PROBE_T
    s = t if causal else _PROBE_S
    q_len = np.array([t, 13, 0], np.int32)
    kv_len = q_len if causal else np.array([s, 7, 0], np.int32)
    dense = (np.arange(t)[None, :, None] < q_len[:, None, None]) & (
        np.arange(s)[None, None, :] < kv_len[:, None, None]
    )  # [B, T, S]
    if causal:
        dense &= np.tril(np.ones((t, s), bool))[None]
    mask = Mask(jnp.asarray(dense[:, None]), jnp.asarray(q_len), jnp.asarray(kv_len), causal)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, t, _PROBE_N, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((3, s, _PROBE_N, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((3, s, _PROBE_N, head_dim)), dtype)
    g = jnp.asarray(rng.standard_normal(q.shape), dtype)

    def run(attend):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(g)

    fused = jax.jit(lambda: run(lambda q, k, v: _fused_attention(q, k, v, mask)))()
    ref = jax.jit(lambda: run(lambda q, k, v: dot_product_attention(q, k, v, mask.dense)))()
    # bf16 rounding moves these O(1) values by ~1e-2; a broken kernel by O(1) or NaN.
    names = ("output", "dq", "dk", "dv")
    for name, a, b in zip(names, jax.tree.leaves(fused), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not np.isfinite(a).all():
            return f"non-finite {name}"
        err, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
        if err > 0.1 * max(1.0, scale):
            return f"{name} differs from 'xla' by {err:.3g} (scale {scale:.3g})"
    return None


@functools.cache
def _cudnn_works(dtype_name: str, head_dim: int) -> bool:
    """Whether cuDNN flash attention by lengths compiles, runs and is right here.

    cuDNN failures can surface at trace, lowering, compile or run time (the
    last two outside any function of ours, e.g. in the caller's jit), so the
    only test is to run it: once per (dtype, head dim), a tiny padded and a
    tiny causal attention with an empty row, forward and backward, compared
    with 'xla'. Models call `resolve_impl` before tracing; a direct call of
    `dot_product_attention(impl='auto')` may come inside a trace, where
    `ensure_compile_time_eval` makes the probe compile and run now, on the
    default device, instead of being staged into the caller's program. On
    failure: one warning, and False.
    """
    dtype = jnp.dtype(dtype_name)
    try:
        with jax.ensure_compile_time_eval():
            problem = _probe_case(dtype, head_dim, False) or _probe_case(dtype, head_dim, True)
    except Exception as e:  # whatever cuDNN, XLA or the driver raise
        # First and last lines: XLA wraps the cause (e.g. a callback's traceback).
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
        text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        problem = f"{type(e).__name__}: {text[:300]}"
    if problem is None:
        return True
    log.warning(
        "cuDNN flash attention failed its probe (%s, head dim %d): %s; "
        "attention_impl='auto' uses 'xla' attention instead",
        dtype_name,
        head_dim,
        problem,
    )
    return False

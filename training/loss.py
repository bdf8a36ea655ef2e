"""The loss over the vocabulary in token chunks: no [B, T, V] logits array, forward or back.

    sums = chunked_loss_sums(y, w, targets, label_smoothing, chunk_tokens=2048)
    # y [B, T, D] final decoder states, w [V, D] output matrix, targets [B, T]
    # -> the same sums as steps.loss_sums(y @ w^T, targets, label_smoothing)

With a 37k vocabulary the float32 logits of a 25k-token batch take 3.5 GB, and
autodiff keeps them for the backward pass next to their float32 and bf16
gradients: for Transformer-big on one H100 these were the largest buffers of
the train step (train.py --compile_for=gpu:h100, docs/aot.md). Here the
positions are cut into K chunks of C, so that a chunk [B, C] holds at most
`chunk_tokens` tokens; every row keeps its place, so a batch sharded over
devices needs no communication. Each chunk's logits [B, C, V] exist only
inside one iteration of a `lax.scan`, which computes the
chunk's loss statistics and, in the same pass, the loss's gradient: with
p = softmax(logits) and q the label-smoothed target distribution, the summed
smoothed cross-entropy has d loss / d logits = p - q at real tokens (0 at
padding), so dy = (p - q) w and dw = (p - q)^T y. The backward pass only scales
those by the incoming cotangent: no logits are recomputed, and the FLOPs are
those of the unchunked forward and backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _loss_stats(logits: jax.Array, targets: jax.Array, label_smoothing: float):
    """Sums (as steps.loss_sums) and d(summed smoothed loss)/d(logits) of one chunk.

    logits [..., V] float32 or bfloat16 (read as float32: every statistic is computed and
    summed in float32), targets [...] (0 = padding) -> (sums, grad [..., V] float32).
    """
    logits = logits.astype(jnp.float32)  # fused into each pass: a bf16 chunk is read as bf16
    vocab = logits.shape[-1]
    real = targets != 0  # [...]
    logits = jnp.where(real[..., None], logits, 0.0)  # select: padding stays finite both ways
    lse = jax.nn.logsumexp(logits, axis=-1)  # [...]
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [...]
    sum_logp = logits.sum(-1) - vocab * lse  # [...]: sum_v log p_v
    on, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    smoothed = (on - off) * nll - off * sum_logp  # [...]
    correct = jnp.argmax(logits, axis=-1) == targets  # [...]
    total = lambda x: jnp.where(real, x, 0.0).sum()
    sums = {
        "loss": total(smoothed),
        "nll": total(nll),
        "correct": total(correct.astype(jnp.float32)),
        "tokens": real.sum(dtype=jnp.float32),
    }
    p = jnp.exp(logits - lse[..., None])  # [..., V]
    q = jnp.where(jnp.arange(vocab) == targets[..., None], on, off)  # [..., V]
    return sums, jnp.where(real[..., None], p - q, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(
    y: jax.Array, w: jax.Array, targets: jax.Array, label_smoothing: float, logits_dtype: jnp.dtype
):
    return _forward(y, w, targets, label_smoothing, logits_dtype)[0]


def _forward(y, w, targets, label_smoothing, logits_dtype):
    """y [K, B, C, D] chunks, w [V, D], targets [K, B, C] -> (sums, (dy, dw [V, D]))."""
    wc = w.astype(y.dtype)  # [V, D] in the compute dtype, as Embed.attend uses it
    # bf16 operands and bf16 logits: the GEMM still accumulates in float32 and rounds once
    # on the way out, and every pass over the chunk then reads half the bytes.
    acc = logits_dtype if y.dtype == logits_dtype else jnp.float32

    def chunk(dw, inputs):
        yc, tc = inputs  # [B, C, D], [B, C]
        # Padding rows to zero (a select): whatever a kernel left there never reaches dw.
        yc = jnp.where((tc != 0)[..., None], yc, jnp.zeros((), yc.dtype))
        logits = jnp.einsum("BCD,VD->BCV", yc, wc, preferred_element_type=acc)  # [B, C, V]
        logits = logits.astype(logits_dtype)
        sums, grad = _loss_stats(logits, tc, label_smoothing)
        grad = grad.astype(y.dtype)  # as every gradient of a bf16 model: bf16 matmuls
        dy = jnp.einsum("BCV,VD->BCD", grad, wc)  # [B, C, D]
        dw = dw + jnp.einsum("BCV,BCD->VD", grad, yc, preferred_element_type=jnp.float32)
        return dw, (sums, dy)

    dw, (sums, dy) = jax.lax.scan(chunk, jnp.zeros(w.shape, jnp.float32), (y, targets))
    sums = jax.tree.map(lambda x: x.sum(0), sums)  # [K] per chunk -> []
    return sums, (dy, dw.astype(w.dtype))


def _backward(label_smoothing, logits_dtype, residuals, cotangent):
    del label_smoothing, logits_dtype
    dy, dw = residuals
    g = cotangent["loss"]  # only the loss is differentiated; the other sums are metrics
    return (g * dy).astype(dy.dtype), (g * dw).astype(dw.dtype), None


_chunked.defvjp(_forward, _backward)


def chunked_loss_sums(
    y: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    label_smoothing: float,
    *,
    chunk_tokens: int,
    logits_dtype: str = "float32",
) -> dict[str, jax.Array]:
    """`steps.loss_sums(logits, targets, label_smoothing)` for logits = y w^T, in chunks.

    Args:
      y: [B, T, D] final decoder states (`Transformer.hidden`), compute dtype.
      w: [V, D] output matrix (`Transformer.output_matrix`), param dtype.
      targets: [B, T] int32, 0 = padding.
      label_smoothing: eps_ls.
      chunk_tokens: most tokens (B x C) per chunk; T is cut into K equal chunks of C
        positions, padded with padding tokens.
      logits_dtype: the chunk's logits as stored between the passes over them: float32,
        or bfloat16 (half the bytes; each logit rounded to 8 bits of mantissa, the
        statistics still float32).
    Returns:
      {loss, nll, correct, tokens} sums, as `loss_sums`; only `loss` carries a gradient.
    """
    b, t, d = y.shape
    ceil = lambda a, b: -(-a // b)
    k = min(t, max(1, ceil(b * t, chunk_tokens)))  # K chunks
    c = ceil(t, k)  # C positions per chunk
    pad = k * c - t
    ys = jnp.pad(y, ((0, 0), (0, pad), (0, 0))).reshape(b, k, c, d).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, k, c).swapaxes(0, 1)  # [K, B, C]
    dtype = jnp.dtype(logits_dtype)
    return _chunked(ys, w, ts, float(label_smoothing), dtype)  # ys: [K, B, C, D]

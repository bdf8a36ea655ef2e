"""The label-smoothed cross-entropy of the paper (section 5.4): over whole logits, or over
the vocabulary in token chunks with no [B, T, V] logits array, forward or back.

    loss = label_smoothed_loss(logits, targets, label_smoothing=0.1)  # [] mean per token
    sums = loss_sums(logits, targets, 0.1)         # {loss, nll, correct, tokens}, summed
    sums = chunked_loss_sums(y, w, targets, label_smoothing, chunk_tokens=2048)
    # y [B, T, D] final decoder states, w [V, D] output matrix, targets [B, T]
    # -> the same sums as loss_sums(y @ w^T, targets, label_smoothing)

With a 37k vocabulary the float32 logits of a 25k-token batch take several GB, and
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


def loss_sums(
    logits: jax.Array, targets: jax.Array, label_smoothing: float
) -> dict[str, jax.Array]:
    """Summed (not averaged) loss statistics over non-padding target tokens.

    Args:
      logits: [B, T, V] float32.
      targets: [B, T] int32, 0 = padding (weight 0).
      label_smoothing: eps_ls; the target gets 1 - eps, every other id eps / (V - 1).
    Returns:
      loss: sum of cross-entropy against the smoothed labels (what is minimized);
      nll: sum of the plain negative log-likelihood (for perplexity);
      correct: number of argmax hits; tokens: number of non-padding targets.
    """
    vocab = logits.shape[-1]
    real = targets != 0  # [B, T]
    # Select, never multiply: a NaN/Inf at a padded position (fused attention kernels
    # may leave garbage in rows they skip) times a zero weight would still be NaN,
    # in the loss and in its gradient. Zeroed logits keep padded rows finite both ways.
    logits = jnp.where(real[..., None], logits.astype(jnp.float32), 0.0)  # [B, T, V]
    # Reductions over V only: log p_v = logits_v - lse is never materialized as a
    # second [B, T, V] array (XLA fuses each reduction into one pass over logits).
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    sum_logp = logits.sum(-1) - vocab * lse  # [B, T]: sum_v log p_v
    on, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    # -sum_v q_v log p_v with q = off everywhere except `on` at the target.
    smoothed = (on - off) * nll - off * sum_logp  # [B, T]
    correct = jnp.argmax(logits, axis=-1) == targets  # [B, T]
    total = lambda x: jnp.where(real, x, 0.0).sum()
    return {
        "loss": total(smoothed),
        "nll": total(nll),
        "correct": total(correct.astype(jnp.float32)),
        "tokens": real.sum(dtype=jnp.float32),
    }


def label_smoothed_loss(
    logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.1
) -> jax.Array:
    """The mean label-smoothed cross-entropy per non-padding target token, what training
    minimizes: logits [B, T, V], targets [B, T] int32 (0 = padding) -> [] float32 (0 for a
    batch of padding only). Label smoothing 0.1 is the paper's (section 5.4)."""
    sums = loss_sums(logits, targets, label_smoothing)
    return sums["loss"] / jnp.maximum(sums["tokens"], 1.0)


def _loss_stats(logits: jax.Array, targets: jax.Array, label_smoothing: float):
    """Sums (as loss_sums) and d(summed smoothed loss)/d(logits) of one chunk.

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
    """`loss_sums(logits, targets, label_smoothing)` for logits = y w^T, in chunks.

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

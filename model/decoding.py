"""Search over the Transformer's outputs: greedy, sampling and beam search (pure, jit-compiled).

    tokens = translate(model, src)                          # [B, S] -> [B, L], beam 4, alpha 0.6
    tokens, scores = beam_search(model, src, beam_size=4)   # [B, K, L], [B, K], best first
    tokens = greedy_search(model, src)                      # [B, L]
    outputs = translate_ids(model, list_of_id_lists)        # any lengths, static shapes

Every search encodes the source once (`Transformer.init_cache` also projects the
cross-attention keys/values of every layer once) and then feeds one token per
step through `Transformer.decode_step`; the whole loop is one
`jax.lax.while_loop` inside one `jax.jit`. The jitted functions live at module
level and take the model as (graphdef, state), so a second call with the same
shapes and static arguments reuses the compiled program.

Output tokens exclude BOS, end with EOS and are 0 (padding) after it; PAD and
BOS are never emitted.

Length limit: by default a source of n tokens may produce at most n + 50 output
tokens (EOS included), and the output array has L = S + 50 columns (S the padded
source width), both capped at `config.max_len`. An explicit `max_decode_len`
sets L and the limit of every row. When a hypothesis reaches its limit, EOS is
forced (as fairseq does), so every returned hypothesis is a complete sentence
and scores are comparable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import BOS_ID, EOS_ID, PAD_ID
from model.transformer import DecodeCache, Transformer

# The paper (section 6.1) decodes with beam 4, length penalty alpha 0.6, and at
# most source length + 50 output tokens.
DEFAULT_BEAM_SIZE = 4
DEFAULT_ALPHA = 0.6
EXTRA_DECODE_LEN = 50

NEG_INF = -jnp.inf


# --- shared pieces ----------------------------------------------------------


def length_penalty(length: jax.Array, alpha: jax.Array | float) -> jax.Array:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016); scores are log P / lp."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def _decode_shape(model: Transformer, src: jax.Array, max_decode_len: int | None):
    """(L, extra): output columns, and per-row extra length (None = every row gets L)."""
    max_len = model.config.max_len
    s = src.shape[1]
    if s > max_len:
        raise ValueError(f"source length {s} exceeds the model's max_len {max_len}")
    if max_decode_len is None:
        return min(s + EXTRA_DECODE_LEN, max_len), EXTRA_DECODE_LEN
    if not 0 < max_decode_len <= max_len:
        raise ValueError(f"max_decode_len must be in [1, {max_len}], got {max_decode_len}")
    return max_decode_len, None


def _row_limits(src: jax.Array, length: int, extra: int | None) -> jax.Array:
    """[B] int32: the most output tokens (EOS included) each row may produce."""
    if extra is None:
        return jnp.full((src.shape[0],), length, jnp.int32)
    n = jnp.sum(src != PAD_ID, axis=1, dtype=jnp.int32)  # [B]
    return jnp.minimum(n + extra, length)


def _restrict(logp: jax.Array, force_eos: jax.Array) -> jax.Array:
    """logp [..., V] -> the same with PAD and BOS banned and, where force_eos [...], all but EOS.

    PAD and BOS never occur inside a target, and a PAD fed back would be masked
    as padding by the full forward pass, so searches never emit them.
    """
    ids = jnp.arange(logp.shape[-1])  # [V]
    banned = (ids == PAD_ID) | (ids == BOS_ID)
    banned = banned | (force_eos[..., None] & (ids != EOS_ID))  # [..., V]
    return jnp.where(banned, NEG_INF, logp)


def _repeat_cache(cache: DecodeCache, k: int) -> DecodeCache:
    """Give each source K beams: every batch-major array [B, ...] -> [B*K, ...].

    Rows b*K .. b*K + K-1 are source b's beams. Cross keys/values are identical
    across a source's beams and never reordered afterwards.
    """
    rep = lambda x: jnp.repeat(x, k, axis=0)  # [B, ...] -> [B*K, ...]
    return cache.replace(
        self_k=tuple(map(rep, cache.self_k)),
        self_v=tuple(map(rep, cache.self_v)),
        cross_k=tuple(map(rep, cache.cross_k)),
        cross_v=tuple(map(rep, cache.cross_v)),
        src_valid=rep(cache.src_valid),
    )


def _split(model: Transformer):
    graphdef, state = nnx.split(model)
    return graphdef, state


# --- greedy search and sampling ---------------------------------------------


class _GreedyState(NamedTuple):
    step: jax.Array  # [] int32, index of the output token produced next
    tokens: jax.Array  # [B, L] int32 output so far, 0 after EOS
    last: jax.Array  # [B] int32, the token fed next (BOS at step 0)
    done: jax.Array  # [B] bool, EOS already produced
    rng: jax.Array  # PRNG key (unused by greedy)
    cache: DecodeCache


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "extra", "top_k", "greedy"))
def _sample_loop(graphdef, state, src, rng, temperature, *, length, extra, top_k, greedy):
    """Greedy (argmax) or ancestral sampling: src [B, S] -> tokens [B, L]."""
    model = nnx.merge(graphdef, state)
    b = src.shape[0]
    limits = _row_limits(src, length, extra)  # [B]
    init = _GreedyState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.zeros((b, length), jnp.int32),
        last=jnp.full((b,), BOS_ID, jnp.int32),
        done=jnp.zeros((b,), bool),
        rng=rng,
        cache=model.init_cache(src, length),
    )

    def cond(s: _GreedyState) -> jax.Array:
        return (s.step < length) & ~jnp.all(s.done)

    def body(s: _GreedyState) -> _GreedyState:
        logits, cache = model.decode_step(s.last, s.cache)  # [B] -> [B, V]
        logits = _restrict(logits, s.step >= limits - 1)
        if greedy:
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
            rng = s.rng
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
                logits = jnp.where(logits < kth, NEG_INF, logits)
            rng, key = jax.random.split(s.rng)
            tok = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)  # [B]
        tok = jnp.where(s.done, PAD_ID, tok)
        tokens = jax.lax.dynamic_update_slice_in_dim(s.tokens, tok[:, None], s.step, axis=1)
        return _GreedyState(s.step + 1, tokens, tok, s.done | (tok == EOS_ID), rng, cache)

    return jax.lax.while_loop(cond, body, init).tokens


def greedy_search(
    model: Transformer, src: jax.Array, *, max_decode_len: int | None = None
) -> jax.Array:
    """Argmax decoding with the KV cache.

    Args:
      model: a Transformer (evaluated deterministically).
      src: [B, S] int32 source ids, 0 = padding.
      max_decode_len: output columns L; default S + 50 (capped at `config.max_len`)
        with a per-row limit of (source length + 50).
    Returns:
      [B, L] int32 tokens: no BOS, EOS-terminated, 0 after EOS.
    """
    src = jnp.asarray(src, jnp.int32)
    length, extra = _decode_shape(model, src, max_decode_len)
    graphdef, state = _split(model)
    return _sample_loop(
        graphdef,
        state,
        src,
        jax.random.key(0),
        jnp.float32(1.0),
        length=length,
        extra=extra,
        top_k=0,
        greedy=True,
    )


def sample(
    model: Transformer,
    src: jax.Array,
    rng: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    max_decode_len: int | None = None,
) -> jax.Array:
    """Ancestral sampling from softmax(logits / temperature), optionally over the top_k tokens.

    Args:
      src: [B, S] int32; rng: a PRNG key; temperature > 0; top_k 0 = the whole vocabulary.
    Returns:
      [B, L] int32 tokens as `greedy_search`.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0 or top_k > model.config.vocab_size:
        raise ValueError(f"top_k must be in [0, vocab_size], got {top_k}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = _decode_shape(model, src, max_decode_len)
    graphdef, state = _split(model)
    return _sample_loop(
        graphdef,
        state,
        src,
        rng,
        jnp.float32(temperature),
        length=length,
        extra=extra,
        top_k=top_k,
        greedy=False,
    )


# --- beam search -------------------------------------------------------------


class _BeamState(NamedTuple):
    step: jax.Array  # [] int32, index of the output token produced next
    live_seqs: jax.Array  # [B, K, L] int32, hypotheses without EOS yet
    live_logp: jax.Array  # [B, K] float32, their log-probabilities (-inf = empty slot)
    fin_seqs: jax.Array  # [B, K, L] int32, EOS-terminated hypotheses, best first
    fin_scores: jax.Array  # [B, K] float32, log P / lp(length) (-inf = empty slot)
    cache: DecodeCache  # batch B*K, row b*K + k is live beam k of source b


def _gather_beams(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, M, ...], idx [B, K] -> [B, K, ...]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))  # [B, K] -> [B, K, 1, ...]
    return jnp.take_along_axis(x, idx, axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "length", "extra", "beam_size"))
def _beam_search(graphdef, state, src, alpha, *, length, extra, beam_size):
    """src [B, S] -> tokens [B, K, L], scores [B, K], best first."""
    model = nnx.merge(graphdef, state)
    b, k = src.shape[0], beam_size
    limits = _row_limits(src, length, extra)  # [B]
    # alpha >= 0 makes lp grow with length, so the best score a live beam can
    # still reach is its log-probability (which only falls) over lp(limit).
    max_lp = length_penalty(limits, alpha)  # [B]
    init = _BeamState(
        step=jnp.zeros((), jnp.int32),
        live_seqs=jnp.zeros((b, k, length), jnp.int32),
        # One live beam at first, so the first step does not pick K copies of it.
        live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
        fin_seqs=jnp.zeros((b, k, length), jnp.int32),
        fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
        cache=_repeat_cache(model.init_cache(src, length), k),
    )

    def row_done(s: _BeamState) -> jax.Array:
        """[B] bool: no live beam can beat the worst of the K finished ones."""
        best_live = jnp.max(s.live_logp, axis=1) / max_lp  # [B]
        return jnp.min(s.fin_scores, axis=1) >= best_live

    def cond(s: _BeamState) -> jax.Array:
        return (s.step < length) & ~jnp.all(row_done(s))

    def body(s: _BeamState) -> _BeamState:
        t = s.step
        prev_col = jax.lax.dynamic_index_in_dim(s.live_seqs, jnp.maximum(t - 1, 0), 2, False)
        prev = jnp.where(t == 0, BOS_ID, prev_col)  # [B, K]
        logits, cache = model.decode_step(prev.reshape(b * k), s.cache)  # [B*K] -> [B*K, V]
        v = logits.shape[-1]
        logp = jax.nn.log_softmax(logits).reshape(b, k, v)  # [B*K, V] -> [B, K, V]
        logp = _restrict(logp, jnp.broadcast_to((t >= limits - 1)[:, None], (b, k)))
        cand = (s.live_logp[:, :, None] + logp).reshape(b, k * v)  # [B, K, V] -> [B, K*V]
        # 2K candidates: at most K of them end in EOS, so K stay alive.
        top_logp, top_idx = jax.lax.top_k(cand, 2 * k)  # [B, 2K]
        top_beam, top_tok = top_idx // v, top_idx % v  # [B, 2K]
        top_seqs = _gather_beams(s.live_seqs, top_beam)  # [B, K, L] -> [B, 2K, L]
        top_seqs = jax.lax.dynamic_update_slice_in_dim(
            top_seqs, top_tok[:, :, None].astype(jnp.int32), t, axis=2
        )
        is_eos = top_tok == EOS_ID  # [B, 2K]

        # Live: the K best candidates that did not end.
        live_logp, live_pos = jax.lax.top_k(jnp.where(is_eos, NEG_INF, top_logp), k)  # [B, K]
        live_seqs = _gather_beams(top_seqs, live_pos)  # [B, 2K, L] -> [B, K, L]
        origin = jnp.take_along_axis(top_beam, live_pos, axis=1)  # [B, K] previous beam
        rows = (jnp.arange(b)[:, None] * k + origin).reshape(b * k)  # [B, K] -> [B*K]
        # Only the self-attention cache depends on the beam's history.
        cache = cache.replace(
            self_k=tuple(jnp.take(x, rows, axis=0) for x in cache.self_k),
            self_v=tuple(jnp.take(x, rows, axis=0) for x in cache.self_v),
        )

        # Finished: an EOS candidate counts only if it ranks among the K best (as in
        # fairseq), so beam size 1 with alpha 0 is exactly greedy search. Merge the
        # new ones with the K kept so far.
        in_beam = jnp.arange(2 * k) < k  # [2K]
        new_scores = top_logp / length_penalty(t + 1, alpha)  # [B, 2K]
        new_scores = jnp.where(is_eos & in_beam, new_scores, NEG_INF)
        all_scores = jnp.concatenate([s.fin_scores, new_scores], axis=1)  # [B, 3K]
        all_seqs = jnp.concatenate([s.fin_seqs, top_seqs], axis=1)  # [B, 3K, L]
        fin_scores, fin_pos = jax.lax.top_k(all_scores, k)  # [B, K]
        fin_seqs = _gather_beams(all_seqs, fin_pos)  # [B, 3K, L] -> [B, K, L]
        return _BeamState(t + 1, live_seqs, live_logp, fin_seqs, fin_scores, cache)

    s = jax.lax.while_loop(cond, body, init)
    # Forced EOS at each row's limit means every surviving hypothesis has finished;
    # slots that never held one (fewer than K distinct hypotheses) are all padding.
    tokens = jnp.where(jnp.isfinite(s.fin_scores)[:, :, None], s.fin_seqs, PAD_ID)
    return tokens, s.fin_scores


def beam_search(
    model: Transformer,
    src: jax.Array,
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    max_decode_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with GNMT length penalty and early stopping (paper: K=4, alpha=0.6).

    A source stops early once none of its live beams can beat the worst of its
    K finished hypotheses; the loop ends when every source has stopped.

    Args:
      model: a Transformer (evaluated deterministically).
      src: [B, S] int32 source ids, 0 = padding; rows may have different lengths.
      beam_size: K >= 1.
      alpha: length penalty exponent >= 0 (0 = raw log-probability).
      max_decode_len: output columns L (see `greedy_search`).
    Returns:
      tokens [B, K, L] int32 (no BOS, EOS-terminated, 0 after EOS) and scores
      [B, K] float32 = log P / ((5 + len) / 6)^alpha with len counting EOS,
      both sorted best first. A slot that never held a hypothesis has score -inf.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if beam_size > model.config.vocab_size // 2:
        raise ValueError(f"beam_size {beam_size} too large for vocab {model.config.vocab_size}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = _decode_shape(model, src, max_decode_len)
    graphdef, state = _split(model)
    return _beam_search(
        graphdef,
        state,
        src,
        jnp.float32(alpha),
        length=length,
        extra=extra,
        beam_size=beam_size,
    )


def translate(
    model: Transformer,
    src: jax.Array,
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    max_decode_len: int | None = None,
) -> jax.Array:
    """The best translation of each source: [B, S] -> [B, L] int32 (beam_size 1 = greedy).

    Tokens exclude BOS, end with EOS and are 0 after it; `Tokenizer.decode` reads them.
    """
    if beam_size == 1:
        return greedy_search(model, src, max_decode_len=max_decode_len)
    tokens, _ = beam_search(
        model, src, beam_size=beam_size, alpha=alpha, max_decode_len=max_decode_len
    )
    return tokens[:, 0]  # [B, K, L] -> [B, L]


# --- many sources of different lengths: static shapes ---------------------------

# Padded source widths. A file of any size compiles at most one program per
# (width, batch rows) pair actually used: a handful, not one per batch.
LENGTH_BUCKETS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_BATCH_ROWS = 8


def bucket_width(n: int, max_len: int) -> int:
    """The padded width for a source of n tokens: the smallest bucket >= n, at most max_len."""
    for width in LENGTH_BUCKETS:
        if width >= n:
            return min(width, max_len)
    return max_len


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def plan_batches(
    lengths: Sequence[int], *, batch_tokens: int, max_len: int
) -> list[tuple[np.ndarray, int, int]]:
    """Group sources into batches of static shape; longest first.

    Args:
      lengths: tokens per source (EOS included); all in [1, max_len].
      batch_tokens: budget of padded source tokens per batch (rows * width).
      max_len: the model's longest position.
    Returns:
      (indices into `lengths`, width S, rows B) per batch, with len(indices) <= B.
      Full batches have B = the largest power of two with B * S <= batch_tokens;
      a bucket's last batch is padded up to a power of two (at least 8), so each
      bucket compiles at most a few batch sizes.
    """
    lengths = np.asarray(lengths, np.int64)
    widths = np.array([bucket_width(int(n), max_len) for n in lengths], np.int64)
    # Stable sort by decreasing length keeps equal-length sources in input order.
    order = np.argsort(-lengths, kind="stable")
    batches = []
    for width in sorted(set(widths.tolist()), reverse=True):
        idx = order[widths[order] == width]
        full = _pow2_floor(batch_tokens // width)
        for start in range(0, len(idx), full):
            chunk = idx[start : start + full]
            rows = min(full, max(MIN_BATCH_ROWS, 1 << (len(chunk) - 1).bit_length()))
            batches.append((chunk, width, rows))
    return batches


def translate_ids(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    batch_tokens: int = 4096,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Translate token-id sources of any lengths, in batches of static shape.

    Args:
      sources: id lists as the model was trained on (EOS-terminated), each at most
        `config.max_len` long; an empty list gives an empty translation without
        running the model.
      batch_tokens: padded source tokens per batch (beam search holds K times as many).
      progress: called after each batch with (sentences, output tokens) it finished.
    Returns:
      output ids per source, in input order, without BOS/EOS/padding.
    """
    max_len = model.config.max_len
    too_long = [i for i, s in enumerate(sources) if len(s) > max_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} source(s) exceed max_len {max_len} (first: #{too_long[0]})"
        )
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    lengths = [len(sources[i]) for i in nonempty]
    results: list[list[int]] = [[] for _ in sources]

    def finish(pending):
        tokens, chunk = pending
        tokens = np.asarray(tokens)  # waits for the device
        count = 0
        for row, j in zip(tokens, chunk, strict=False):
            row = row.tolist()
            row = row[: row.index(EOS_ID)] if EOS_ID in row else row
            results[nonempty[j]] = [t for t in row if t != PAD_ID]
            count += len(row) + 1
        if progress is not None:
            progress(len(chunk), count)

    pending = None
    for chunk, width, rows in plan_batches(lengths, batch_tokens=batch_tokens, max_len=max_len):
        # Filler rows hold a lone EOS: a valid, cheap source whose output is dropped.
        src = np.zeros((rows, width), np.int32)  # [B, S]
        src[len(chunk) :, 0] = EOS_ID
        for r, j in enumerate(chunk):
            ids = sources[nonempty[j]]
            src[r, : len(ids)] = ids
        tokens = translate(model, src, beam_size=beam_size, alpha=alpha)
        # Dispatch is asynchronous: the next batch is queued before this one is read.
        if pending is not None:
            finish(pending)
        pending = (tokens, chunk)
    if pending is not None:
        finish(pending)
    return results

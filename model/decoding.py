"""Search over the Transformer's outputs: greedy, sampling and beam search (pure, jit-compiled).

    tokens = translate(model, src)                          # [B, S] -> [B, L], beam 4, alpha 0.6
    tokens, scores = beam_search(model, src, beam_size=4)   # [B, K, L], [B, K], best first
    tokens = greedy_search(model, src)                      # [B, L]

(Many sources of different lengths, batched into static shapes: inference/translate.py.)

Every search encodes the source once (`Transformer.init_cache` also projects the
cross-attention keys/values of every layer once) and then feeds one token per
step through `Transformer.decode_step`, which returns the updated `DecodeCache`
with the logits; the whole loop is one `jax.lax.while_loop` inside one
`jax.jit`. Beam search keeps K hypotheses per source in one batch of B*K rows
(rows b*K .. b*K + K-1 are source b's): `DecodeCache.repeat` makes those rows
and `DecodeCache.reorder` makes each surviving beam carry on the cache of the
beam it extends. The jitted functions live at module level and take the model
as (graphdef, state), so a second call with the same shapes and static
arguments reuses the compiled program.

Output tokens exclude BOS, end with EOS and are 0 (padding) after it; PAD and
BOS are never emitted, nor ids >= `vocab_limit` when one is given (a tokenizer
with fewer pieces than the model's vocabulary never produced them in training).

Length limit: by default a source of n tokens may produce at most n + 50 output
tokens (EOS included), and the output array has L = S + 50 columns (S the padded
source width), both capped at `config.max_len`. An explicit `max_decode_len`
sets L and the limit of every row. When a hypothesis reaches its limit, EOS is
forced (as fairseq does), so every returned hypothesis is a complete sentence
and scores are comparable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.tokens import BOS_ID, EOS_ID, PAD_ID
from model.transformer import DecodeCache, Transformer

# The paper (section 6.1) decodes with beam 4, length penalty alpha 0.6, and at
# most source length + 50 output tokens.
DEFAULT_BEAM_SIZE = 4
DEFAULT_ALPHA = 0.6
EXTRA_DECODE_LEN = 50
# How scores are normalized by length: "gnmt" (the default, as the paper's setup) or
# "average" (CTranslate2's and OpenNMT's; see `length_penalty`).
LENGTH_PENALTIES = ("gnmt", "average")
DEFAULT_LENGTH_PENALTY = "gnmt"

NEG_INF = -jnp.inf


# --- shared pieces ----------------------------------------------------------


def length_penalty(
    length: jax.Array, alpha: jax.Array | float, kind: str = DEFAULT_LENGTH_PENALTY
) -> jax.Array:
    """lp(Y), by which scores are log P(Y) / lp(Y); `length` = |Y|, EOS included.

    gnmt: ((5 + |Y|) / 6)^alpha (Wu et al., 2016).
    average: (|Y| - 1)^alpha, the tokens without EOS to the alpha, as CTranslate2
      and OpenNMT rank (alpha 1: the mean log-probability per token). A hypothesis
      of EOS alone scores -inf for alpha > 0, as there.
    Both grow with |Y| for alpha >= 0, so the best score a live beam can still
    reach is its log-probability over lp(its length limit).
    """
    length = jnp.asarray(length, jnp.float32)
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "average":
        return jnp.maximum(length - 1.0, 0.0) ** alpha
    raise ValueError(f"length penalty must be one of {LENGTH_PENALTIES}, got {kind!r}")


def normalized_score(
    logp: jax.Array, length: jax.Array, alpha: jax.Array | float, kind: str = DEFAULT_LENGTH_PENALTY
) -> jax.Array:
    """log P / lp(length), what searches rank by; -inf where lp is 0 (never NaN)."""
    lp = length_penalty(length, alpha, kind)
    return jnp.where(lp > 0, logp / jnp.where(lp > 0, lp, 1.0), NEG_INF)


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


def _restrict(logp: jax.Array, force_eos: jax.Array, vocab_limit: int | None) -> jax.Array:
    """logp [..., V] -> the same with PAD, BOS and ids >= vocab_limit banned and, where
    force_eos [...], all but EOS.

    PAD and BOS never occur inside a target, and a PAD fed back would be masked
    as padding by the full forward pass, so searches never emit them.
    """
    ids = jnp.arange(logp.shape[-1])  # [V]
    banned = (ids == PAD_ID) | (ids == BOS_ID)
    if vocab_limit is not None:
        banned = banned | (ids >= vocab_limit)
    banned = banned | (force_eos[..., None] & (ids != EOS_ID))  # [..., V]
    return jnp.where(banned, NEG_INF, logp)


# --- greedy search and sampling ---------------------------------------------


class _GreedyState(NamedTuple):
    step: jax.Array  # [] int32, index of the output token produced next
    tokens: jax.Array  # [B, L] int32 output so far, 0 after EOS
    last: jax.Array  # [B] int32, the token fed next (BOS at step 0)
    done: jax.Array  # [B] bool, EOS already produced
    logp: jax.Array  # [B] float32, log-probability of the tokens so far
    rng: jax.Array  # PRNG key (unused by greedy)
    cache: DecodeCache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "length", "extra", "top_k", "greedy", "vocab_limit")
)
def _sample_loop(
    graphdef, state, src, rng, temperature, *, length, extra, top_k, greedy, vocab_limit
):
    """Greedy (argmax) or ancestral sampling: src [B, S] -> tokens [B, L], log P [B]."""
    model = nnx.merge(graphdef, state)
    b = src.shape[0]
    limits = _row_limits(src, length, extra)  # [B]
    init = _GreedyState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.zeros((b, length), jnp.int32),
        last=jnp.full((b,), BOS_ID, jnp.int32),
        done=jnp.zeros((b,), bool),
        logp=jnp.zeros((b,), jnp.float32),
        rng=rng,
        cache=model.init_cache(src, length),
    )

    def cond(s: _GreedyState) -> jax.Array:
        return (s.step < length) & ~jnp.all(s.done)

    def body(s: _GreedyState) -> _GreedyState:
        logits, cache = model.decode_step(s.last, s.cache)  # [B] -> [B, V]
        # Scored as beam search scores: log-softmax over the whole vocabulary.
        logp = jax.nn.log_softmax(logits)  # [B, V]
        logits = _restrict(logits, s.step >= limits - 1, vocab_limit)
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
        tok_logp = jnp.take_along_axis(logp, tok[:, None], axis=1)[:, 0]  # [B]
        logp_sum = s.logp + jnp.where(s.done, 0.0, tok_logp)
        tok = jnp.where(s.done, PAD_ID, tok)
        tokens = jax.lax.dynamic_update_slice_in_dim(s.tokens, tok[:, None], s.step, axis=1)
        done = s.done | (tok == EOS_ID)
        return _GreedyState(s.step + 1, tokens, tok, done, logp_sum, rng, cache)

    out = jax.lax.while_loop(cond, body, init)
    return out.tokens, out.logp


def greedy_search(
    model: Transformer,
    src: jax.Array,
    *,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    return_logprob: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Argmax decoding with the KV cache.

    Args:
      model: a Transformer (evaluated deterministically).
      src: [B, S] int32 source ids, 0 = padding.
      max_decode_len: output columns L; default S + 50 (capped at `config.max_len`)
        with a per-row limit of (source length + 50).
      vocab_limit: never emit ids >= this (None = the whole vocabulary).
      return_logprob: also return each output's log-probability.
    Returns:
      [B, L] int32 tokens: no BOS, EOS-terminated, 0 after EOS; with
      `return_logprob`, also [B] float32 log P(tokens | src), EOS included.
    """
    src = jnp.asarray(src, jnp.int32)
    length, extra = _decode_shape(model, src, max_decode_len)
    graphdef, state = nnx.split(model)
    tokens, logp = _sample_loop(
        graphdef,
        state,
        src,
        jax.random.key(0),
        jnp.float32(1.0),
        length=length,
        extra=extra,
        top_k=0,
        greedy=True,
        vocab_limit=vocab_limit,
    )
    return (tokens, logp) if return_logprob else tokens


def sample(
    model: Transformer,
    src: jax.Array,
    rng: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
) -> jax.Array:
    """Ancestral sampling from softmax(logits / temperature), optionally over the top_k tokens.

    Args:
      src: [B, S] int32; rng: a PRNG key; temperature > 0; top_k 0 = the whole vocabulary.
      max_decode_len, vocab_limit: as for `greedy_search`.
    Returns:
      [B, L] int32 tokens as `greedy_search`.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0 or top_k > model.config.vocab_size:
        raise ValueError(f"top_k must be in [0, vocab_size], got {top_k}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = _decode_shape(model, src, max_decode_len)
    graphdef, state = nnx.split(model)
    tokens, _ = _sample_loop(
        graphdef,
        state,
        src,
        rng,
        jnp.float32(temperature),
        length=length,
        extra=extra,
        top_k=top_k,
        greedy=False,
        vocab_limit=vocab_limit,
    )
    return tokens


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


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "length", "extra", "beam_size", "vocab_limit", "penalty"),
)
def _beam_search(graphdef, state, src, alpha, *, length, extra, beam_size, vocab_limit, penalty):
    """src [B, S] -> tokens [B, K, L], scores [B, K], best first."""
    model = nnx.merge(graphdef, state)
    b, k = src.shape[0], beam_size
    limits = _row_limits(src, length, extra)  # [B]
    init = _BeamState(
        step=jnp.zeros((), jnp.int32),
        live_seqs=jnp.zeros((b, k, length), jnp.int32),
        # [K] -> [B, K]: one live beam at first, so the first step does not pick K copies of it.
        live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
        fin_seqs=jnp.zeros((b, k, length), jnp.int32),
        fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
        cache=model.init_cache(src, length).repeat(k),  # [B, ...] -> [B*K, ...]
    )

    def row_done(s: _BeamState) -> jax.Array:
        """[B] bool: no live beam can beat the worst of the K finished ones."""
        # alpha >= 0 makes lp grow with length, so the best score a live beam can
        # still reach is its log-probability (which only falls) over lp(limit).
        best_live = normalized_score(jnp.max(s.live_logp, axis=1), limits, alpha, penalty)  # [B]
        return jnp.min(s.fin_scores, axis=1) >= best_live

    def cond(s: _BeamState) -> jax.Array:
        return (s.step < length) & ~jnp.all(row_done(s))

    def body(s: _BeamState) -> _BeamState:
        t = s.step
        # [B, K, L] -> [B, K]: the token each beam fed last (column t-1; BOS at t = 0).
        prev_col = jax.lax.dynamic_index_in_dim(s.live_seqs, jnp.maximum(t - 1, 0), 2, False)
        prev = jnp.where(t == 0, BOS_ID, prev_col)  # [B, K]
        prev = prev.reshape(b * k)  # [B, K] -> [B*K]
        logits, cache = model.decode_step(prev, s.cache)  # [B*K] -> [B*K, V]
        v = logits.shape[-1]
        logp = jax.nn.log_softmax(logits).reshape(b, k, v)  # [B*K, V] -> [B, K, V]
        force_eos = jnp.broadcast_to((t >= limits - 1)[:, None], (b, k))  # [B] -> [B, K]
        logp = _restrict(logp, force_eos, vocab_limit)
        cand = (s.live_logp[:, :, None] + logp).reshape(b, k * v)  # [B, K, V] -> [B, K*V]
        # 2K candidates: at most K of them end in EOS, so K stay alive.
        top_logp, top_idx = jax.lax.top_k(cand, 2 * k)  # [B, 2K]
        top_beam, top_tok = top_idx // v, top_idx % v  # [B, 2K]
        top_seqs = _gather_beams(s.live_seqs, top_beam)  # [B, K, L] -> [B, 2K, L]
        top_seqs = jax.lax.dynamic_update_slice_in_dim(
            top_seqs, top_tok[:, :, None].astype(jnp.int32), t, axis=2
        )  # [B, 2K, 1] written at column t of [B, 2K, L]
        is_eos = top_tok == EOS_ID  # [B, 2K]

        # Live: the K best candidates that did not end.
        live_logp, live_pos = jax.lax.top_k(jnp.where(is_eos, NEG_INF, top_logp), k)  # [B, K]
        live_seqs = _gather_beams(top_seqs, live_pos)  # [B, 2K, L] -> [B, K, L]
        origin = jnp.take_along_axis(top_beam, live_pos, axis=1)  # [B, K] previous beam
        rows = (jnp.arange(b)[:, None] * k + origin).reshape(b * k)  # [B, K] -> [B*K]
        # Each live beam continues the self-attention cache of the beam it extends.
        cache = cache.reorder(rows)  # [B*K, L, N, H] per layer, rows gathered

        # Finished: an EOS candidate counts only if it ranks among the K best (as in
        # fairseq), so beam size 1 with alpha 0 is exactly greedy search. Merge the
        # new ones with the K kept so far.
        in_beam = jnp.arange(2 * k) < k  # [2K]
        new_scores = normalized_score(top_logp, t + 1, alpha, penalty)  # [B, 2K]
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
    vocab_limit: int | None = None,
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with a length penalty and early stopping (paper: K=4, alpha=0.6, GNMT's).

    A source stops early once none of its live beams can beat the worst of its
    K finished hypotheses; the loop ends when every source has stopped.

    Args:
      model: a Transformer (evaluated deterministically).
      src: [B, S] int32 source ids, 0 = padding; rows may have different lengths.
      beam_size: K >= 1.
      alpha: length penalty exponent >= 0 (0 = raw log-probability).
      max_decode_len: output columns L (see `greedy_search`).
      vocab_limit: never emit ids >= this (None = the whole vocabulary).
      length_penalty: "gnmt" or "average" (see `length_penalty`).
    Returns:
      tokens [B, K, L] int32 (no BOS, EOS-terminated, 0 after EOS) and scores
      [B, K] float32 = log P / lp(len) (gnmt: ((5 + len) / 6)^alpha, len counting
      EOS), both sorted best first. A slot that never held a hypothesis has score -inf.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    vocab = vocab_limit or model.config.vocab_size
    if beam_size > vocab // 2:
        raise ValueError(f"beam_size {beam_size} too large for a vocabulary of {vocab}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if length_penalty not in LENGTH_PENALTIES:
        raise ValueError(
            f"length_penalty must be one of {LENGTH_PENALTIES}, got {length_penalty!r}"
        )
    src = jnp.asarray(src, jnp.int32)
    length, extra = _decode_shape(model, src, max_decode_len)
    graphdef, state = nnx.split(model)
    return _beam_search(
        graphdef,
        state,
        src,
        jnp.float32(alpha),
        length=length,
        extra=extra,
        beam_size=beam_size,
        vocab_limit=vocab_limit,
        penalty=length_penalty,
    )


def translate(
    model: Transformer,
    src: jax.Array,
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
) -> jax.Array:
    """The best translation of each source: [B, S] -> [B, L] int32 (beam_size 1 = greedy).

    Tokens exclude BOS, end with EOS and are 0 after it; `Tokenizer.decode` reads them.
    """
    if beam_size == 1:
        return greedy_search(model, src, max_decode_len=max_decode_len, vocab_limit=vocab_limit)
    tokens, _ = beam_search(
        model,
        src,
        beam_size=beam_size,
        alpha=alpha,
        max_decode_len=max_decode_len,
        vocab_limit=vocab_limit,
        length_penalty=length_penalty,
    )
    return tokens[:, 0]  # [B, K, L] -> [B, L]

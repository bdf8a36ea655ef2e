"""Greedy search and ancestral sampling over any decoder's step function (pure; jit-compiled
by its caller).

    tokens = greedy_search(step_fn, cache, length=20)              # [B, 20]
    tokens = sample(step_fn, cache, jax.random.key(0), length=20)  # [B, 20]

One row a source: each step feeds every row its last token (BOS first) through
`step_fn(tokens [B], cache) -> (logits [B, V], cache)` and appends the argmax, or a
draw from softmax(logits / temperature) over the `top_k` best, until every row has
produced EOS or its limit. The Transformer's own, compiled per batch shape, are
search/decoding.py's `translate_greedy` and `translate_sample`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from attention_jax.search.beam import StepFn, uniform_limits
from attention_jax.search.scoring import NEG_INF, restrict
from attention_jax.search.settings import DEFAULTS
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID


class _State(NamedTuple):
    step: jax.Array  # [] int32, index of the output token produced next
    tokens: jax.Array  # [B, L] int32 output so far, 0 after EOS
    last: jax.Array  # [B] int32, the token fed next (BOS at step 0)
    done: jax.Array  # [B] bool, EOS already produced
    logp: jax.Array  # [B] float32, log-probability of the tokens so far
    rng: jax.Array  # PRNG key (unused by greedy)
    cache: Any


def sample_loop(
    step_fn: StepFn,
    cache: Any,
    limits: jax.Array | None,
    length: int,
    rng: jax.Array,
    temperature: jax.Array | float = 1.0,
    *,
    greedy: bool,
    top_k: int = 0,
    vocab_limit: int | None = None,
    min_length: int = DEFAULTS.min_length,
) -> tuple[jax.Array, jax.Array]:
    """Greedy (argmax) or ancestral sampling: tokens [B, L] and their log P [B], EOS included
    (scored as beam search scores: log-softmax over the whole vocabulary).

    cache: the decoder's, one row a source, room for `length` tokens; limits [B] int32:
    the most tokens (EOS included) each row may produce (the last one is EOS; None: L)."""
    limits = uniform_limits(cache, length) if limits is None else jnp.asarray(limits, jnp.int32)
    b = limits.shape[0]
    init = _State(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.zeros((b, length), jnp.int32),
        last=jnp.full((b,), BOS_ID, jnp.int32),
        done=jnp.zeros((b,), bool),
        logp=jnp.zeros((b,), jnp.float32),
        rng=rng,
        cache=cache,
    )

    def cond(s: _State) -> jax.Array:
        return (s.step < length) & ~jnp.all(s.done)

    def body(s: _State) -> _State:
        logits, cache = step_fn(s.last, s.cache)  # [B] -> [B, V]
        logp = jax.nn.log_softmax(logits)  # [B, V]
        logits = restrict(logits, s.step >= limits - 1, vocab_limit, s.step < min_length)
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
        return _State(s.step + 1, tokens, tok, done, logp_sum, rng, cache)

    out = jax.lax.while_loop(cond, body, init)
    return out.tokens, out.logp


def _check(min_length: int, temperature: float = 1.0, top_k: int = 0) -> None:
    if min_length < 0:
        raise ValueError(f"min_length must be >= 0, got {min_length}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")


def greedy_search(
    step_fn: StepFn,
    cache: Any,
    *,
    length: int,
    limits: jax.Array | None = None,
    vocab_limit: int | None = None,
    min_length: int = DEFAULTS.min_length,
    return_logprob: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Argmax decoding: each row's most likely next token, until EOS.

    Args:
      step_fn: (tokens [B], cache) -> (logits or log-probabilities [B, V], cache).
      cache: the decoder's cache for B rows (leaves with the rows on axis 0), with
        room for `length` tokens.
      length: output columns L.
      limits: [B] int32, the most tokens (EOS included) each row may produce; None: L.
      vocab_limit: never emit ids >= this (None = the whole vocabulary).
      min_length: EOS is banned at output positions below this (the limit wins).
      return_logprob: also return each output's log-probability.
    Returns:
      [B, L] int32 tokens: no BOS, EOS-terminated, 0 after EOS; with `return_logprob`,
      also [B] float32 log P(tokens), EOS included.
    """
    _check(min_length)
    tokens, logp = sample_loop(
        step_fn,
        cache,
        limits,
        length,
        jax.random.key(0),
        greedy=True,
        vocab_limit=vocab_limit,
        min_length=min_length,
    )
    return (tokens, logp) if return_logprob else tokens


def sample(
    step_fn: StepFn,
    cache: Any,
    rng: jax.Array,
    *,
    length: int,
    limits: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    vocab_limit: int | None = None,
    min_length: int = DEFAULTS.min_length,
) -> jax.Array:
    """Ancestral sampling from softmax(logits / temperature), optionally over the top_k tokens.

    Args:
      rng: a PRNG key; temperature > 0; top_k 0 = the whole vocabulary.
      step_fn, cache, length, limits, vocab_limit, min_length: as for `greedy_search`.
    Returns:
      [B, L] int32 tokens as `greedy_search`.
    """
    _check(min_length, temperature, top_k)
    tokens, _ = sample_loop(
        step_fn,
        cache,
        limits,
        length,
        rng,
        jnp.float32(temperature),
        greedy=False,
        top_k=top_k,
        vocab_limit=vocab_limit,
        min_length=min_length,
    )
    return tokens

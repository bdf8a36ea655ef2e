"""Search over the Transformer's outputs: greedy, sampling and beam search (pure, jit-compiled).

    tokens = translate(model, src)                          # [B, S] -> [B, L], beam 4, alpha 0.6
    tokens, scores = beam_search(model, src, beam_size=4)   # [B, K, L], [B, K], best first
    tokens = greedy_search(model, src)                      # [B, L]

(Many sources of different lengths, batched into static shapes: search/translate.py.)

Every search encodes the source once (`Transformer.init_cache` also projects the
cross-attention keys/values of every layer once) and then feeds one token per
step through `Transformer.decode_step`, which returns the updated `DecodeCache`
with the logits; the whole search is one `jax.jit` (a `jax.lax.while_loop`;
for a large beam search, a loop per stage of growing room: search/beam.py
`search`). Beam search keeps K hypotheses per source in one batch of B*K rows
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
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from attention_jax.search import beam
from attention_jax.search.constraints import Controls
from attention_jax.search.defaults import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_MIN_LENGTH,
    DEFAULT_STOP,
    EXTRA_DECODE_LEN,
    LENGTH_PENALTIES,
)
from attention_jax.search.scoring import (
    NEG_INF,
    decode_shape,
    length_penalty,
    normalized_score,
    restrict,
    row_limits,
)
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID
from attention_jax.transformer import DecodeCache, Transformer

# The defaults (search/defaults.py) and scoring names (search/scoring.py) are search.decoding's too.
__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_BEAM_SIZE",
    "DEFAULT_LENGTH_PENALTY",
    "DEFAULT_MIN_LENGTH",
    "EXTRA_DECODE_LEN",
    "LENGTH_PENALTIES",
    "beam_search",
    "greedy_search",
    "length_penalty",
    "normalized_score",
    "sample",
    "translate",
]

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
    jax.jit,
    static_argnames=("graphdef", "length", "extra", "top_k", "greedy", "vocab_limit", "min_length"),
)
def _sample_loop(
    graphdef, state, src, rng, temperature, *, length, extra, top_k, greedy, vocab_limit, min_length
):
    """Greedy (argmax) or ancestral sampling: src [B, S] -> tokens [B, L], log P [B]."""
    model = nnx.merge(graphdef, state)
    b = src.shape[0]
    limits = row_limits(src, length, extra)  # [B]
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
        return _GreedyState(s.step + 1, tokens, tok, done, logp_sum, rng, cache)

    out = jax.lax.while_loop(cond, body, init)
    return out.tokens, out.logp


def greedy_search(
    model: Transformer,
    src: jax.Array,
    *,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    min_length: int = DEFAULT_MIN_LENGTH,
    return_logprob: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Argmax decoding with the KV cache.

    Args:
      model: a Transformer (evaluated deterministically).
      src: [B, S] int32 source ids, 0 = padding.
      max_decode_len: output columns L; default S + 50 (capped at `config.max_len`)
        with a per-row limit of (source length + 50).
      vocab_limit: never emit ids >= this (None = the whole vocabulary).
      min_length: EOS is banned at output positions below this (1: no empty output;
        the length limit wins).
      return_logprob: also return each output's log-probability.
    Returns:
      [B, L] int32 tokens: no BOS, EOS-terminated, 0 after EOS; with
      `return_logprob`, also [B] float32 log P(tokens | src), EOS included.
    """
    if min_length < 0:
        raise ValueError(f"min_length must be >= 0, got {min_length}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = decode_shape(model, src, max_decode_len)
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
        min_length=min_length,
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
    min_length: int = DEFAULT_MIN_LENGTH,
) -> jax.Array:
    """Ancestral sampling from softmax(logits / temperature), optionally over the top_k tokens.

    Args:
      src: [B, S] int32; rng: a PRNG key; temperature > 0; top_k 0 = the whole vocabulary.
      max_decode_len, vocab_limit, min_length: as for `greedy_search`.
    Returns:
      [B, L] int32 tokens as `greedy_search`.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0 or top_k > model.config.vocab_size:
        raise ValueError(f"top_k must be in [0, vocab_size], got {top_k}")
    if min_length < 0:
        raise ValueError(f"min_length must be >= 0, got {min_length}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = decode_shape(model, src, max_decode_len)
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
        min_length=min_length,
    )
    return tokens


# --- beam search -------------------------------------------------------------


def beam_search(
    model: Transformer,
    src: jax.Array,
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
    stop: str = DEFAULT_STOP,
    steps_per_check: int | None = None,
    min_length: int = DEFAULT_MIN_LENGTH,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
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
      stop: "bound" (exact: however long a live beam grows, it cannot win) or
        "heuristic" (it would not win if it ended at the next step: about half the
        steps; search/beam.py `Rule`).
      steps_per_check: steps between tests of the stopping condition (the same
        results for any value); None = the platform's (search/beam.py `steps_per_check`).
      min_length: EOS is banned at output positions below this (see `greedy_search`);
        with a prefix, below the prefix's length plus this.
      prefixes: per source, the tokens its output must start with (forced; they count
        in the length, not in the score: the search ranks what follows them).
      constraints: per source, the phrases (token lists) its output must contain
        (search/constraints.py: dynamic beam allocation; EOS only once all are met).
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
    src = jnp.asarray(src, jnp.int32)
    length, extra = decode_shape(model, src, max_decode_len)
    per = beam.steps_per_check() if steps_per_check is None else steps_per_check
    rule = beam.Rule(  # checks the stop rule and the length penalty
        beam_size,
        stop=stop,
        penalty=length_penalty,
        vocab_limit=vocab_limit,
        steps_per_check=per,
        min_length=min_length,
    )
    args = dict(alpha=alpha, rule=rule, length=length, extra=extra)
    if prefixes is None and constraints is None:
        return beam.search(model, src, **args)
    controls = Controls.of(
        prefixes or [],
        constraints or [],
        rows=src.shape[0],
        prefix_len=max((len(p) for p in prefixes or []), default=0),
        max_phrases=max((len(c) for c in constraints or []), default=0),
        max_tokens=max((len(p) for c in constraints or [] for p in c), default=0),
    )
    tokens, scores, _ = beam.search(model, src, controls=controls, **args)
    return tokens, scores


def translate(
    model: Transformer,
    src: jax.Array,
    *,
    beam_size: int = DEFAULT_BEAM_SIZE,
    alpha: float = DEFAULT_ALPHA,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
    stop: str = DEFAULT_STOP,
    steps_per_check: int | None = None,
    min_length: int = DEFAULT_MIN_LENGTH,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
) -> jax.Array:
    """The best translation of each source: [B, S] -> [B, L] int32 (beam_size 1 = greedy;
    with prefixes or constraints, beam search's, as `beam_search` takes them).

    Tokens exclude BOS, end with EOS and are 0 after it; `Tokenizer.decode` reads them.
    """
    if beam_size == 1 and prefixes is None and constraints is None:
        return greedy_search(
            model,
            src,
            max_decode_len=max_decode_len,
            vocab_limit=vocab_limit,
            min_length=min_length,
        )
    tokens, _ = beam_search(
        model,
        src,
        beam_size=beam_size,
        alpha=alpha,
        max_decode_len=max_decode_len,
        vocab_limit=vocab_limit,
        length_penalty=length_penalty,
        stop="count" if beam_size == 1 else stop,
        steps_per_check=steps_per_check,
        min_length=min_length,
        prefixes=prefixes,
        constraints=constraints,
    )
    return tokens[:, 0]  # [B, K, L] -> [B, L]

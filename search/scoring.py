"""How searches score, limit and restrict hypotheses: shared by greedy, sampling and beam search.

score = normalized_score(logp, length, alpha, "gnmt")   # log P / lp(length)
limits = row_limits(src, length=82, extra=50)          # [B]: a source of n tokens, n + 50
room = prefix_room(source_tokens=9, max_len=82)        # 58: a prefix of at most n + 49 tokens
rooms(width=32, length=82)                              # [48, 82]: a batch's stages
logp = restrict(logp, force_eos, vocab_limit)           # never PAD/BOS; EOS at the limit
values, index = top_k(x, k)                             # jax.lax.top_k, in two levels
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attention_jax.search.settings import DEFAULTS, EXTRA_DECODE_LEN, LENGTH_PENALTIES
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID

NEG_INF = -jnp.inf
# The first stage's room, beyond the batch's source width: most sources are done by
# then (docs/searching.md).
FIRST_EXTRA = 16


def length_penalty(
    length: jax.Array, alpha: jax.Array | float, kind: str = DEFAULTS.length_penalty
) -> jax.Array:
    """lp(Y), by which scores are log P(Y) / lp(Y); `length` = |Y|, EOS included.

    gnmt: ((5 + |Y|) / 6)^alpha (Wu et al., 2016).
    average: |Y|^alpha, EOS counted, as CTranslate2 ranks (its returned scores are
      log P(Y) / |Y|^alpha with P(Y) including EOS's probability; alpha 1: the
      mean log-probability per token, EOS included).
    Both grow with |Y| for alpha >= 0, so the best score a live beam can still
    reach is its log-probability over lp(its length limit).
    """
    length = jnp.asarray(length, jnp.float32)
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if kind == "average":
        return length**alpha
    raise ValueError(f"length penalty must be one of {LENGTH_PENALTIES}, got {kind!r}")


def normalized_score(
    logp: jax.Array,
    length: jax.Array,
    alpha: jax.Array | float,
    kind: str = DEFAULTS.length_penalty,
) -> jax.Array:
    """log P / lp(length), what searches rank by; -inf where lp is 0 (never NaN)."""
    lp = length_penalty(length, alpha, kind)
    return jnp.where(lp > 0, logp / jnp.where(lp > 0, lp, 1.0), NEG_INF)


def output_limit(source_tokens: int, max_len: int) -> int:
    """The most output tokens (EOS included) a source of `source_tokens` tokens (EOS
    included) may produce: source length + 50 (paper 6.1), at most max_len."""
    return min(source_tokens + EXTRA_DECODE_LEN, max_len)


def prefix_room(source_tokens: int, max_len: int) -> int:
    """The most tokens a prefix of a source of `source_tokens` tokens (EOS included) may
    have: its output's limit (`output_limit`) less one, for EOS."""
    return output_limit(source_tokens, max_len) - 1


# A row that only fills a batch up to its static shape: two EOS, which no real source
# starts with (a source is its tokens then one EOS). It encodes like a one-token
# source, and its search is finished at once, so it never keeps a batch stepping.
FILLER = (EOS_ID, EOS_ID)


def row_limits(src: jax.Array, length: int, extra: int | None) -> jax.Array:
    """[B] int32: the most output tokens (EOS included) each row may produce; 0 for a
    filler row (`FILLER`: it is finished before the first step)."""
    if extra is None:
        limits = jnp.full((src.shape[0],), length, jnp.int32)
    else:
        n = jnp.sum(src != PAD_ID, axis=1, dtype=jnp.int32)  # [B]
        limits = jnp.minimum(n + extra, length)
    if src.shape[1] < len(FILLER):
        return limits
    filler = jnp.all(src[:, : len(FILLER)] == jnp.array(FILLER, src.dtype), axis=1)  # [B]
    return jnp.where(filler, 0, limits)


def restrict(
    logp: jax.Array,
    force_eos: jax.Array,
    vocab_limit: int | None,
    ban_eos: jax.Array | bool = False,
) -> jax.Array:
    """logp [..., V] -> the same with PAD, BOS and ids >= vocab_limit banned; where
    force_eos [...], all but EOS; else, where ban_eos [...] (e.g. before the minimum
    length), EOS.

    PAD and BOS never occur inside a target, and a PAD fed back would be masked
    as padding by the full forward pass, so searches never emit them. The length
    limit wins over the minimum length, so that every hypothesis ends.
    """
    ids = jnp.arange(logp.shape[-1])  # [V]
    banned = (ids == PAD_ID) | (ids == BOS_ID)
    if vocab_limit is not None:
        banned = banned | (ids >= vocab_limit)
    force = force_eos[..., None]  # [..., 1]
    ban = (jnp.asarray(ban_eos)[..., None] & ~force) & (ids == EOS_ID)  # [..., V]
    banned = banned | (force & (ids != EOS_ID)) | ban
    return jnp.where(banned, NEG_INF, logp)


def rooms(width: int, length: int) -> list[int]:
    """Tokens a batch of source width `width` has room for, stage by stage, when its
    sources may produce at most `length` (search/beam.py): width + 16, doubled, up to length."""
    out = [min(width + FIRST_EXTRA, length)]
    while out[-1] < length:
        out.append(min(2 * out[-1], length))
    return out


def top_k(x: jax.Array, k: int, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over x [B, M] in two levels: the same values and indices.

    XLA's CPU top-k sorts its way through all M entries of a row (K*V: 16,000 for
    the tiny model at beam 4), about as slow as the output projection. Here the
    row is cut into chunks of `chunk`; the k chunks with the largest maxima (ties:
    the earlier chunk) hold the k largest entries (ties: the earlier index), and
    only they, in their original order, go through the exact top-k. Both levels
    pick their k by `passes_top_k`, which sorts nothing.
    """
    b, m = x.shape
    if m < 8 * chunk:
        return passes_top_k(x, k)
    pad = (-m) % chunk
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=NEG_INF)
    chunks = x.reshape(b, -1, chunk)  # [B, M] -> [B, M/chunk, chunk]
    _, picked = passes_top_k(chunks.max(axis=-1), k)  # [B, k] chunk indices
    picked = jnp.sort(picked, axis=1)  # original order, so that ties go to the earlier index
    near = jnp.take_along_axis(chunks, picked[:, :, None], axis=1)  # [B, k, chunk]
    values, pos = passes_top_k(near.reshape(b, k * chunk), k)  # [B, k]
    index = jnp.take_along_axis(picked, pos // chunk, axis=1) * chunk + pos % chunk
    return values, index


def passes_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over x [B, M] (k <= M) in k passes, each taking the largest
    entry not yet taken (ties, -inf ones too: the lowest index): the same values and
    indices, without the sort that XLA lowers top-k to on a CPU (for the small k of a
    beam, a few reductions over the row cost less)."""
    b, m = x.shape
    ids = jnp.arange(m, dtype=jnp.int32)  # [M]

    def take(i: jax.Array, carry: tuple) -> tuple:
        taken, values, indices = carry
        free = jnp.where(taken, NEG_INF, x)
        best = jnp.max(free, axis=1)  # [B]
        first = jnp.min(jnp.where((free == best[:, None]) & ~taken, ids, m), axis=1)  # [B]
        first = jnp.minimum(first, m - 1)  # a row of NaN: any index
        taken = taken | (ids == first[:, None])
        return taken, values.at[:, i].set(best), indices.at[:, i].set(first)

    # A loop, not k copies: the same work, and one copy for XLA to compile.
    start = (jnp.zeros(x.shape, bool), jnp.zeros((b, k), x.dtype), jnp.zeros((b, k), jnp.int32))
    _, values, indices = jax.lax.fori_loop(0, k, take, start)
    return values, indices  # [B, k], [B, k]

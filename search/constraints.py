"""Target prefixes and terminology constraints inside the beam search (pure, jit-compiled).

    controls = Controls.of(prefixes, phrases, rows=B, prefix_len=P, max_phrases=C,
                           max_tokens=T)                       # on the host, numpy
    tokens, scores, met = decoding.search_batch(..., controls=controls)   # met [B, n, C] bool

A source may come with a prefix its translation must start with and with phrases its
translation must contain. Both travel as fixed-size arrays in the search's state
(`Controls`), so a job compiles one program per shape, whatever its lines hold:

- the prefix's tokens are forced, one a step, and do not count in a hypothesis's
  score, only in its length (CTranslate2's `target_prefix`: the search ranks the
  continuation); at the first step after it only the best candidate may end (as
  CTranslate2 does: a short ending among the others would often win);
- each live hypothesis tracks, per phrase, how many of its tokens it has produced
  (`progress`, a Knuth-Morris-Pratt matcher, so "a a b" is found in "a a a b"); a
  phrase is met once its progress reaches its length, for good;
- every step, besides the model's 2K best extensions, each live hypothesis proposes
  the next token of each phrase it has not met; the K live hypotheses are picked
  from all of them by dynamic beam allocation (Post & Vilar, 2018; vectorized as
  Hu et al., 2019, and fairseq's `--constraints`): candidates are grouped by how
  many constraint tokens they have produced (`bank`), and the banks take turns,
  the fullest first, each giving its next best candidate, until K are picked;
- EOS is allowed only once every phrase is met, or at the length limit, where a
  hypothesis ends whatever it has met (and says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.search.scoring import NEG_INF


class Controls(NamedTuple):
    """Per source (a pytree of arrays; B sources). P = 0 or C = 0: none of that kind."""

    prefix: jax.Array  # [B, P] int32, forced first tokens, 0-padded
    phrases: jax.Array  # [B, C, T] int32, the tokens of each phrase, 0-padded
    fail: jax.Array  # [B, C, T] int32, their failure tables (`failure_table`)

    @property
    def lengths(self) -> jax.Array:
        """[B, C] int32: each phrase's length (0: an empty slot, met from the start)."""
        return jnp.sum(self.phrases != 0, axis=-1, dtype=jnp.int32)

    @classmethod
    def none(cls, rows: Any) -> Controls:
        """No prefix and no phrases for `rows` sources (a symbolic count too: an export)."""
        empty = jnp.zeros((rows, 0, 0), jnp.int32)
        return cls(jnp.zeros((rows, 0), jnp.int32), empty, empty)

    @classmethod
    def of(
        cls,
        prefixes: Sequence[Sequence[int]],
        phrases: Sequence[Sequence[Sequence[int]]],
        *,
        rows: int,
        prefix_len: int,
        max_phrases: int,
        max_tokens: int,
    ) -> Controls:
        """numpy arrays of the given sizes: prefixes[i] and phrases[i] (lists of token
        lists) of source i (fewer than `rows`: the rest have none). ValueError for a
        prefix or a phrase too long, too many phrases, or an empty phrase."""
        prefix = np.zeros((rows, prefix_len), np.int32)
        for i, p in enumerate(prefixes):
            if len(p) > prefix_len:
                raise ValueError(f"a prefix of {len(p)} tokens: at most {prefix_len} here")
            prefix[i, : len(p)] = p
        table = np.zeros((rows, max_phrases, max_tokens), np.int32)
        for i, found in enumerate(phrases):
            if len(found) > max_phrases:
                raise ValueError(f"{len(found)} constraints: at most {max_phrases} a line")
            for c, phrase in enumerate(found):
                if not 0 < len(phrase) <= max_tokens:
                    raise ValueError(f"a constraint of {len(phrase)} tokens: 1 to {max_tokens}")
                table[i, c, : len(phrase)] = phrase
        fail = np.apply_along_axis(failure_table, -1, table) if table.size else table.copy()
        return cls(prefix, table, fail.astype(np.int32))

    @classmethod
    def fitted(
        cls,
        prefixes: Sequence[Sequence[int]],
        phrases: Sequence[Sequence[Sequence[int]]],
        *,
        rows: int,
    ) -> Controls:
        """`of`, sized to fit the longest prefix, the most phrases and the longest phrase."""
        return cls.of(
            prefixes,
            phrases,
            rows=rows,
            prefix_len=max((len(p) for p in prefixes), default=0),
            max_phrases=max((len(c) for c in phrases), default=0),
            max_tokens=max((len(p) for c in phrases for p in c), default=0),
        )


def failure_table(phrase: np.ndarray) -> np.ndarray:
    """[T] -> [T]: fail[j], for j tokens matched, is the length of the longest proper
    prefix of phrase[:j] that is also its suffix (Knuth-Morris-Pratt); 0 for j <= 1."""
    t = len(phrase)
    fail, k = np.zeros(t, np.int32), 0
    for j in range(2, t):
        while k > 0 and phrase[k] != phrase[j - 1]:
            k = fail[k]
        if phrase[k] == phrase[j - 1]:
            k += 1
        fail[j] = k
    return fail


def advance(
    progress: jax.Array, token: jax.Array, phrases: jax.Array, fail: jax.Array
) -> jax.Array:
    """Progress after one more token: progress [..., C] int32, token [...] int32, phrases
    and fail [..., C, T] (broadcast against progress). A met phrase stays met."""
    lengths = jnp.sum(phrases != 0, axis=-1)  # [..., C]
    tok = token[..., None]  # [...] -> [..., 1]

    def at(j: jax.Array) -> jax.Array:  # [..., C]: phrase token j (the last one for j = T)
        j = jnp.minimum(j, phrases.shape[-1] - 1)[..., None]
        return jnp.take_along_axis(phrases, j, -1)[..., 0]

    j = progress
    for _ in range(phrases.shape[-1]):  # fall back along the failure links
        mismatch = (j > 0) & (j < lengths) & (at(j) != tok)
        j = jnp.where(mismatch, jnp.take_along_axis(fail, j[..., None], -1)[..., 0], j)
    matched = jnp.where(at(j) == tok, j + 1, 0)
    return jnp.where(progress >= lengths, lengths, matched)


def candidates(
    top: tuple[jax.Array, jax.Array, jax.Array],
    live_logp: jax.Array,
    logp: jax.Array,
    progress: jax.Array,
    phrases: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The candidates of a constrained step: (log P, beam, token), each [B, M].

    top: the model's 2K best extensions over all live beams (log P, beam, token
    [B, 2K]); then, per live beam, the next token of each phrase it has not met, and
    its own best token (so a beam that met its phrases, outscored by others, goes on
    or ends). live_logp [B, K], logp [B, K, V] (restricted), progress [B, K, Q],
    phrases [B, Q, T]. A (beam, token) seen earlier in the list is -inf.
    """
    b, k, q = progress.shape
    v = logp.shape[-1]
    lengths = jnp.sum(phrases != 0, axis=-1)[:, None, :]  # [B, 1, Q]
    idx = jnp.minimum(progress, phrases.shape[-1] - 1)[..., None]  # [B, K, Q, 1]
    nxt = jnp.take_along_axis(phrases[:, None], idx, -1)[..., 0]  # [B, K, Q]
    nxt_logp = live_logp[:, :, None] + jnp.take_along_axis(logp, nxt, axis=-1)  # [B, K, Q]
    nxt_logp = jnp.where(progress < lengths, nxt_logp, NEG_INF)
    best = jnp.argmax(logp, axis=-1)  # [B, K]
    best_logp = live_logp + jnp.max(logp, axis=-1)  # [B, K]
    beams = jnp.broadcast_to(jnp.arange(k)[None, :, None], (b, k, q))
    score = jnp.concatenate([top[0], nxt_logp.reshape(b, -1), best_logp], 1)  # [B, M]
    beam = jnp.concatenate([top[1], beams.reshape(b, -1), jnp.tile(jnp.arange(k), (b, 1))], 1)
    token = jnp.concatenate([top[2], nxt.reshape(b, -1), best], 1).astype(jnp.int32)
    key = beam * v + token  # [B, M]
    m = key.shape[1]
    earlier = jnp.tril(jnp.ones((m, m), bool), -1)  # [M, M]: j (last axis) before i
    repeated = jnp.any((key[:, :, None] == key[:, None, :]) & earlier, axis=-1)  # [B, M]
    return jnp.where(repeated, NEG_INF, score), beam, token


def allocation_order(score: jax.Array, bank: jax.Array) -> jax.Array:
    """Dynamic beam allocation: each candidate's place [B, M] int32 (0 first) among score
    [B, M] (-inf: not a candidate, last) and bank [B, M] (constraint tokens produced):
    the banks take turns, the fullest first, each giving its next best."""
    m = score.shape[1]
    valid = jnp.isfinite(score)
    order = jnp.arange(m)
    better = (score[:, None, :] > score[:, :, None]) | (
        (score[:, None, :] == score[:, :, None]) & (order[None, :] < order[:, None])
    )  # [B, M, M]: j (last axis) ranks before i in i's bank
    same = (bank[:, None, :] == bank[:, :, None]) & valid[:, None, :]
    rank = jnp.sum(better & same, axis=-1)  # [B, M] place in its bank
    most = jnp.max(jnp.where(valid, bank, 0)) + 1
    turn = jnp.where(valid, rank * most + (most - 1 - bank), jnp.iinfo(jnp.int32).max)
    first = jnp.argsort(turn, axis=1, stable=True)  # [B, M] candidates, first place first
    return jnp.argsort(first, axis=1).astype(jnp.int32)  # each candidate's place

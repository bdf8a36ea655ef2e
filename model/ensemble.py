"""Several Transformers that decode as one: an ensemble.

    ensemble = Ensemble([model_a, model_b])        # one vocabulary; other sizes may differ
    logits = ensemble(src, tgt_in)                 # [B, S], [B, T] -> [B, T, V]
    cache = ensemble.init_cache(src, max_decode_len=L)
    logits, cache = ensemble.decode_step(tokens, cache)   # [R] -> [R, V]

At each position the ensemble's distribution is the members' log-probabilities
averaged and normalized again (a log-linear ensemble, as Marian's and OpenNMT-py's
average log-probabilities): log_softmax(mean_m log p_m). Each log p_m is its logits
less one constant per row, so that is log_softmax(mean_m logits_m), and the ensemble's
"logits" are the mean of its members' logits: a search or a score over them takes
the softmax as over one model's. An ensemble of a model with itself is that model, to
the bit.

An `Ensemble` has the part of a Transformer's interface that the searches and the
scoring use (`config`, `__call__`, `init_cache`, `decode_step`, and a cache that
repeats, reorders, grows and selects its rows), so greedy and beam search, n-best,
prefixes, constraints and scoring take one as they take a Transformer. Its config
is its first member's, with the shortest `max_len` of them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx, struct

from attention_jax.config import TransformerConfig
from attention_jax.decode_cache import DecodeCache
from attention_jax.transformer import Transformer


@struct.dataclass
class EnsembleCache:
    """The members' `DecodeCache`s, one each, moved together (search/beam.py `BeamCache`)."""

    members: tuple[DecodeCache, ...]

    @property
    def max_length(self) -> int:
        return self.members[0].max_length

    @property
    def index(self) -> jax.Array:
        return self.members[0].index

    def repeat(self, k: int) -> EnsembleCache:
        return EnsembleCache(tuple(c.repeat(k) for c in self.members))

    def grow(self, capacity: int) -> EnsembleCache:
        return EnsembleCache(tuple(c.grow(capacity) for c in self.members))

    def reorder(self, rows: jax.Array) -> EnsembleCache:
        return EnsembleCache(tuple(c.reorder(rows) for c in self.members))

    def map_rows(self, fn: Callable[[jax.Array], jax.Array]) -> EnsembleCache:
        return EnsembleCache(tuple(c.map_rows(fn) for c in self.members))

    def select(self, sources: jax.Array, k: int) -> EnsembleCache:
        return EnsembleCache(tuple(c.select(sources, k) for c in self.members))

    def take_over(self, b: jax.Array, queue: EnsembleCache, i: jax.Array) -> EnsembleCache:
        pairs = zip(self.members, queue.members, strict=True)
        return EnsembleCache(tuple(c.take_over(b, q, i) for c, q in pairs))


class Ensemble(nnx.Module):
    """Transformers of one vocabulary decoding as one (see the module docstring).

    Raises ValueError for no member, or members of different vocabulary sizes.
    """

    def __init__(self, members: Sequence[Transformer]):
        if not members:
            raise ValueError("an ensemble needs at least one model")
        sizes = [m.config.vocab_size for m in members]
        if len(set(sizes)) > 1:
            raise ValueError(f"the models of an ensemble share a vocabulary; their sizes: {sizes}")
        self.members = nnx.List(list(members))
        max_len = min(m.config.max_len for m in members)
        self.config: TransformerConfig = dataclasses.replace(members[0].config, max_len=max_len)

    def __call__(self, src: jax.Array, tgt_in: jax.Array, *, deterministic: bool = True):
        """src [B, S], tgt_in [B, T] int32 -> the mean of the members' logits [B, T, V]."""
        return _mean([m(src, tgt_in, deterministic=deterministic) for m in self.members])

    def decode_output(self) -> tuple[jax.Array, ...]:
        """Each member's output projection as decoding reads it (`Transformer.decode_output`)."""
        return tuple(m.decode_output() for m in self.members)

    def init_cache(
        self, src: jax.Array, max_decode_len: int, *, output: tuple[jax.Array, ...] | None = None
    ) -> EnsembleCache:
        """Each member's cache of src [B, S], room for `max_decode_len` tokens (output:
        `decode_output()`, made once for many searches; default: made here)."""
        outputs = output or (None,) * len(self.members)
        pairs = zip(self.members, outputs, strict=True)
        return EnsembleCache(tuple(m.init_cache(src, max_decode_len, output=o) for m, o in pairs))

    def decode_step(
        self, tokens: jax.Array, cache: EnsembleCache
    ) -> tuple[jax.Array, EnsembleCache]:
        """tokens [R] -> the mean of the members' next-token logits [R, V], every cache
        one position on."""
        steps = [m.decode_step(tokens, c) for m, c in zip(self.members, cache.members, strict=True)]
        return _mean([logits for logits, _ in steps]), EnsembleCache(tuple(c for _, c in steps))


def _mean(logits: list[jax.Array]) -> jax.Array:
    """The members' logits averaged in float32 (exact for copies of one: (x + x) / 2 = x)."""
    return sum(x.astype(jnp.float32) for x in logits) / len(logits)

"""What incremental decoding carries from one step to the next: `DecodeCache`, the
Transformer's keys and values (model/transformer.py `init_cache`, `decode_step`) with
the row operations the searches need (search/beam.py `BeamCache`, search/pool.py).

    cache = model.init_cache(src, max_decode_len=L)   # [B] sources, room for L tokens
    cache = cache.repeat(4)                           # [B*4] rows: 4 beams a source
    cache = cache.reorder(rows)                       # row r <- row rows[r]
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from attention_jax.layers import KVCache


@struct.dataclass
class DecodeCache:
    """Everything incremental decoding carries from one step to the next (a pytree).

    self_kv: per decoder layer, keys/values [R, N, L, H] (heads first: the layout
      decoding attention reads; L = the capacity), a ring: the token fed at step g
      is in slot g mod L.
    cross_kv: per decoder layer, the encoder output's keys/values [B, N, S, H],
      computed once per source.
    src_valid: [B, S] bool, False on source padding.
    index: [] int32, the step g of the next token to be fed (every row's).
    start: [B] int32, the step at which each source's first token was fed: a source
      that takes over a finished one's rows (search/pool.py) starts later. A row
      attends over its own source's tokens alone, at positions index - start, so at
      most L of them.
    output: the output projection [D, V] in the compute dtype (a tied embedding is
      [V, D]), laid out once per search or once for a job's searches
      (`Transformer.decode_output`): every step's few rows are multiplied by it, and
      XLA:CPU's dot reads [D, V] faster at a few rows. Searches running side by side
      that share one copy leave more of the processor's cache to the rest.

    R = B, or B*K when each source has K beams (`repeat`): rows b*K .. b*K + K-1
    are source b's, and share its cross-attention keys/values.
    """

    self_kv: tuple[KVCache, ...]
    cross_kv: tuple[KVCache, ...]
    src_valid: jax.Array
    index: jax.Array
    start: jax.Array
    output: jax.Array

    @property
    def max_length(self) -> int:
        """The self-attention capacity L: tokens that can be fed before `grow`."""
        return self.self_kv[0].k.shape[2]

    def map_rows(self, fn: Callable[[jax.Array], jax.Array]) -> DecodeCache:
        """fn applied to each array that holds a row per beam: the self-attention caches
        [R, N, L, H]. Only they depend on a hypothesis's history; the cross keys/values
        and the source mask are the same for all of a source's beams."""
        return self.replace(self_kv=jax.tree.map(fn, self.self_kv))

    def repeat(self, k: int) -> DecodeCache:
        """Give each source k beams: the self-attention caches [B, ...] -> [B*k, ...].

        Rows b*k .. b*k + k-1 are source b's beams, all equal to source b's row; the
        cross-attention keys/values and the source mask stay one per source.
        """
        return self.map_rows(lambda x: jnp.repeat(x, k, axis=0))  # [B, ...] -> [B*k, ...]

    def grow(self, capacity: int) -> DecodeCache:
        """Room for `capacity` tokens: self-attention caches [R, N, L, H] -> [R, N, capacity, H]
        (new slots zero, hidden by the mask until written)."""
        extra = capacity - self.max_length
        if extra < 0:
            raise ValueError(f"cannot shrink a cache of {self.max_length} to {capacity}")
        return self.map_rows(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0))))

    def reorder(self, rows: jax.Array) -> DecodeCache:
        """Row r of the new self-attention caches is row rows[r] of the old: rows [B*K] int
        (within each source's block of beams: the cross-attention is one per source)."""
        return self.map_rows(lambda x: jnp.take(x, rows, axis=0))  # [B*K, N, L, H]

    def select(self, sources: jax.Array, k: int) -> DecodeCache:
        """The cache of the sources `sources` [B'] (indices) alone, with their k beams each:
        cross-attention and the source mask [B, ...] -> [B', ...], self-attention
        [B*k, ...] -> [B'*k, ...] (a batch whose other sources are finished goes on in
        fewer rows)."""
        rows = (sources[:, None] * k + jnp.arange(k)).reshape(-1)  # [B', k] -> [B'*k]
        by_source = lambda x: jnp.take(x, sources, axis=0)
        return self.reorder(rows).replace(
            cross_kv=jax.tree.map(by_source, self.cross_kv),
            src_valid=by_source(self.src_valid),
            start=by_source(self.start),
        )

    def take_over(self, b: jax.Array, queue: DecodeCache, i: jax.Array) -> DecodeCache:
        """Source slot b [] int32 holds source i [] of `queue` (another cache, e.g. of
        room 1) from the next step on: its cross keys/values and source mask; its rows'
        self-attention slots need no clearing, the mask hides what came before `index`."""
        take = lambda x, q: jax.lax.dynamic_update_index_in_dim(x, q[i], b, 0)
        return self.replace(
            cross_kv=jax.tree.map(take, self.cross_kv, queue.cross_kv),
            src_valid=take(self.src_valid, queue.src_valid),
            start=jax.lax.dynamic_update_index_in_dim(self.start, self.index, b, 0),
        )

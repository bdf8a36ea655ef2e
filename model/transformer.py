"""The encoder-decoder Transformer (paper section 3), with an explicit KV cache for decoding.

    model = Transformer(TransformerConfig(vocab_size=8000), rngs=nnx.Rngs(0))
    logits = model(src, tgt_in)                       # [B, S], [B, T] -> [B, T, V]
    y = model.hidden(src, tgt_in)                     # the same up to the output: [B, T, D]
    cache = model.init_cache(src, max_decode_len=L)   # encode once; room for L tokens
    logits, cache = model.decode_step(tokens, cache)  # [B] -> [B, V], one position on
    weights = model.cross_attention_weights(src, tgt_in)  # [L_dec, B, N, T, S]

Token id 0 is padding everywhere. For packed rows (several pairs in one row)
pass segment ids (1, 2, ... per pair, 0 on padding) and per-pair positions.

`decode`, `decode_step` and `cross_attention_weights` all run the decoder
stack through one loop, `_decoder_stack`, which threads each layer's KV cache
in and out (no state is captured) and rematerializes layers when `config.remat`.
Its `DecodeCache` (model/decode_cache.py) is a pytree of per-layer `KVCache`s with the
batch operations beam search needs (`repeat`, `reorder`, `grow`, `select`, `map_rows`,
`take_over`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_jax.attention import (
    Mask,
    resolve_config,
    source_mask,
    target_mask,
    target_source_mask,
)
from attention_jax.config import TransformerConfig
from attention_jax.decode_cache import DecodeCache
from attention_jax.layers import DecoderLayer, Embed, EncoderLayer, KVCache, LayerNorm, Unembed
from attention_jax.precision import einsum_f32
from attention_jax.sharding import EMBED, VOCAB
from attention_jax.tokens import BOS_ID, PAD_ID


@functools.lru_cache(maxsize=64)  # a few lengths a model: the widths and rooms it runs
def _position_table(length: int, d_model: int, halves: bool = False) -> np.ndarray:
    # Imported here, not at the top: `python -m attention_jax.positional` (the picture of
    # the table) then runs a module that `import model` has not loaded already.
    from attention_jax.positional import sinusoidal_positions

    return sinusoidal_positions(length, d_model, halves)


class Transformer(nnx.Module):
    """Encoder-decoder Transformer; see the module docstring for the calling convention."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        # attention_impl='auto' becomes 'cudnn' or 'xla' here, once (a probe on GPUs),
        # so that the traced model never decides; training resolves it even earlier.
        cfg = self.config = resolve_config(config)
        self.src_embed = Embed(cfg, rngs=rngs)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else Embed(cfg, rngs=rngs)
        self.unembed = None if cfg.tie_output else Unembed(cfg, rngs=rngs)
        self.embed_dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
        self.encoder_layers = nnx.List(
            [EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_encoder_layers)]
        )
        self.decoder_layers = nnx.List(
            [DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_decoder_layers)]
        )
        # Pre-LN leaves the residual stream unnormalized, so it ends with a LayerNorm.
        pre = cfg.norm == "pre"
        self.encoder_norm = LayerNorm(cfg, rngs=rngs) if pre else None
        self.decoder_norm = LayerNorm(cfg, rngs=rngs) if pre else None
        # Marian's options (model/config.py): a trained position table [max_len, D], a
        # bias on the logits [V]; None without them. The table starts as the paper's sinusoids.
        self.position_table = (
            nnx.Param(
                jnp.asarray(_position_table(cfg.max_len, cfg.d_model), cfg.param_dtype),
                logical_axes=(None, EMBED),
            )
            if cfg.positions == "table"
            else None
        )
        self.logits_bias = (
            nnx.Param(jnp.zeros((cfg.vocab_size,), cfg.param_dtype), logical_axes=(VOCAB,))
            if cfg.logits_bias
            else None
        )

    # --- pieces -----------------------------------------------------------

    def position_table_values(self, length: int | None = None) -> jax.Array:
        """[length, D] (default: max_len), what each position adds to its embedding, in the
        compute dtype: a program holds (as constants) only the sinusoid rows it reaches."""
        cfg = self.config
        length = cfg.max_len if length is None else min(length, cfg.max_len)
        if self.position_table is not None:
            return self.position_table[:length].astype(cfg.dtype)
        halves = cfg.positions == "sinusoid_halves"
        return jnp.asarray(_position_table(length, cfg.d_model, halves), cfg.dtype)

    def _start(self, tgt_in: jax.Array, rows: jax.Array) -> jax.Array:
        """The target's embedding rows [B, T, D]; with `zero_start`, BOS's are zeros."""
        if not self.config.zero_start:
            return rows
        return jnp.where((tgt_in == BOS_ID)[..., None], jnp.zeros((), rows.dtype), rows)

    def _embed(self, rows: jax.Array, positions, deterministic: bool) -> jax.Array:
        """Looked-up rows embedding * sqrt(D) [B, T, D] -> dropout(rows + PE) [B, T, D]."""
        if positions is None:
            pe = self.position_table_values(rows.shape[1])[None]  # [1, T, D]
        else:
            pe = jnp.take(self.position_table_values(), positions, axis=0)  # [B, T, D]
        return self.embed_dropout(rows + pe, deterministic=deterministic)

    def _lookup_both(self, src: jax.Array, tgt_in: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Embedding rows of src [B, S] and tgt_in [B, T]: [B, S, D], [B, T, D].

        A shared table is read in one lookup over [B, S + T] ids, so its gradient is
        one scatter-add whose rows stay on the batch's devices. Two lookups give two
        scatter-adds that XLA merges over indices concatenated along the batch, which
        its SPMD partitioner then reshuffles with all-to-alls (6 per data-parallel
        TPU step, and a 256-chip compile that did not finish; docs/aot.md).
        """
        if self.tgt_embed is not self.src_embed:
            return self.src_embed(src), self.tgt_embed(tgt_in)
        rows = self.src_embed(jnp.concatenate([src, tgt_in], axis=1))  # [B, S + T, D]
        return rows[:, : src.shape[1]], rows[:, src.shape[1] :]

    def _final(self, y: jax.Array) -> jax.Array:
        """The decoder stack's output [.., D] -> the states the output projection reads."""
        return self.decoder_norm(y) if self.decoder_norm is not None else y

    def project(self, y: jax.Array) -> jax.Array:
        """Final decoder states [B, T, D] (from `hidden`) -> logits [B, T, V] float32."""
        logits = self.unembed(y) if self.unembed is not None else self.tgt_embed.attend(y)
        return self._biased(logits)

    def _biased(self, logits: jax.Array) -> jax.Array:
        """float32 logits [..., V] plus the output bias, if the model has one."""
        bias = self.output_bias()
        return logits if bias is None else logits + bias.astype(jnp.float32)

    def output_bias(self) -> jax.Array | None:
        """The logits' bias [V] in param dtype (`logits_bias`), else None."""
        return None if self.logits_bias is None else self.logits_bias[...]

    def output_matrix(self) -> jax.Array:
        """The output projection's weights as [V, D] (the tied embedding, or Unembed^T), in
        param dtype: `project(y)` is y @ output_matrix()^T in the compute dtype."""
        if self.unembed is not None:
            return self.unembed.kernel[...].T
        return self.tgt_embed.embedding[...]

    def _run(self, layer, *arrays, remat: bool = True, **static):
        """layer(*arrays, **static), rematerialized if `remat` and `config.remat`.

        With remat the layer's activations are recomputed for the gradient instead
        of stored. Arrays (and None) go positionally; other keyword arguments are
        closed over as Python constants.
        """
        if remat and self.config.remat:
            return nnx.remat(lambda lyr, *a: lyr(*a, **static))(layer, *arrays)
        return layer(*arrays, **static)

    def _cross_kv(self, encoded: jax.Array) -> tuple[KVCache, ...]:
        """encoded [B, S, D] -> per decoder layer, cross-attention keys/values [B, S, N, H]."""
        return tuple(layer.cross_attn.project_kv(encoded) for layer in self.decoder_layers)

    def cross_cache(self, encoded: jax.Array) -> tuple[KVCache, ...]:
        """encoded [B, S, D] -> per decoder layer, the keys/values [B, N, S, H] that
        incremental decoding attends over (`DecodeCache.cross_kv`)."""
        return tuple(kv.heads_first() for kv in self._cross_kv(encoded))

    def _decoder_stack(
        self,
        y: jax.Array,
        cross_kv: tuple[KVCache, ...],
        self_mask: Mask | jax.Array,
        cross_mask: Mask | jax.Array,
        caches: tuple[KVCache, ...] | None = None,
        index: jax.Array | None = None,
        *,
        deterministic: bool = True,
        return_cross_weights: bool = False,
    ) -> tuple[jax.Array, tuple[KVCache, ...], jax.Array | None]:
        """Every decoder layer in turn over y [B, T, D] (embedded targets).

        Args:
          cross_kv: per layer, the encoder output's keys/values [B, S, N, H].
          self_mask, cross_mask: [B|1, 1, T, T or L], [B, 1, T, S].
          caches, index: per-layer self-attention caches [B, L, N, H] and the
            position of y's first token (incremental decoding), or None.
        Returns:
          the last layer's output [B, T, D] (before the final norm); per layer,
          the self-attention keys/values ([B, T, N, H], or the updated caches
          [B, L, N, H]); and, if asked for, the cross-attention weights
          [L_dec, B, N, T, S] float32 (else None).
        """
        # Remat only full passes (training): incremental decoding has no backward
        # pass, and runs inside a while_loop where nnx.remat cannot update the model.
        remat = caches is None
        if caches is None:
            caches = (None,) * len(self.decoder_layers)
        new_caches, weights = [], []
        for layer, kv, cache in zip(self.decoder_layers, cross_kv, caches, strict=True):
            y, self_kv, w = self._run(
                layer,
                y,
                kv,
                self_mask,
                cross_mask,
                cache,
                index,
                remat=remat,
                deterministic=deterministic,
                return_cross_weights=return_cross_weights,
            )
            new_caches.append(self_kv)
            weights.append(w)
        return y, tuple(new_caches), jnp.stack(weights) if return_cross_weights else None

    # --- public API -------------------------------------------------------

    def encode(
        self,
        src: jax.Array,
        *,
        src_segments: jax.Array | None = None,
        src_positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """src [B, S] int32 -> encoder output [B, S, D]."""
        return self._encode(src, self.src_embed(src), src_segments, src_positions, deterministic)

    def _encode(self, src, rows, src_segments, src_positions, deterministic: bool) -> jax.Array:
        """`encode` from the source's embedding rows [B, S, D]."""
        mask = source_mask(src, src_segments)  # [B, 1, S, S]
        x = self._embed(rows, src_positions, deterministic)
        for layer in self.encoder_layers:
            x = self._run(layer, x, mask, deterministic=deterministic)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x

    def decode(
        self,
        tgt_in: jax.Array,
        encoded: jax.Array,
        src: jax.Array,
        *,
        src_segments: jax.Array | None = None,
        tgt_segments: jax.Array | None = None,
        tgt_positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """tgt_in [B, T] (BOS + target), encoded [B, S, D], src [B, S] -> logits [B, T, V] f32."""
        rows = self.tgt_embed(tgt_in)
        segments = (src_segments, tgt_segments)
        y = self._decode(tgt_in, rows, encoded, src, segments, tgt_positions, deterministic)
        return self.project(y)

    def _decode(
        self, tgt_in, rows, encoded, src, segments, tgt_positions, deterministic: bool
    ) -> jax.Array:
        """Final decoder states [B, T, D] from the target's embedding rows [B, T, D];
        segments = (src, tgt) segment ids."""
        src_segments, tgt_segments = segments
        self_mask = target_mask(tgt_in, tgt_segments)  # [B, 1, T, T]
        cross_mask = target_source_mask(tgt_in, src, tgt_segments, src_segments)  # [B, 1, T, S]
        y = self._embed(self._start(tgt_in, rows), tgt_positions, deterministic)
        cross_kv = self._cross_kv(encoded)
        y, _, _ = self._decoder_stack(
            y, cross_kv, self_mask, cross_mask, deterministic=deterministic
        )
        return self._final(y)

    def __call__(
        self,
        src: jax.Array,
        tgt_in: jax.Array,
        *,
        src_segments: jax.Array | None = None,
        tgt_segments: jax.Array | None = None,
        src_positions: jax.Array | None = None,
        tgt_positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """src [B, S], tgt_in [B, T] int32 -> logits [B, T, V] float32."""
        y = self.hidden(
            src,
            tgt_in,
            src_segments=src_segments,
            tgt_segments=tgt_segments,
            src_positions=src_positions,
            tgt_positions=tgt_positions,
            deterministic=deterministic,
        )
        return self.project(y)

    def hidden(
        self,
        src: jax.Array,
        tgt_in: jax.Array,
        *,
        src_segments: jax.Array | None = None,
        tgt_segments: jax.Array | None = None,
        src_positions: jax.Array | None = None,
        tgt_positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """`__call__` up to the output projection: the final decoder states [B, T, D].

        `project(hidden(...))` are the logits; a loss can instead read the states in
        chunks against `output_matrix()` without a whole [B, T, V] array.
        """
        src_rows, tgt_rows = self._lookup_both(src, tgt_in)
        encoded = self._encode(src, src_rows, src_segments, src_positions, deterministic)
        segments = (src_segments, tgt_segments)
        return self._decode(tgt_in, tgt_rows, encoded, src, segments, tgt_positions, deterministic)

    # --- incremental decoding ---------------------------------------------

    def decode_output(self) -> jax.Array:
        """The output projection as decoding reads it (`DecodeCache.output`): [D, V] in the
        compute dtype."""
        return self.output_matrix().T.astype(self.config.dtype)  # [V, D] -> [D, V]

    def init_cache(
        self,
        src: jax.Array,
        max_decode_len: int,
        *,
        encoded: jax.Array | None = None,
        output: jax.Array | None = None,
    ) -> DecodeCache:
        """Encode src [B, S] once and precompute every layer's cross-attention keys/values.

        Returns a cache with room for `max_decode_len` target tokens (BOS included).
        output: `decode_output()`, made once for many searches (default: made here).
        """
        cfg = self.config
        if max_decode_len > cfg.max_len:
            raise ValueError(
                f"max_decode_len ({max_decode_len}) exceeds the model's max_len ({cfg.max_len})"
            )
        if encoded is None:
            encoded = self.encode(src)
        shape = (src.shape[0], cfg.num_heads, max_decode_len, cfg.head_dim)  # [B, N, L, H]
        return DecodeCache(
            self_kv=tuple(KVCache.zeros(shape, cfg.dtype) for _ in self.decoder_layers),
            cross_kv=self.cross_cache(encoded),
            src_valid=src != PAD_ID,
            index=jnp.zeros((), jnp.int32),
            start=jnp.zeros((src.shape[0],), jnp.int32),
            output=self.decode_output() if output is None else output,
        )

    def decode_step(self, tokens: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        """Feed one token per row at step `cache.index`: position index - start of its source.

        Args:
          tokens: [R] int32, the previous output token (BOS at the first step); R = B,
            or B*K for K beams per source (`DecodeCache.repeat`).
          cache: from `init_cache` or the previous step.
        Returns:
          logits [R, V] float32 for the next token, and the updated cache.
        """
        i, room = cache.index, cache.max_length
        per_source = tokens.shape[0] // cache.start.shape[0]  # K
        pos = jnp.repeat(i - cache.start, per_source)  # [B] -> [R], each row's position
        table = self.position_table_values(room)  # [L, D]: a position < L, the cache's room
        pe = jnp.take(table, pos, axis=0)[:, None]  # [R, 1, D]
        y = self._start(tokens[:, None], self.tgt_embed(tokens[:, None])) + pe  # [R, 1, D]
        # Slot j holds the token fed `age` steps ago: a row sees its own source's tokens,
        # this one included (with start 0, slots not written yet are the oldest).
        age = (i - jnp.arange(room)) % room  # [L]
        self_mask = (age[None, :] <= pos[:, None])[:, None, None, :]  # [R, 1, 1, L]
        cross_mask = cache.src_valid[:, None, None, :]  # [B, 1, 1, S]
        y, self_kv, _ = self._decoder_stack(
            y, cache.cross_kv, self_mask, cross_mask, cache.self_kv, i % room
        )
        logits = einsum_f32("RD,DV->RV", self._final(y)[:, 0], cache.output)  # [R, V]
        return self._biased(logits), cache.replace(self_kv=self_kv, index=i + 1)

    def cross_attention_weights(self, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
        """Cross-attention weights of every decoder layer: [L_dec, B, N, T, S] float32.

        Runs the decoder once (deterministic) and returns softmax(q k^T / sqrt(H))
        of each layer's cross-attention, as the paper's attention pictures show.
        Rows are independent: any batch (e.g. a source repeated for n hypotheses) works.
        """
        encoded = self.encode(src)
        self_mask = target_mask(tgt_in, None)  # [B, 1, T, T]
        cross_mask = target_source_mask(tgt_in, src, None, None)  # [B, 1, T, S]
        y = self._embed(self._start(tgt_in, self.tgt_embed(tgt_in)), None, True)
        _, _, weights = self._decoder_stack(
            y, self._cross_kv(encoded), self_mask, cross_mask, return_cross_weights=True
        )
        return weights


def shift_right(tgt: jax.Array, bos_id: int = BOS_ID) -> jax.Array:
    """[B, T] target ids -> [B, T] decoder inputs: BOS followed by tgt[:, :-1] (pads stay 0)."""
    bos = jnp.full((tgt.shape[0], 1), bos_id, dtype=tgt.dtype)
    return jnp.concatenate([bos, tgt[:, :-1]], axis=1)

"""The encoder-decoder Transformer (paper section 3), with an explicit KV cache for decoding.

    model = Transformer(TransformerConfig(vocab_size=8000), rngs=nnx.Rngs(0))
    logits = model(src, tgt_in)                       # [B, S], [B, T] -> [B, T, V]
    cache = model.init_cache(src, max_decode_len=L)   # encode once; room for L tokens
    logits, cache = model.decode_step(tokens, cache)  # [B] -> [B, V], one position on
    weights = model.cross_attention_weights(src, tgt_in)  # [L_dec, B, N, T, S]

Token id 0 is padding everywhere. For packed rows (several pairs in one row)
pass segment ids (1, 2, ... per pair, 0 on padding) and per-pair positions.

`decode`, `decode_step` and `cross_attention_weights` all run the decoder
stack through one loop, `_decoder_stack`, which threads each layer's KV cache
in and out (no state is captured) and rematerializes layers when `config.remat`.
A `DecodeCache` is a pytree of per-layer `KVCache`s with the two batch
operations beam search needs, `repeat` and `reorder`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from model.attention import Mask, causal_mask, padding_mask, segment_mask
from model.config import TransformerConfig
from model.layers import DecoderLayer, Embed, EncoderLayer, KVCache, LayerNorm, Unembed
from model.tokens import BOS_ID, PAD_ID


@functools.lru_cache(maxsize=8)
def _position_table(length: int, d_model: int) -> np.ndarray:
    # Imported here, not at the top: `python -m model.positional` (the picture of
    # the table) then runs a module that `import model` has not loaded already.
    from model.positional import sinusoidal_positions

    return sinusoidal_positions(length, d_model)


@struct.dataclass
class DecodeCache:
    """Everything incremental decoding carries from one step to the next (a pytree).

    self_kv: per decoder layer, keys/values [B, L, N, H] of the first `index` tokens.
    cross_kv: per decoder layer, the encoder output's keys/values [B, S, N, H],
      computed once per source.
    src_valid: [B, S] bool, False on source padding.
    index: [] int32, position of the next token to be fed.
    """

    self_kv: tuple[KVCache, ...]
    cross_kv: tuple[KVCache, ...]
    src_valid: jax.Array
    index: jax.Array

    @property
    def max_length(self) -> int:
        return self.self_kv[0].k.shape[1]

    def repeat(self, k: int) -> DecodeCache:
        """Give each source k beams: every batch-major array [B, ...] -> [B*k, ...].

        Rows b*k .. b*k + k-1 are source b's beams, all equal to source b's row.
        """
        rep = lambda x: jnp.repeat(x, k, axis=0)  # [B, ...] -> [B*k, ...]
        return self.replace(
            self_kv=jax.tree.map(rep, self.self_kv),
            cross_kv=jax.tree.map(rep, self.cross_kv),
            src_valid=rep(self.src_valid),
        )

    def reorder(self, rows: jax.Array) -> DecodeCache:
        """Row r of the new self-attention caches is row rows[r] of the old: rows [B*K] int.

        Only the self-attention caches depend on a hypothesis's history; the cross
        keys/values and source mask are the same for all of a source's beams, so
        they are left alone (rows must stay within each source's block of beams).
        """
        take = lambda x: jnp.take(x, rows, axis=0)  # [B*K, L, N, H] -> [B*K, L, N, H]
        return self.replace(self_kv=jax.tree.map(take, self.self_kv))


def _lengths(tokens: jax.Array) -> jax.Array:
    return (tokens != PAD_ID).sum(axis=-1).astype(jnp.int32)  # [B]


def _source_mask(src: jax.Array, src_segments: jax.Array | None) -> Mask:
    if src_segments is None:
        n = _lengths(src)
        return Mask(padding_mask(src, src), q_lengths=n, kv_lengths=n)
    return Mask(segment_mask(src_segments, src_segments))


def _cross_mask(
    tgt: jax.Array, src: jax.Array, tgt_segments: jax.Array | None, src_segments: jax.Array | None
) -> Mask:
    if tgt_segments is None or src_segments is None:
        return Mask(padding_mask(tgt, src), q_lengths=_lengths(tgt), kv_lengths=_lengths(src))
    return Mask(segment_mask(tgt_segments, src_segments))


def _target_mask(tgt: jax.Array, tgt_segments: jax.Array | None) -> Mask:
    if tgt_segments is None:
        n = _lengths(tgt)
        return Mask(causal_mask(tgt), q_lengths=n, kv_lengths=n, causal=True)
    dense = causal_mask(tgt) & segment_mask(tgt_segments, tgt_segments)
    return Mask(dense, causal=True)


class Transformer(nnx.Module):
    """Encoder-decoder Transformer; see the module docstring for the calling convention."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
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

    # --- pieces -----------------------------------------------------------

    def _embed(self, embed: Embed, ids, positions, deterministic: bool) -> jax.Array:
        """ids [B, T] -> dropout(embedding * sqrt(D) + PE) [B, T, D]."""
        cfg = self.config
        table = jnp.asarray(_position_table(cfg.max_len, cfg.d_model), cfg.compute_dtype)
        if positions is None:
            pe = table[None, : ids.shape[1]]  # [1, T, D]
        else:
            pe = jnp.take(table, positions, axis=0)  # [B, T, D]
        x = embed(ids) + pe
        return self.embed_dropout(x, deterministic=deterministic)

    def _logits(self, y: jax.Array) -> jax.Array:
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        if self.unembed is not None:
            return self.unembed(y)
        return self.tgt_embed.attend(y)

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
        mask = _source_mask(src, src_segments)  # [B, 1, S, S]
        x = self._embed(self.src_embed, src, src_positions, deterministic)
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
        self_mask = _target_mask(tgt_in, tgt_segments)  # [B, 1, T, T]
        cross_mask = _cross_mask(tgt_in, src, tgt_segments, src_segments)  # [B, 1, T, S]
        y = self._embed(self.tgt_embed, tgt_in, tgt_positions, deterministic)
        cross_kv = self._cross_kv(encoded)
        y, _, _ = self._decoder_stack(
            y, cross_kv, self_mask, cross_mask, deterministic=deterministic
        )
        return self._logits(y)

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
        encoded = self.encode(
            src,
            src_segments=src_segments,
            src_positions=src_positions,
            deterministic=deterministic,
        )
        return self.decode(
            tgt_in,
            encoded,
            src,
            src_segments=src_segments,
            tgt_segments=tgt_segments,
            tgt_positions=tgt_positions,
            deterministic=deterministic,
        )

    # --- incremental decoding ---------------------------------------------

    def init_cache(
        self, src: jax.Array, max_decode_len: int, *, encoded: jax.Array | None = None
    ) -> DecodeCache:
        """Encode src [B, S] once and precompute every layer's cross-attention keys/values.

        Returns a cache with room for `max_decode_len` target tokens (BOS included).
        """
        cfg = self.config
        if max_decode_len > cfg.max_len:
            raise ValueError(
                f"max_decode_len ({max_decode_len}) exceeds the model's max_len ({cfg.max_len})"
            )
        if encoded is None:
            encoded = self.encode(src)
        shape = (src.shape[0], max_decode_len, cfg.num_heads, cfg.head_dim)  # [B, L, N, H]
        return DecodeCache(
            self_kv=tuple(KVCache.zeros(shape, cfg.compute_dtype) for _ in self.decoder_layers),
            cross_kv=self._cross_kv(encoded),
            src_valid=src != PAD_ID,
            index=jnp.zeros((), jnp.int32),
        )

    def decode_step(self, tokens: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        """Feed one token per row at position `cache.index`.

        Args:
          tokens: [B] int32, the previous output token (BOS at the first step).
          cache: from `init_cache` or the previous step.
        Returns:
          logits [B, V] float32 for the next token, and the updated cache.
        """
        cfg = self.config
        i = cache.index
        table = jnp.asarray(_position_table(cfg.max_len, cfg.d_model), cfg.compute_dtype)
        pe = jax.lax.dynamic_slice_in_dim(table, i, 1)[None]  # [1, 1, D]
        y = self.tgt_embed(tokens[:, None]) + pe  # [B, 1, D]
        # Keys at positions <= i are filled; later slots are still zeros.
        self_mask = (jnp.arange(cache.max_length) <= i)[None, None, None, :]  # [1, 1, 1, L]
        cross_mask = cache.src_valid[:, None, None, :]  # [B, 1, 1, S]
        y, self_kv, _ = self._decoder_stack(
            y, cache.cross_kv, self_mask, cross_mask, cache.self_kv, i
        )
        logits = self._logits(y)[:, 0]  # [B, 1, V] -> [B, V]
        return logits, cache.replace(self_kv=self_kv, index=i + 1)

    def cross_attention_weights(self, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
        """Cross-attention weights of every decoder layer: [L_dec, B, N, T, S] float32.

        Runs the decoder once (deterministic) and returns softmax(q k^T / sqrt(H))
        of each layer's cross-attention, as the paper's attention pictures show.
        Rows are independent: any batch (e.g. a source repeated for n hypotheses) works.
        """
        encoded = self.encode(src)
        self_mask = _target_mask(tgt_in, None)  # [B, 1, T, T]
        cross_mask = _cross_mask(tgt_in, src, None, None)  # [B, 1, T, S]
        y = self._embed(self.tgt_embed, tgt_in, None, True)
        _, _, weights = self._decoder_stack(
            y, self._cross_kv(encoded), self_mask, cross_mask, return_cross_weights=True
        )
        return weights


def shift_right(tgt: jax.Array, bos_id: int = BOS_ID) -> jax.Array:
    """[B, T] target ids -> [B, T] decoder inputs: BOS followed by tgt[:, :-1] (pads stay 0)."""
    bos = jnp.full((tgt.shape[0], 1), bos_id, dtype=tgt.dtype)
    return jnp.concatenate([bos, tgt[:, :-1]], axis=1)

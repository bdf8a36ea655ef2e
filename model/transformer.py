"""The encoder-decoder Transformer (paper section 3), with an explicit KV cache for decoding.

    model = Transformer(TransformerConfig(vocab_size=8000), rngs=nnx.Rngs(0))
    logits = model(src, tgt_in)                      # [B, S], [B, T] -> [B, T, V]

Token id 0 is padding everywhere. For packed rows (several pairs in one row)
pass segment ids (1, 2, ... per pair, 0 on padding) and per-pair positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from model.attention import Mask, causal_mask, padding_mask, segment_mask
from model.config import BOS_ID, PAD_ID, TransformerConfig
from model.layers import DecoderLayer, Embed, EncoderLayer, LayerNorm, Unembed
from model.positional import sinusoidal_positions


@functools.lru_cache(maxsize=8)
def _position_table(length: int, d_model: int) -> np.ndarray:
    return sinusoidal_positions(length, d_model)


@struct.dataclass
class DecodeCache:
    """Everything incremental decoding carries from one step to the next (a pytree).

    self_k, self_v: per decoder layer [B, L, N, H], keys/values of the first `index` tokens.
    cross_k, cross_v: per decoder layer [B, S, N, H], computed once per source.
    src_valid: [B, S] bool, False on source padding.
    index: [] int32, position of the next token to be fed.
    """

    self_k: tuple[jax.Array, ...]
    self_v: tuple[jax.Array, ...]
    cross_k: tuple[jax.Array, ...]
    cross_v: tuple[jax.Array, ...]
    src_valid: jax.Array
    index: jax.Array

    @property
    def max_length(self) -> int:
        return self.self_k[0].shape[1]


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

    def _run(self, layer, *args, **kwargs):
        if self.config.remat:
            return nnx.remat(lambda lyr, *a: lyr(*a, **kwargs))(layer, *args)
        return layer(*args, **kwargs)

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
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_kv(encoded)  # [B, S, N, H] each
            y = self._run(layer, y, k, v, self_mask, cross_mask, deterministic=deterministic)
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
        b = src.shape[0]
        shape = (b, max_decode_len, cfg.num_heads, cfg.head_dim)  # [B, L, N, H]
        zeros = tuple(jnp.zeros(shape, cfg.compute_dtype) for _ in self.decoder_layers)
        cross = [layer.cross_attn.project_kv(encoded) for layer in self.decoder_layers]
        return DecodeCache(
            self_k=zeros,
            self_v=zeros,
            cross_k=tuple(k for k, _ in cross),
            cross_v=tuple(v for _, v in cross),
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
        new_k, new_v = [], []
        for layer, k_cache, v_cache, ck, cv in zip(
            self.decoder_layers,
            cache.self_k,
            cache.self_v,
            cache.cross_k,
            cache.cross_v,
            strict=True,
        ):

            def write(h, layer=layer, k_cache=k_cache, v_cache=v_cache):
                k, v = layer.self_attn.project_kv(h)  # [B, 1, N, H]
                k_all = jax.lax.dynamic_update_slice_in_dim(k_cache, k, i, axis=1)
                v_all = jax.lax.dynamic_update_slice_in_dim(v_cache, v, i, axis=1)
                new_k.append(k_all)
                new_v.append(v_all)
                return k_all, v_all  # [B, L, N, H]

            y = layer(y, ck, cv, self_mask, cross_mask, self_kv=write)
        logits = self._logits(y)[:, 0]  # [B, V]
        cache = cache.replace(self_k=tuple(new_k), self_v=tuple(new_v), index=i + 1)
        return logits, cache

    def cross_attention_weights(self, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
        """Cross-attention weights of every decoder layer: [L_dec, B, N, T, S] float32.

        Runs the decoder once (deterministic) and returns softmax(q k^T / sqrt(H))
        of each layer's cross-attention, as the paper's attention pictures show.
        """
        encoded = self.encode(src)
        self_mask = _target_mask(tgt_in, None)
        cross_mask = _cross_mask(tgt_in, src, None, None)
        y = self._embed(self.tgt_embed, tgt_in, None, True)
        weights: list[jax.Array] = []
        for layer in self.decoder_layers:
            k, v = layer.cross_attn.project_kv(encoded)
            y = layer(y, k, v, self_mask, cross_mask, capture=weights)
        return jnp.stack(weights)


def shift_right(tgt: jax.Array, bos_id: int = BOS_ID) -> jax.Array:
    """[B, T] target ids -> [B, T] decoder inputs: BOS followed by tgt[:, :-1] (pads stay 0)."""
    bos = jnp.full((tgt.shape[0], 1), bos_id, dtype=tgt.dtype)
    return jnp.concatenate([bos, tgt[:, :-1]], axis=1)

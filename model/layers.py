"""NNX building blocks: embedding, multi-head attention, feed-forward, encoder and decoder layers.

Every parameter carries `logical_axes` metadata (names from model/sharding.py).
Parameters are stored in `param_dtype` and cast to the computation dtype at use;
LayerNorm and softmax run in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from model.attention import attention_weights, dot_product_attention
from model.config import TransformerConfig
from model.sharding import EMBED, HEADS, KV, MLP, VOCAB

# Glorot/Xavier uniform over the combined fan-in/fan-out of multi-dim kernels.
_xavier = nnx.initializers.variance_scaling


def _param(rngs: nnx.Rngs, init, shape, dtype, axes) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis, computed in float32, returned in the input dtype."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, pd = cfg.d_model, cfg.params_dtype
        self.eps = cfg.layer_norm_epsilon
        self.scale = _param(rngs, nnx.initializers.ones, (d,), pd, (EMBED,))
        self.bias = _param(rngs, nnx.initializers.zeros, (d,), pd, (EMBED,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding scaled by sqrt(D); `attend` reuses it as the output projection (3.4)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        v, d = cfg.vocab_size, cfg.d_model
        self.dtype = cfg.compute_dtype
        self.scale = math.sqrt(d)
        # Std 1/sqrt(D) so that the sqrt(D)-scaled embedding has unit variance.
        init = nnx.initializers.normal(stddev=d**-0.5)
        self.embedding = _param(rngs, init, (v, d), cfg.params_dtype, (VOCAB, EMBED))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """[B, T] int -> [B, T, D] in the computation dtype."""
        table = self.embedding[...].astype(self.dtype)
        return jnp.take(table, ids, axis=0) * jnp.asarray(self.scale, self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> float32 logits [B, T, V] against the same table."""
        table = self.embedding[...].astype(self.dtype)
        return jnp.einsum("BTD,VD->BTV", x, table, preferred_element_type=jnp.float32)


class Unembed(nnx.Module):
    """An untied output projection [D, V] (used when `tie_output=False`)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.dtype = cfg.compute_dtype
        init = _xavier(1.0, "fan_avg", "uniform")
        shape = (cfg.d_model, cfg.vocab_size)
        self.kernel = _param(rngs, init, shape, cfg.params_dtype, (EMBED, VOCAB))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> float32 logits [B, T, V]."""
        w = self.kernel[...].astype(self.dtype)
        return jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32)


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_N) W^O (section 3.2.2).

    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Projections are stored per head: W^Q, W^K, W^V [D, N, H] and W^O [N, H, D].
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, n, h, pd = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.params_dtype
        self.dtype = cfg.compute_dtype
        self.impl = cfg.attention_impl
        self.attention_dropout_rate = cfg.attention_dropout_rate
        self.rngs = rngs if cfg.attention_dropout_rate > 0 else None
        in_init = _xavier(1.0, "fan_avg", "uniform", in_axis=0, out_axis=(1, 2))
        out_init = _xavier(1.0, "fan_avg", "uniform", in_axis=(0, 1), out_axis=2)
        self.query = _param(rngs, in_init, (d, n, h), pd, (EMBED, HEADS, KV))
        self.key = _param(rngs, in_init, (d, n, h), pd, (EMBED, HEADS, KV))
        self.value = _param(rngs, in_init, (d, n, h), pd, (EMBED, HEADS, KV))
        self.out = _param(rngs, out_init, (n, h, d), pd, (HEADS, KV, EMBED))

    def _proj(self, w: nnx.Param, x: jax.Array) -> jax.Array:
        return jnp.einsum("BTD,DNH->BTNH", x, w[...].astype(self.dtype))

    def project_kv(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, S, D] -> keys, values [B, S, N, H] (what a cache stores)."""
        return self._proj(self.key, x), self._proj(self.value, x)

    def attend(
        self,
        x: jax.Array,
        k: jax.Array,
        v: jax.Array,
        mask: jax.Array | None,
        deterministic: bool,
        capture: list | None = None,
    ) -> jax.Array:
        """Queries from x [B, T, D] over given keys/values [B, S, N, H] -> [B, T, D].

        If `capture` is a list, the attention weights [B, N, T, S] are appended to it.
        """
        q = self._proj(self.query, x)  # [B, T, N, H]
        if capture is not None:
            capture.append(attention_weights(q, k, mask))
        rng = None
        if self.rngs is not None and not deterministic:
            rng = self.rngs.dropout()
        rate = 0.0 if deterministic else self.attention_dropout_rate
        o = dot_product_attention(q, k, v, mask, impl=self.impl, dropout_rate=rate, dropout_rng=rng)
        return jnp.einsum("BTNH,NHD->BTD", o, self.out[...].astype(self.dtype))

    def __call__(
        self, x: jax.Array, kv: jax.Array, mask: jax.Array | None, *, deterministic: bool = True
    ) -> jax.Array:
        """Self-attention (kv is x) or cross-attention (kv is the encoder output)."""
        k, v = self.project_kv(kv)
        return self.attend(x, k, v, mask, deterministic)


class FeedForward(nnx.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, with W_1 [D, F] and W_2 [F, D] (section 3.3)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.params_dtype
        self.dtype = cfg.compute_dtype
        self.act = jax.nn.relu if cfg.activation == "relu" else jax.nn.gelu
        init = _xavier(1.0, "fan_avg", "uniform")
        zeros = nnx.initializers.zeros
        self.wi = _param(rngs, init, (d, f), pd, (EMBED, MLP))
        self.bi = _param(rngs, zeros, (f,), pd, (MLP,))
        self.wo = _param(rngs, init, (f, d), pd, (MLP, EMBED))
        self.bo = _param(rngs, zeros, (d,), pd, (EMBED,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, D]."""
        h = jnp.einsum("BTD,DF->BTF", x, self.wi[...].astype(self.dtype))
        h = self.act(h + self.bi[...].astype(self.dtype))
        y = jnp.einsum("BTF,FD->BTD", h, self.wo[...].astype(self.dtype))
        return y + self.bo[...].astype(self.dtype)


class _Residual(nnx.Module):
    """One sub-layer's wrapper: post-LN LN(x + drop(f(x))) or pre-LN x + drop(f(LN(x)))."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.pre = cfg.norm == "pre"
        self.norm = LayerNorm(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(
        self, x: jax.Array, fn: Callable[[jax.Array], jax.Array], deterministic: bool
    ) -> jax.Array:
        if self.pre:
            return x + self.dropout(fn(self.norm(x)), deterministic=deterministic)
        return self.norm(x + self.dropout(fn(x), deterministic=deterministic))


class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward, each inside a residual + LayerNorm."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, rngs=rngs)
        self.ffn = FeedForward(cfg, rngs=rngs)
        self.attn_res = _Residual(cfg, rngs=rngs)
        self.ffn_res = _Residual(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """x [B, S, D], mask [B, 1, S, S] -> [B, S, D]."""
        attend = lambda h: self.self_attn(h, h, mask, deterministic=deterministic)
        x = self.attn_res(x, attend, deterministic)
        return self.ffn_res(x, self.ffn, deterministic)


class DecoderLayer(nnx.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, rngs=rngs)
        self.cross_attn = MultiHeadAttention(cfg, rngs=rngs)
        self.ffn = FeedForward(cfg, rngs=rngs)
        self.self_res = _Residual(cfg, rngs=rngs)
        self.cross_res = _Residual(cfg, rngs=rngs)
        self.ffn_res = _Residual(cfg, rngs=rngs)

    def __call__(
        self,
        y: jax.Array,
        cross_k: jax.Array,
        cross_v: jax.Array,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        *,
        deterministic: bool = True,
        self_kv: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None,
        capture: list | None = None,
    ) -> jax.Array:
        """y [B, T, D]; cross keys/values [B, S, N, H]; masks [B, 1, T, T'] / [B, 1, T, S].

        `self_kv` maps the (normalized) decoder input to the self-attention keys
        and values; by default they are its own projections, while cached
        decoding passes a function that writes them into the cache and returns
        the whole cache. `capture` collects the cross-attention weights.
        """
        attn = self.self_attn
        kv_fn = self_kv or attn.project_kv

        def self_attention(h):
            k, v = kv_fn(h)
            return attn.attend(h, k, v, self_mask, deterministic)

        y = self.self_res(y, self_attention, deterministic)
        cross = lambda h: self.cross_attn.attend(
            h, cross_k, cross_v, cross_mask, deterministic, capture
        )
        y = self.cross_res(y, cross, deterministic)
        return self.ffn_res(y, self.ffn, deterministic)

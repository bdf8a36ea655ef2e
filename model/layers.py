"""NNX building blocks: embedding, multi-head attention, feed-forward, encoder and decoder layers.

Every parameter carries `logical_axes` metadata (names from model/sharding.py).
Parameters are stored in `param_dtype` and cast to the computation dtype at use;
LayerNorm and softmax run in float32.

Layers are functions of their inputs: what incremental decoding carries between
steps goes in and comes back out, as in Flax's gemma example. A `KVCache` holds
one attention layer's keys and values; self-attention takes an optional cache and
returns its keys/values (the updated cache when one was given), and
`DecoderLayer` returns `(y, self_kv, cross_weights)`, the cross-attention
weights only when asked for (for attention pictures and word alignments).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from attention_jax.attention import Mask, attention_weights, cached_attention, dot_product_attention
from attention_jax.config import TransformerConfig
from attention_jax.precision import einsum_f32
from attention_jax.sharding import EMBED, HEADS, KV, MLP, VOCAB

# Glorot/Xavier uniform over the combined fan-in/fan-out of multi-dim kernels.
_xavier = nnx.initializers.variance_scaling


def _param(rngs: nnx.Rngs, init, shape, dtype, axes) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis, computed in float32, returned in the input dtype."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, pd = cfg.d_model, cfg.param_dtype
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
        self.dtype = cfg.dtype
        self.scale = math.sqrt(d)
        # Std 1/sqrt(D) so that the sqrt(D)-scaled embedding has unit variance.
        init = nnx.initializers.normal(stddev=d**-0.5)
        self.embedding = _param(rngs, init, (v, d), cfg.param_dtype, (VOCAB, EMBED))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """[B, T] int -> [B, T, D] in the computation dtype."""
        # Gather from the float32 table and cast only the rows: the gradient of the
        # gather is a scatter-add into the table's dtype, and a frequent token's
        # thousands of rows summed in bfloat16 would lose most of their updates.
        rows = jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)  # [B, T, D]
        return rows * jnp.asarray(self.scale, self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> float32 logits [B, T, V] against the same table."""
        table = self.embedding[...].astype(self.dtype)
        return einsum_f32("BTD,VD->BTV", x, table)


class Unembed(nnx.Module):
    """An untied output projection [D, V] (used when `tie_output=False`)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.dtype = cfg.dtype
        init = _xavier(1.0, "fan_avg", "uniform")
        shape = (cfg.d_model, cfg.vocab_size)
        self.kernel = _param(rngs, init, shape, cfg.param_dtype, (EMBED, VOCAB))

    def __call__(self, x: jax.Array) -> jax.Array:
        """[B, T, D] -> float32 logits [B, T, V]."""
        w = self.kernel[...].astype(self.dtype)
        return einsum_f32("BTD,DV->BTV", x, w)


@struct.dataclass
class KVCache:
    """The keys and values one attention layer attends over (a pytree).

    As projected (`MultiHeadAttention.project_kv`, full passes): k, v [B, L, N, H].
    As stored for incremental decoding: heads first, k, v [B, N, L, H]
    (`heads_first`), the layout `cached_attention` reads without a transpose. For
    self-attention L is the cache's capacity (model/decode_cache.py `DecodeCache`
    says which slots a row sees); for cross-attention L = S.
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, shape: tuple[int, int, int, int], dtype) -> KVCache:
        """An empty decoding cache of shape [B, N, L, H]."""
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def heads_first(self) -> KVCache:
        """[B, L, N, H] (as projected) -> [B, N, L, H] (as a decoding cache stores it)."""
        return KVCache(jnp.swapaxes(self.k, 1, 2), jnp.swapaxes(self.v, 1, 2))

    def write(self, new: KVCache, index: jax.Array | int) -> KVCache:
        """Store new [B, T, N, H] (as projected) at positions index .. index + T - 1 of
        this decoding cache [B, N, L, H]."""
        new = new.heads_first()  # [B, T, N, H] -> [B, N, T, H]
        put = lambda old, x: jax.lax.dynamic_update_slice_in_dim(old, x, index, axis=2)
        return KVCache(put(self.k, new.k), put(self.v, new.v))


class MultiHeadAttention(nnx.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_N) W^O (section 3.2.2).

    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Projections are stored per head: W^Q, W^K, W^V [D, N, H] and W^O [N, H, D].
    Calling the module is self-attention; cross-attention projects the encoder
    output once with `project_kv` and then calls `attend`.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, n, h, pd = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.param_dtype
        self.dtype = cfg.dtype
        self.impl = cfg.attention_impl
        self.attention_dropout_rate = cfg.attention_dropout_rate
        self.rngs = rngs if cfg.attention_dropout_rate > 0 else None
        in_init = _xavier(1.0, "fan_avg", "uniform", in_axis=0, out_axis=(1, 2))
        out_init = _xavier(1.0, "fan_avg", "uniform", in_axis=(0, 1), out_axis=2)
        self.query = _param(rngs, in_init, (d, n, h), pd, (EMBED, HEADS, KV))
        self.key = _param(rngs, in_init, (d, n, h), pd, (EMBED, HEADS, KV))
        self.value = _param(rngs, in_init, (d, n, h), pd, (EMBED, HEADS, KV))
        self.out = _param(rngs, out_init, (n, h, d), pd, (HEADS, KV, EMBED))
        # b^Q, b^K, b^V [N, H] and b^O [D] with `attention_bias` (Marian's), else None.
        zeros = nnx.initializers.zeros
        bias = lambda shape, axes: (
            _param(rngs, zeros, shape, pd, axes) if cfg.attention_bias else None
        )
        self.query_bias = bias((n, h), (HEADS, KV))
        self.key_bias = bias((n, h), (HEADS, KV))
        self.value_bias = bias((n, h), (HEADS, KV))
        self.out_bias = bias((d,), (EMBED,))

    def _proj(self, w: nnx.Param, b: nnx.Param | None, x: jax.Array) -> jax.Array:
        y = jnp.einsum("BTD,DNH->BTNH", x, w[...].astype(self.dtype))
        return y if b is None else y + b[...].astype(self.dtype)

    def _out(self, o: jax.Array) -> jax.Array:
        """Heads [B, T, N, H] -> [B, T, D] through W^O (and b^O)."""
        y = jnp.einsum("BTNH,NHD->BTD", o, self.out[...].astype(self.dtype))
        return y if self.out_bias is None else y + self.out_bias[...].astype(self.dtype)

    def project_kv(self, x: jax.Array) -> KVCache:
        """[B, S, D] -> keys, values [B, S, N, H] (what a cache stores)."""
        return KVCache(
            self._proj(self.key, self.key_bias, x), self._proj(self.value, self.value_bias, x)
        )

    def attend(
        self,
        x: jax.Array,
        kv: KVCache,
        mask: Mask | jax.Array | None,
        *,
        deterministic: bool = True,
        return_weights: bool = False,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Queries from x [B, T, D] over given keys/values [B, S, N, H].

        Returns the output [B, T, D] and, if `return_weights`, the attention
        weights softmax(q k^T / sqrt(H)) [B, N, T, S] float32 (else None).
        """
        q = self._proj(self.query, self.query_bias, x)  # [B, T, N, H]
        weights = attention_weights(q, kv.k, mask) if return_weights else None
        rng = None
        if self.rngs is not None and not deterministic:
            rng = self.rngs.dropout()
        rate = 0.0 if deterministic else self.attention_dropout_rate
        o = dot_product_attention(
            q, kv.k, kv.v, mask, impl=self.impl, dropout_rate=rate, dropout_rng=rng
        )  # [B, T, N, H]
        return self._out(o), weights

    def attend_cached(self, x: jax.Array, kv: KVCache, mask: jax.Array) -> jax.Array:
        """Queries from x [R, T, D] over a decoding cache kv [B, N, L, H] -> [R, T, D].

        R may be B*K (K beams per source, rows b*K .. b*K + K-1 of source b): the
        beams of a source then share its cross-attention keys/values, attended as
        K*T queries of one row, instead of K copies of them.
        """
        r, t, _ = x.shape
        b = kv.k.shape[0]
        q = self._proj(self.query, self.query_bias, x)  # [R, T, N, H]
        q = q.reshape(b, (r // b) * t, *q.shape[2:])  # [R, T, N, H] -> [B, K*T, N, H]
        o = cached_attention(q, kv.k, kv.v, mask)  # [B, K*T, N, H]
        o = o.reshape(r, t, -1)  # [B, K*T, N, H] -> [R, T, N*H]
        # W^O as [N*H, D], a view of its [N, H, D]. Through `_out`'s einsum, which contracts
        # (H, N), XLA on CPU lays the weights out again at every step of a search's loop.
        w = self.out[...].astype(self.dtype)
        y = o @ w.reshape(-1, w.shape[-1])  # [R, T, D]
        return y if self.out_bias is None else y + self.out_bias[...].astype(self.dtype)

    def __call__(
        self,
        x: jax.Array,
        mask: Mask | jax.Array | None,
        cache: KVCache | None = None,
        index: jax.Array | int | None = None,
        *,
        deterministic: bool = True,
    ) -> tuple[jax.Array, KVCache]:
        """Self-attention of x [B, T, D] -> (output [B, T, D], keys/values).

        Without a cache the keys/values are x's own, [B, T, N, H]. With a decoding
        cache [B, N, L, H], x's keys/values are written at positions index ..
        index+T-1, the queries attend over the whole cache (the mask hides unfilled
        slots), and the updated cache is returned.
        """
        kv = self.project_kv(x)  # [B, T, N, H]
        if cache is None:
            y, _ = self.attend(x, kv, mask, deterministic=deterministic)
            return y, kv
        cache = cache.write(kv, index)  # [B, N, L, H]
        return self.attend_cached(x, cache, mask), cache


class FeedForward(nnx.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, with W_1 [D, F] and W_2 [F, D] (section 3.3)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        self.dtype = cfg.dtype
        self.act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "swish": jax.nn.swish}[cfg.activation]
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
    """One sub-layer's wrapper: post-LN LN(x + drop(f(x))) or pre-LN x + drop(f(LN(x))).

    `prepare` gives the sub-layer's input and `combine` adds its output back, so
    that sub-layers which return more than an array (a cache, weights) need no closure.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.pre = cfg.norm == "pre"
        self.norm = LayerNorm(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def prepare(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> the sub-layer's input: LN(x) for pre-LN, x for post-LN."""
        return self.norm(x) if self.pre else x

    def combine(self, x: jax.Array, fx: jax.Array, deterministic: bool) -> jax.Array:
        """x, f(prepare(x)) [B, T, D] -> the sub-layer block's output [B, T, D]."""
        y = x + self.dropout(fx, deterministic=deterministic)
        return y if self.pre else self.norm(y)

    def __call__(
        self, x: jax.Array, fn: Callable[[jax.Array], jax.Array], deterministic: bool
    ) -> jax.Array:
        return self.combine(x, fn(self.prepare(x)), deterministic)


class EncoderLayer(nnx.Module):
    """Self-attention then feed-forward, each inside a residual + LayerNorm."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_attn = MultiHeadAttention(cfg, rngs=rngs)
        self.ffn = FeedForward(cfg, rngs=rngs)
        self.attn_res = _Residual(cfg, rngs=rngs)
        self.ffn_res = _Residual(cfg, rngs=rngs)

    def __call__(
        self, x: jax.Array, mask: Mask | jax.Array, *, deterministic: bool = True
    ) -> jax.Array:
        """x [B, S, D], mask [B, 1, S, S] -> [B, S, D]."""
        h, _ = self.self_attn(self.attn_res.prepare(x), mask, deterministic=deterministic)
        x = self.attn_res.combine(x, h, deterministic)
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
        cross_kv: KVCache,
        self_mask: Mask | jax.Array,
        cross_mask: Mask | jax.Array,
        cache: KVCache | None = None,
        index: jax.Array | int | None = None,
        *,
        deterministic: bool = True,
        return_cross_weights: bool = False,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """One decoder layer over y [B, T, D].

        Args:
          y: [B, T, D] decoder stream.
          cross_kv: the encoder output's keys/values for this layer: [B, S, N, H]
            (full pass) or [B_src, N, S, H] (incremental decoding, where y's B rows
            may be B_src sources' beams).
          self_mask: [B|1, 1, T, T] (full pass) or [B|1, 1, T, L] (with a cache).
          cross_mask: [B, 1, T, S], or [B_src, 1, 1, S] with a cache.
          cache, index: self-attention cache [B, N, L, H] and the position of y's
            first token in it (incremental decoding), or None (full pass).
          return_cross_weights: also return the cross-attention weights (full pass).
        Returns:
          y [B, T, D]; the self-attention keys/values ([B, T, N, H], or the updated
          cache [B, N, L, H]); cross-attention weights [B, N, T, S] float32 or None.
        """
        h, self_kv = self.self_attn(
            self.self_res.prepare(y), self_mask, cache, index, deterministic=deterministic
        )
        y = self.self_res.combine(y, h, deterministic)
        if cache is None:
            h, weights = self.cross_attn.attend(
                self.cross_res.prepare(y),
                cross_kv,
                cross_mask,
                deterministic=deterministic,
                return_weights=return_cross_weights,
            )
        else:  # incremental decoding: heads-first keys/values, shared by a source's beams
            h = self.cross_attn.attend_cached(self.cross_res.prepare(y), cross_kv, cross_mask)
            weights = None
        y = self.cross_res.combine(y, h, deterministic)
        return self.ffn_res(y, self.ffn, deterministic), self_kv, weights

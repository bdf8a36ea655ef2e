"""Matmuls that return float32 but keep their backward pass in the compute dtype.

    logits = einsum_f32("BTD,VD->BTV", x, table)   # bf16 operands -> float32 [B, T, V]

The output projection and the attention scores are accumulated and returned
in float32 (softmax and the loss need the range). Left to autodiff, their
float32 cotangent makes both gradient matmuls float32 too: on an H100 the
backward pass of the [tokens, D] x [D, V] output projection then runs on
float32 units, far slower than bf16 tensor cores, and on TPUs as
several bf16 passes (found by train.py --compile_for, docs/aot.md). Here the
cotangent is cast to the operands' dtype first, as every other gradient in a
bf16 model already is; float32 operands take the plain path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """jnp.einsum(spec, a, b) accumulated and returned in float32.

    With float32 operands this is exactly `jnp.einsum(..., preferred_element_type=f32)`;
    with bf16/fp16 operands its gradients are computed in the operands' dtype.
    """
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return _einsum_f32(spec, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _fwd(spec: str, a: jax.Array, b: jax.Array):
    return _einsum_f32(spec, a, b), (a, b)


def _bwd(spec: str, residuals, g: jax.Array):
    a, b = residuals
    _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)  # in the operands' dtype
    return vjp(g.astype(jnp.result_type(a, b)))


_einsum_f32.defvjp(_fwd, _bwd)

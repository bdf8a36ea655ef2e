"""The device mesh (`data`, `fsdp`, `tensor`) and the shardings of state and batches.

    mesh = make_mesh(config)                     # axis sizes from config, -1 = the rest
    shardings = state_shardings(mesh, abstract_state, axis_rules(config))
    batch = shard_batch(numpy_batch, mesh)       # rows split over ('data', 'fsdp')

Parameters name their dimensions with logical axes (model/sharding.py); the
config's `logical_axis_rules` map those names onto mesh axes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attention_jax.runtime.errors import UserError
from attention_jax.sharding import partition_specs

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
    """(data, fsdp, tensor) sizes with at most one -1 ("the rest") -> concrete sizes."""
    sizes = [int(s) for s in sizes]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise UserError(
            f"mesh sizes (mesh_data, mesh_fsdp, mesh_tensor) = {tuple(sizes)}: each must be "
            "a positive int, with at most one -1 meaning 'all remaining devices'"
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise UserError(
                f"mesh sizes {tuple(sizes)} do not divide the {num_devices} available devices"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise UserError(
            f"mesh sizes {tuple(sizes)} multiply to {math.prod(sizes)}, but there are "
            f"{num_devices} devices; set --config.mesh_data=-1 (or sizes whose product matches)"
        )
    return tuple(sizes)


def make_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over all devices, sized by config.mesh_*."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape((config.mesh_data, config.mesh_fsdp, config.mesh_tensor), len(devices))
    # Auto axes: shardings come from jit in/out_shardings, not from the types of arrays.
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def axis_rules(config: Any) -> tuple[tuple[str, Any], ...]:
    """config.logical_axis_rules as tuples (config.json turns tuples into lists)."""

    def target(t):
        return tuple(t) if isinstance(t, (list, tuple)) else t

    return tuple((str(name), target(t)) for name, t in config.logical_axis_rules)


def state_shardings(mesh: Mesh, abstract_state: Any, rules: Sequence[tuple[str, Any]]) -> Any:
    """A tree of NamedShardings for `abstract_state` (params, optimizer state, RNG state).

    Variables with `logical_axes` (parameters, and Adam moments, which keep the
    parameter's metadata) follow the rules; everything else is replicated.
    """
    specs = partition_specs(abstract_state, rules)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)


def gathered(shardings: Any, axis: str = "fsdp") -> Any:
    """`shardings` (a tree of NamedShardings) with `axis` dropped from every spec: where
    FSDP-sharded parameters are used, whole along that axis (still split over the others).
    """

    def drop(s: NamedSharding) -> NamedSharding:
        def keep(entry):
            names = (entry,) if isinstance(entry, str) else tuple(entry or ())
            rest = tuple(n for n in names if n != axis)
            return rest[0] if len(rest) == 1 else (rest or None)

        return NamedSharding(s.mesh, PartitionSpec(*(keep(e) for e in s.spec)))

    return jax.tree.map(drop, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over the batch axes ('data', 'fsdp'); the other dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_divisor(mesh: Mesh) -> int:
    """Global batch rows must be a multiple of this (the size of the batch axes)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Per-process numpy rows -> global jax.Arrays sharded over the batch axes."""
    return {
        k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)), np.asarray(v))
        for k, v in batch.items()
    }


def split_micro(x: jax.Array, k: int, mesh: Mesh) -> jax.Array:
    """[B, ...] -> [k, B/k, ...], micro-batch j = rows j, j+k, j+2k, ...

    Strided rows keep each micro-batch spread over every data shard, so the
    split needs no communication (a contiguous split would put micro-batch 0
    on the first devices only).
    """
    b = x.shape[0]
    x = x.reshape(b // k, k, *x.shape[1:])  # [B/k, k, ...]
    x = jnp.swapaxes(x, 0, 1)  # [k, B/k, ...]
    spec = PartitionSpec(None, BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

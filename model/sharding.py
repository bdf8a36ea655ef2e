"""Logical axis names for parameters, and their mapping onto mesh axes.

Every parameter is created with `logical_axes=(...)` metadata naming its
dimensions; a rules table (configs: `logical_axis_rules`) maps each name onto
a mesh axis (or None = replicated), as in MaxText.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

EMBED = "embed"  # D
VOCAB = "vocab"  # V
HEADS = "heads"  # N
KV = "kv"  # H (per-head width)
MLP = "mlp"  # F

Rules = Sequence[tuple[str, Any]]


def logical_to_mesh(axes: Sequence[str | None] | None, rules: Rules) -> PartitionSpec:
    """('embed', 'mlp') + rules -> PartitionSpec('fsdp', 'tensor'). Unknown names replicate.

    A mesh axis is used at most once per array: a later dimension that maps to
    an axis already taken is replicated instead.
    """
    if axes is None:
        return PartitionSpec()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        target = table.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        if not targets or used.intersection(targets):
            out.append(None)
            continue
        used.update(targets)
        out.append(targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*out)


def partition_specs(state: Any, rules: Rules) -> Any:
    """Map an `nnx.State` (or any tree of Variables) to PartitionSpecs, same structure.

    Variables without `logical_axes` metadata (RNG keys and counts) replicate.
    """

    def spec(v):
        if isinstance(v, nnx.Variable):
            return v.replace(logical_to_mesh(getattr(v, "logical_axes", None), rules))
        return PartitionSpec()

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))

"""The train state as a few buffers: what the loop passes to, and gets back from, each step.

    layout = BufferLayout.of(jax.tree.leaves(setup.abstract))   # from shapes and shardings
    buffers = layout.pack(leaves)       # inside or outside jit: a few arrays
    leaves = layout.unpack(buffers)     # the same arrays back, bit for bit

A jitted call's host cost grows with the number of arrays it takes and returns:
base's state is 608 arrays, and on an H200 a call of the train step on them
took the host longer than the 8,192-token step computes (docs/training.md),
so the device waited for the host. Packed, the step takes and returns one
buffer per dtype. The leaves that are fully replicated and of a plain dtype
(the params and Adam moments of a data-parallel run) are raveled and
concatenated into one 1-D buffer per dtype; the others (sharded leaves, typed
PRNG keys) are passed as they are. Inside the step, unpacking is a slice and
reshape per leaf, and packing a concatenation into the donated buffer: about
two extra passes over the state's bytes per step (little at an accelerator's
memory bandwidth) and one more state-sized temporary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _packable(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    replicated = sharding is None or sharding.is_fully_replicated
    return replicated and not jnp.issubdtype(leaf.dtype, jax.dtypes.extended)


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """Where each of n leaves lives: group g's buffer at an offset, or alone.

    groups: per buffer, its dtype and the leaves in it (indices, in order).
    shapes: every leaf's shape; loose: the leaves passed as they are.
    """

    groups: tuple[tuple[str, tuple[int, ...]], ...]
    shapes: tuple[tuple[int, ...], ...]
    loose: tuple[int, ...]

    @classmethod
    def of(cls, leaves: Sequence[Any], pack: bool = True) -> BufferLayout:
        """The layout of arrays or ShapeDtypeStructs (with their shardings, if any); with
        pack=False every leaf is loose (the buffers are the leaves)."""
        by_dtype: dict[str, list[int]] = {}
        loose = []
        for i, leaf in enumerate(leaves):
            if pack and _packable(leaf):
                by_dtype.setdefault(str(np.dtype(leaf.dtype)), []).append(i)
            else:
                loose.append(i)
        groups = tuple((d, tuple(ix)) for d, ix in sorted(by_dtype.items()))
        return cls(groups, tuple(tuple(x.shape) for x in leaves), tuple(loose))

    @property
    def num_buffers(self) -> int:
        return len(self.groups) + len(self.loose)

    def pack(self, leaves: Sequence[Any]) -> list[Any]:
        """n leaves -> the buffers: one 1-D array per group, then the loose leaves."""
        out = [jnp.concatenate([jnp.ravel(leaves[i]) for i in ix]) for _, ix in self.groups]
        return out + [leaves[i] for i in self.loose]

    def unpack(self, buffers: Sequence[Any]) -> list[Any]:
        """The buffers -> the n leaves, in their order and shapes."""
        leaves: list[Any] = [None] * len(self.shapes)
        for (_, ix), buffer in zip(self.groups, buffers, strict=False):
            offset = 0
            for i in ix:
                size = math.prod(self.shapes[i])
                leaves[i] = buffer[offset : offset + size].reshape(self.shapes[i])
                offset += size
        for i, leaf in zip(self.loose, buffers[len(self.groups) :], strict=True):
            leaves[i] = leaf
        return leaves

    def shardings(self, leaf_shardings: Sequence[Any], replicated: Any) -> list[Any]:
        """The buffers' shardings: `replicated` for each group, the loose leaves' own."""
        return [replicated] * len(self.groups) + [leaf_shardings[i] for i in self.loose]

"""The Transformer of "Attention Is All You Need" as a reusable Flax NNX library.

from flax import nnx
from attention_jax import Transformer, TransformerConfig

model = Transformer(TransformerConfig(vocab_size=8000), rngs=nnx.Rngs(0))
logits = model(src, tgt_in)  # [B, S], [B, T] int32 -> [B, T, V] float32

The special token ids come from model/tokens.py, which imports nothing; every
other name is loaded on first use (PEP 562), so `import model.tokens` (as data/
does in processes that never start JAX) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

if TYPE_CHECKING:
    from attention_jax.config import TransformerConfig
    from attention_jax.layers import KVCache
    from attention_jax.transformer import DecodeCache, Transformer, shift_right

# name -> the module that defines it
_LAZY = {
    "TransformerConfig": "attention_jax.config",
    "KVCache": "attention_jax.layers",
    "DecodeCache": "attention_jax.transformer",
    "Transformer": "attention_jax.transformer",
    "shift_right": "attention_jax.transformer",
}

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "DecodeCache",
    "KVCache",
    "Transformer",
    "TransformerConfig",
    "shift_right",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")

"""attention_jax: the Transformer of "Attention Is All You Need" in JAX and Flax NNX, its
searches, and translation from Python (docs/library.md).

    from flax import nnx
    from attention_jax import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(vocab_size=8000), rngs=nnx.Rngs(0))
    logits = model(src, tgt_in)  # [B, S], [B, T] int32 -> [B, T, V] float32

    from attention_jax import Translator                  # pip install 'attention-jax[translate]'
    Translator("workdir/tiny").translate(["Das Haus ist klein."])

The package's root modules are the network (config, attention, positional, layers,
transformer); its subpackages the searches (attention_jax.search), the data, training
and decode.py's application. The special token ids come from tokens.py, which
imports nothing; every other name here is loaded on first use (PEP 562), so
`import attention_jax.tokens` (as data/ does in processes that never start JAX) does
not import JAX, and the names of the upper floors (Translator, the searches) load
only when asked for. Type checkers read __init__.pyi, which names where each comes from.
"""

from __future__ import annotations

import importlib

from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

# name -> the module that defines it
_LAZY = {
    "TransformerConfig": "attention_jax.config",
    "Embed": "attention_jax.layers",
    "MultiHeadAttention": "attention_jax.layers",
    "FeedForward": "attention_jax.layers",
    "EncoderLayer": "attention_jax.layers",
    "DecoderLayer": "attention_jax.layers",
    "LayerNorm": "attention_jax.layers",
    "KVCache": "attention_jax.layers",
    "DecodeCache": "attention_jax.decode_cache",
    "Transformer": "attention_jax.transformer",
    "Ensemble": "attention_jax.ensemble",
    "shift_right": "attention_jax.transformer",
    "beam_search": "attention_jax.search.beam",
    "greedy_search": "attention_jax.search.sampling",
    "sample": "attention_jax.search.sampling",
    "SearchSettings": "attention_jax.search.settings",
    "label_smoothed_loss": "attention_jax.training.loss",
    "Translator": "attention_jax.inference.text",
    "TranslationResult": "attention_jax.inference.text",
    "ScoreResult": "attention_jax.inference.text",
}

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "DecodeCache",
    "DecoderLayer",
    "Embed",
    "EncoderLayer",
    "Ensemble",
    "FeedForward",
    "KVCache",
    "LayerNorm",
    "MultiHeadAttention",
    "ScoreResult",
    "SearchSettings",
    "Transformer",
    "TransformerConfig",
    "TranslationResult",
    "Translator",
    "beam_search",
    "greedy_search",
    "label_smoothed_loss",
    "sample",
    "shift_right",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attention_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

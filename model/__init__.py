"""The Transformer of "Attention Is All You Need" as a reusable Flax NNX library.

from flax import nnx
from model import Transformer, TransformerConfig

model = Transformer(TransformerConfig(vocab_size=8000), rngs=nnx.Rngs(0))
logits = model(src, tgt_in)  # [B, S], [B, T] int32 -> [B, T, V] float32
"""

from model.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from model.layers import KVCache
from model.transformer import DecodeCache, Transformer, shift_right

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

"""TransformerConfig: every size and switch of the model, validated once."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attention_jax.tokens import UNK_ID

if TYPE_CHECKING:
    import numpy as np

ACTIVATIONS = ("relu", "gelu", "swish")
NORMS = ("post", "pre")
ATTENTION_IMPLS = ("auto", "xla", "jax", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")
POSITIONS = ("sinusoid", "sinusoid_halves", "table")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of the encoder-decoder Transformer (Vaswani et al., 2017).

    Defaults are Transformer-base (paper Table 3, row "base").
    """

    vocab_size: int  # V: shared source/target vocabulary (paper: ~37000 BPE)
    d_model: int = 512  # D: width of every residual stream
    num_heads: int = 8  # N: attention heads; head dim H = D / N
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048  # F: inner width of the position-wise feed-forward
    dropout_rate: float = 0.1  # P_drop on sub-layer outputs and embeddings + PE
    attention_dropout_rate: float = 0.0  # on attention weights; the paper uses none
    activation: str = "relu"  # feed-forward nonlinearity: 'relu' (paper), 'gelu' or 'swish'
    norm: str = "post"  # 'post': LayerNorm(x + Sublayer(x)) (paper); 'pre': x + Sublayer(LN(x))
    layer_norm_epsilon: float = 1e-6
    share_embeddings: bool = True  # one embedding table for source and target
    tie_output: bool = True  # logits = x @ embedding^T (paper section 3.4)
    max_len: int = 1024  # longest position the sinusoid table covers
    # Given as a name or a dtype, held as a dtype: the computation's (params, softmax,
    # LayerNorm and the loss stay float32) and the stored parameters'.
    dtype: np.dtype | str = "float32"
    param_dtype: np.dtype | str = "float32"
    # 'auto' (cuDNN flash attention on GPUs in bf16/fp16, else 'xla'), 'xla' (einsum),
    # 'jax' (jax.nn.dot_product_attention) or 'cudnn' (force cuDNN; GPU only).
    attention_impl: str = "auto"
    remat: bool = False  # recompute each layer's activations in the backward pass
    # What Marian / OPUS-MT models need (backends/marian.py); off, the paper's model.
    attention_bias: bool = False  # biases on W^Q, W^K, W^V and W^O
    logits_bias: bool = False  # a bias [V] added to the output logits
    # 'sinusoid' (paper 3.5: sines and cosines interleaved), 'sinusoid_halves' (Marian's:
    # the sines in the first half of the dimensions, the cosines in the second), or
    # 'table': a stored [max_len, D] parameter, initialized as 'sinusoid' (Marian's Wpos).
    positions: str = "sinusoid"
    zero_start: bool = False  # the decoder's first input is a zero vector, not BOS's embedding

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "d_model",
            "num_heads",
            "num_encoder_layers",
            "num_decoder_layers",
            "d_ff",
            "max_len",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"TransformerConfig.d_model ({self.d_model}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.vocab_size <= UNK_ID:
            raise ValueError(
                f"TransformerConfig.vocab_size must exceed the {UNK_ID + 1} special ids, "
                f"got {self.vocab_size}"
            )
        for name in ("dropout_rate", "attention_dropout_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"TransformerConfig.{name} must be in [0, 1), got {rate!r}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(
                f"TransformerConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}"
            )
        choices = {
            "activation": ACTIVATIONS,
            "norm": NORMS,
            "attention_impl": ATTENTION_IMPLS,
            "positions": POSITIONS,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"TransformerConfig.{name} must be one of {allowed}, got {value!r}"
                )
        for name in ("dtype", "param_dtype"):
            object.__setattr__(self, name, _as_dtype(name, getattr(self, name)))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values (dtypes by name): what `from_dict` reads back."""
        d = dataclasses.asdict(self)
        return {**d, "dtype": self.dtype.name, "param_dtype": self.param_dtype.name}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransformerConfig:
        """Build from a mapping (e.g. `config.model` plus `vocab_size`); unknown keys are errors."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"Unknown TransformerConfig field(s) {unknown}; known fields: {sorted(names)}"
            )
        return cls(**d)


def _as_dtype(name: str, value: Any) -> np.dtype:
    import jax.numpy as jnp  # here: the configs read this module before JAX loads

    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in DTYPES:
        raise ValueError(f"TransformerConfig.{name} must be one of {DTYPES}, got {value!r}")
    return dtype

"""Training: config checks, sharded train step, optimizer, Orbax checkpoints, evaluation,
metrics, the label-smoothed loss. Used by train.py; a trained model is read back by
training/workdir.py (decode.py's one door into training/).

    from attention_jax.training import train_and_evaluate
    summary = train_and_evaluate(config, workdir)

Importing this package loads nothing: each name is loaded on first use (PEP 562), so
training/loss.py (JAX alone) needs none of training's other dependencies.
"""

import importlib

# name -> the module that defines it
_LAZY = {
    "load_config": "attention_jax.training.config",
    "model_config": "attention_jax.training.config",
    "validate": "attention_jax.training.config",
    "train_and_evaluate": "attention_jax.training.loop",
}

__all__ = [
    "load_config",
    "model_config",
    "train_and_evaluate",
    "validate",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attention_jax.training' has no attribute {name!r}")

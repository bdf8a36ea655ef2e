"""Training: config checks, sharded train step, optimizer, Orbax checkpoints, evaluation,
metrics. Used by train.py from a checkout (not installed as a package); a trained
model is read back by training/workdir.py (decode.py's one door into training/).

    from attention_jax.training import train_and_evaluate
    summary = train_and_evaluate(config, workdir)
"""

from attention_jax.training.config import load_config, model_config, validate
from attention_jax.training.loop import train_and_evaluate

__all__ = [
    "load_config",
    "model_config",
    "train_and_evaluate",
    "validate",
]

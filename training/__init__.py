"""Training: config checks, sharded train step, optimizer, Orbax checkpoints, evaluation,
metrics. Used by train.py from a checkout (not installed as a package); a trained
model is read back by training/workdir.py (decode.py's one door into training/).

    from training import train_and_evaluate
    summary = train_and_evaluate(config, workdir)
"""

from training.config import load_config, model_config, validate
from training.loop import train_and_evaluate

__all__ = [
    "load_config",
    "model_config",
    "train_and_evaluate",
    "validate",
]

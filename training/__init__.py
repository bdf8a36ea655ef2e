"""Training: config checks, sharded train step, optimizer, Orbax checkpoints, evaluation,
metrics. Used by train.py and decode.py from a checkout (not installed as a package).

    from training import train_and_evaluate, restore_model
    summary = train_and_evaluate(config, workdir)
    model, config, step = restore_model(workdir, average_last=5)
"""

from training.checkpoints import restore_model
from training.config import load_config, model_config, validate
from training.errors import TrainingError
from training.loop import train_and_evaluate

__all__ = [
    "TrainingError",
    "load_config",
    "model_config",
    "restore_model",
    "train_and_evaluate",
    "validate",
]

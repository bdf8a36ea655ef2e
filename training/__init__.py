"""Training: sharded train step, optimizer, Orbax checkpoints, evaluation, metrics.

from training import train_and_evaluate, restore_model
summary = train_and_evaluate(config, workdir)
model, config, step = restore_model(workdir, average_last=5)
"""

from training.checkpoints import load_config, model_config, restore_model
from training.errors import TrainingError
from training.loop import train_and_evaluate

__all__ = [
    "TrainingError",
    "load_config",
    "model_config",
    "restore_model",
    "train_and_evaluate",
]

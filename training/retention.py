"""Which checkpoints train.py keeps: the last N, and the one of the best dev evaluation.

    options = manager_options(max_to_keep=5, best_metric="chrf", create=True, trash="deleted")

Orbax's preservation policies decide (`LatestN` and `BestN`, either keeps a step),
over the dev metrics stored with each evaluated checkpoint (training/checkpoints.py
`Checkpoints.save`); `config.best_metric` names the one ranked (`BEST_METRICS`).
"""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp

# config.best_metric -> (the dev metric, which way is better)
BEST_METRICS = {
    "chrf": ("eval_chrf", "max"),
    "bleu": ("eval_bleu", "max"),
    "loss": ("eval_loss", "min"),
}


def rank(best_metric: str) -> Any:
    """metrics -> the sort key Orbax ranks checkpoints by (the larger, the better kept):
    the metric (worst for a checkpoint saved without an evaluation), then the earlier
    step among equal ones, as the first to reach a value is the best in training."""
    key, mode = BEST_METRICS[best_metric]
    sign = 1.0 if mode == "max" else -1.0
    return lambda metrics: (sign * metrics.get(key, -sign * float("inf")), -metrics["step"])


def manager_options(
    max_to_keep: int | None, best_metric: str | None, create: bool, trash: str
) -> Any:
    """Orbax's options: the last `max_to_keep` checkpoints (None: all), and with a
    best_metric the best evaluated one too; old steps leave through the folder `trash`."""
    common = dict(create=create, enable_async_checkpointing=True, todelete_subdir=trash)
    if best_metric is None:
        return ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, **common)
    policies = ocp.checkpoint_managers
    keep = policies.AnyPreservationPolicy(
        [
            policies.LatestN(n=max_to_keep),
            policies.BestN(get_metric_fn=rank(best_metric), n=1,
                           keep_checkpoints_without_metrics=False),
        ]
    )  # fmt: skip
    return ocp.CheckpointManagerOptions(
        best_fn=rank(best_metric), best_mode="max", preservation_policy=keep, **common
    )

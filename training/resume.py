"""Starting a run: the newest usable checkpoint of the workdir and its data position, or
a fresh state.

    previous = previous_run(config, workdir)     # before the data: a changed model stops here
    state, totals = restore_or_init(config, workdir, setup, checkpoints, inputs, previous)

A checkpoint whose model or optimizer structure differs from the config's stops
the run with the fields named (`--config.reset_optimizer=True` keeps the
parameters and starts a fresh optimizer state); damaged ones are skipped by
`Checkpoints.restore_latest`; a workdir that had checkpoints but has no usable
one is an error unless `config.allow_fresh_start`. metrics.jsonl loses the rows
after the step resumed from (they are trained again).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from attention_jax.data import atomic_write
from attention_jax.runtime.errors import UserError
from attention_jax.training import checkpoints as ckpt
from attention_jax.training import config as config_lib
from attention_jax.training import init_from, metrics, retention, steps
from attention_jax.training.input import ShardedInput

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunTotals:
    """Totals over every run of a workdir, kept in each checkpoint's `data` item."""

    tokens_seen: int = 0  # target tokens trained on (all processes)
    train_seconds: float = 0.0  # wall time in train steps (evaluation excluded)
    nonfinite_steps: int = 0  # updates skipped for a NaN/Inf loss or gradient
    best: float | None = None  # the best dev value of config.best_metric so far ...
    best_step: int | None = None  # ... the step it was measured at ...
    evals_since_best: int = 0  # ... and the evaluations since, none better (early stopping)

    @classmethod
    def from_checkpoint(cls, data_state: dict[str, Any]) -> RunTotals:
        """The totals a checkpoint holds (a field it predates: its default)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: data_state[k] for k in names if k in data_state})

    def evaluated(self, best_metric: str, metrics: dict[str, Any], step: int) -> bool:
        """Count a dev evaluation at `step`: whether it is a new best (strictly better)."""
        key, mode = retention.BEST_METRICS[best_metric]
        value = float(metrics[key])
        better = self.best is None or (value > self.best if mode == "max" else value < self.best)
        if better:
            self.best, self.best_step, self.evals_since_best = value, step, 0
        else:
            self.evals_since_best += 1
        return better


def _step_dirs(workdir: str, subdir: str = ckpt.CHECKPOINT_DIR) -> list[str]:
    """Finalized checkpoint step directories (Orbax names them by the step number;
    unfinished saves have a `.orbax-checkpoint-tmp` suffix; damaged ones `STEP.TIME`)."""
    directory = os.path.join(workdir, subdir)
    if not os.path.isdir(directory):
        return []
    return [d for d in os.listdir(directory) if d.split(".")[0].isdigit() and "tmp" not in d]


def previous_run(config: ml_collections.ConfigDict, workdir: str) -> dict | None:
    """None for a workdir without checkpoints (on disk, or damaged ones moved aside by an
    earlier run); else the config's changes since the run that wrote them (UserError
    for a changed model: `config_lib.check_resume`)."""
    if not (_step_dirs(workdir) or _step_dirs(workdir, ckpt.DAMAGED_DIR)):
        return None
    return config_lib.check_resume(config, workdir)


def _trim_metrics(workdir: str, last_step: int) -> None:
    """Drop metrics.jsonl rows after the checkpoint being resumed (they will be redone)."""
    path = os.path.join(workdir, metrics.METRICS_FILE)
    if jax.process_index() != 0 or not os.path.isfile(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    with atomic_write(path, "w") as f:
        f.writelines(rows)


def _fresh_optimizer(setup: steps.TrainSetup, state: steps.TrainState) -> steps.TrainState:
    """`state` with a new optimizer state: Adam moments zero, update counts at state.step
    (the learning-rate schedule goes on where it was, as fairseq's --reset-optimizer)."""

    def init(params, step):
        opt_state = setup.tx.init(params)
        is_count = lambda path: path and getattr(path[-1], "name", None) == "count"
        return jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.full_like(x, step) if is_count(path) else x, opt_state
        )

    opt_state = jax.jit(init, out_shardings=setup.shardings.opt_state)(state.params, state.step)
    return state.replace(opt_state=opt_state)


def _mismatch_message(e: ckpt.StructureMismatch, changes: dict, workdir: str) -> str:
    details = "; ".join(d for ds in e.items.values() for d in ds)
    if "params" in e.items:
        changed = config_lib.describe(changes, config_lib.MODEL_STRUCTURE) or details
        return (
            f"checkpoint step {e.step} in {workdir} holds other parameters than this config's "
            f"model ({changed}). Use the same model settings to resume, or a fresh --workdir "
            "for a new model; the checkpoints were not touched"
        )
    changed = config_lib.describe(changes, config_lib.OPTIMIZER_STRUCTURE) or details
    return (
        f"the optimizer state in checkpoint step {e.step} of {workdir} has another structure "
        f"than this config's optimizer ({changed}). Re-run with --config.reset_optimizer=True "
        "to keep the parameters and start a fresh optimizer state, or undo the change; the "
        "checkpoints were not touched"
    )


def restore_or_init(
    config: ml_collections.ConfigDict,
    workdir: str,
    setup: steps.TrainSetup,
    checkpoints: ckpt.Checkpoints,
    train_iter: ShardedInput,
    previous: dict | None,
) -> tuple[steps.TrainState, RunTotals]:
    """The newest usable checkpoint (and the data position it saved), or a fresh state.

    `previous`: what `previous_run` said before the data was loaded.
    """
    changes = previous or {}
    try:
        restored = checkpoints.restore_latest(setup.abstract)
    except ckpt.StructureMismatch as e:
        if set(e.items) != {"train"} or not config.reset_optimizer:
            raise UserError(_mismatch_message(e, changes, workdir)) from e
        state, data_state = checkpoints.restore_without_optimizer(e.step, setup.abstract)
        restored = e.step, _fresh_optimizer(setup, state), data_state
        _log.warning(
            f"config.reset_optimizer: kept the parameters of step {e.step} and started a fresh "
            "optimizer state (Adam moments zero, the learning-rate schedule where it was)"
        )
    except UserError:
        if not config.allow_fresh_start:
            raise
        _log.warning("no usable checkpoint; config.allow_fresh_start: training from scratch")
        restored = None
    if restored is None and previous is not None and not config.allow_fresh_start:
        raise UserError(  # e.g. every step directory deleted between listing and restoring
            f"{workdir} had checkpoints but none is usable (damaged ones are in "
            f"{os.path.join(workdir, ckpt.DAMAGED_DIR)}); restore them from a backup, or pass "
            "--config.allow_fresh_start=True to train from scratch in this workdir"
        )
    if restored is None:
        _trim_metrics(workdir, -1)  # rows of a run killed before its first checkpoint
        state = steps.init_train_state(setup)
        if config.init_from:
            state = init_from.with_imported_params(state, setup)
        return state, RunTotals()
    latest, state, data_state = restored
    saved = data_state["iterators"]
    if not train_iter.set_global_state(saved):
        _log.warning(
            f"the checkpoint has {len(saved)} data shard(s), this run reads "
            f"{train_iter.num_shards}: the data order differs from an uninterrupted run "
            f"(set --config.data_shards={len(saved)} to resume it exactly)"
        )
    _trim_metrics(workdir, latest)
    _log.info(f"resumed from step {latest} ({checkpoints.directory})")
    return state, RunTotals.from_checkpoint(data_state)

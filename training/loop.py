"""`train_and_evaluate(config, workdir)`: the whole training job, top to bottom.

Sections: setup -> data -> mesh, model and optimizer (born sharded, or restored)
-> compiled steps -> the loop (log, checkpoint, evaluate, stop on a signal)
-> final evaluation and summary.

Re-running with the same workdir resumes from the newest complete checkpoint:
params, optimizer state, step, dropout RNG streams and the data position all
come back, so the run continues exactly as if it had never stopped. A damaged
checkpoint is skipped (with a warning) for the one before it; a workdir whose
checkpoints are all unusable is an error, not a silent fresh start.

Multi-process: every process runs this function (same config, same workdir on
shared storage); each reads its data shard, all take part in each compiled
step and checkpoint, and only process 0 writes logs, metrics and config.json.
SIGTERM or SIGINT to any process stops all of them at the same step with one
cooperative checkpoint (JAX's preemption service); a process that dies makes
the others stop within config.peer_timeout_seconds with a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

import data
from data.files import atomic_write
from training import checkpoints as ckpt
from training import config as config_lib
from training import distributed, evaluate, log, metrics, steps
from training.errors import TrainingError
from training.input import ShardedInput
from training.mesh import batch_divisor, make_mesh, shard_batch

_log = logging.getLogger(__name__)


# --- Setup --------------------------------------------------------------------------


def _check_writable(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-test-{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise TrainingError(
            f"workdir {workdir!r} is not writable ({e}); pick another --workdir or fix its "
            "permissions/free space"
        ) from e


def _step_dirs(workdir: str, subdir: str = ckpt.CHECKPOINT_DIR) -> list[str]:
    """Finalized checkpoint step directories (Orbax names them by the step number;
    unfinished saves have a `.orbax-checkpoint-tmp` suffix; damaged ones `STEP.TIME`)."""
    directory = os.path.join(workdir, subdir)
    if not os.path.isdir(directory):
        return []
    return [d for d in os.listdir(directory) if d.split(".")[0].isdigit() and "tmp" not in d]


def _trim_metrics(workdir: str, last_step: int) -> None:
    """Drop metrics.jsonl rows after the checkpoint being resumed (they will be redone)."""
    path = os.path.join(workdir, metrics.METRICS_FILE)
    if jax.process_index() != 0 or not os.path.isfile(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    with atomic_write(path, "w") as f:
        f.writelines(rows)


def _due(step: int, every: int, total: int) -> bool:
    """Is it time for a periodic action (0 = never)? The last step has its own."""
    return every > 0 and step % every == 0 and step < total


@dataclasses.dataclass
class RunTotals:
    """Totals over every run of a workdir, kept in each checkpoint's `data` item."""

    tokens_seen: int = 0  # target tokens trained on (all processes)
    train_seconds: float = 0.0  # wall time in train steps (evaluation excluded)
    nonfinite_steps: int = 0  # updates skipped for a NaN/Inf loss or gradient

    @classmethod
    def from_checkpoint(cls, data_state: dict[str, Any]) -> RunTotals:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: data_state[k] for k in names})


# --- The run: everything the loop touches besides the state ------------------------------


@dataclasses.dataclass
class _Run:
    setup: steps.TrainSetup
    tokenizer: data.Tokenizer
    dev: Any
    train_iter: ShardedInput
    manager: ckpt.Checkpoints
    writer: metrics.MetricWriter
    progress: metrics.Progress
    eval_step: Any
    totals: RunTotals
    window: metrics.TrainWindow
    nonfinite: metrics.NonFinite
    train_loss: float | None = None  # of the last logged window
    best_bleu: float | None = None
    last_saved: int = 0  # step of the newest checkpoint, and when it was started
    saved_at: float = dataclasses.field(default_factory=time.time)

    @classmethod
    def start(
        cls,
        workdir: str,
        setup: steps.TrainSetup,
        tokenizer: data.Tokenizer,
        dev: Any,
        train_iter: ShardedInput,
        manager: ckpt.Checkpoints,
        eval_step: Any,
        totals: RunTotals,
        step: int,
    ) -> _Run:
        """The bookkeeping of a run that starts at `step` (outputs written by process 0)."""
        config, is_main = setup.config, jax.process_index() == 0
        window = metrics.TrainWindow(
            config_lib.model_config(config),
            metrics.peak_flops_per_device(config),
            jax.device_count(),
        )
        nonfinite = metrics.NonFinite(
            config.nonfinite_policy, config.max_consecutive_nonfinite, totals.nonfinite_steps
        )
        writer = metrics.MetricWriter(workdir, enabled=is_main)
        progress = metrics.Progress(config.num_train_steps, step, enabled=is_main)
        return cls(
            setup, tokenizer, dev, train_iter, manager, writer, progress, eval_step, totals,
            window, nonfinite, last_saved=step,
        )  # fmt: skip

    def flush(self, step: int, *, log_row: bool = True) -> None:
        """Close the metrics window at `step`: add it to the totals, apply the non-finite
        policy (TrainingError), and write its row to metrics.jsonl and the progress line."""
        fetched, row = self.window.flush()
        self.totals.tokens_seen += row.pop("tokens")
        self.totals.train_seconds += row.pop("seconds")
        error = self.nonfinite.check(fetched, step, self.manager.latest_step())
        self.totals.nonfinite_steps = self.nonfinite.total
        if log_row:
            row["nonfinite_steps"] = self.nonfinite.total
            self.writer.write(step, row)
            self.progress.update(step, row)
            self.train_loss = row["train_loss"]
        if error:
            raise TrainingError(error)

    def save_due(self, step: int, total: int) -> bool:
        """Every checkpoint_every_steps, or checkpoint_every_minutes after the last save.

        Time is looked at on log steps only, and any process's clock decides for
        all of them (one small collective), so every process saves at the same step.
        """
        config = self.setup.config
        if _due(step, config.checkpoint_every_steps, total):
            return True
        if not config.checkpoint_every_minutes or step % config.log_every_steps or step >= total:
            return False
        late = time.time() - self.saved_at >= 60 * config.checkpoint_every_minutes
        return any(distributed.allgather_json(late))

    def save(self, state: steps.TrainState, step: int) -> None:
        """Checkpoint `state`, every shard's data position (a collective) and the totals."""
        if self.nonfinite.policy == "stop":  # never checkpoint past a non-finite step
            error = self.nonfinite.check(self.window.fetch(), step, self.manager.latest_step())
            if error:
                raise TrainingError(error)
        position = {"iterators": self.train_iter.global_state()}
        self.manager.save(state, {**position, **dataclasses.asdict(self.totals)})
        self.last_saved, self.saved_at = step, time.time()

    def evaluate(self, state: steps.TrainState, step: int, max_examples: int) -> dict[str, Any]:
        ev, examples = evaluate.evaluate(
            state, self.setup, self.eval_step, self.tokenizer, self.dev, max_examples=max_examples
        )
        self.writer.write(step, {k: v for k, v in ev.items() if k != "bleu_signature"})
        self.progress.write(evaluate.report(step, ev, examples))
        self.best_bleu = max(self.best_bleu or 0.0, ev["eval_bleu"])
        self.window.restart_clock()  # evaluation time is not training time
        return ev

    def evaluate_average(
        self, state: steps.TrainState, step: int, n: int, max_examples: int
    ) -> dict[str, Any] | None:
        """Evaluate the mean parameters of the last n checkpoints (paper 6.1); None if < 2."""
        self.manager.wait()
        chosen = self.manager.all_steps()[-n:]
        if len(chosen) < 2:
            _log.info(f"config.average_last={n}: only {len(chosen)} checkpoint, nothing to average")
            return None
        params = self.manager.mean_params(chosen, self.setup.abstract.params)
        ev, examples = evaluate.evaluate(
            state.replace(params=params),
            self.setup,
            self.eval_step,
            self.tokenizer,
            self.dev,
            max_examples=max_examples,
        )
        ev["eval_checkpoints_averaged"] = len(chosen)
        row = {f"avg_{k}": v for k, v in ev.items() if k != "bleu_signature"}
        self.writer.write(step, row)
        self.progress.write(
            f"average of the last {len(chosen)} checkpoints (steps {chosen[0]}..{chosen[-1]}):\n"
            + evaluate.report(step, ev, examples)
        )
        self.best_bleu = max(self.best_bleu or 0.0, ev["eval_bleu"])
        return ev


def _tokenizer(config: ml_collections.ConfigDict, workdir: str, corpus: Any) -> data.Tokenizer:
    """WORKDIR/tokenizer.model: process 0 trains it if missing, the others then load it."""
    if jax.process_index() == 0:
        tokenizer = data.get_tokenizer(config, workdir, corpus)
    distributed.sync("tokenizer")
    if jax.process_index() != 0:
        tokenizer = data.get_tokenizer(config, workdir, corpus)
    return tokenizer


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


def _restore_or_init(
    config: ml_collections.ConfigDict,
    workdir: str,
    setup: steps.TrainSetup,
    manager: ckpt.Checkpoints,
    train_iter: ShardedInput,
    had_checkpoints: bool,
    changes: dict,
) -> tuple[steps.TrainState, RunTotals]:
    """The newest usable checkpoint (and the data position it saved), or a fresh state."""
    try:
        restored = manager.restore_latest(setup.abstract)
    except ckpt.StructureMismatch as e:
        if set(e.items) != {"train"} or not config.reset_optimizer:
            raise TrainingError(_mismatch_message(e, changes, workdir)) from e
        state, data_state = manager.restore_without_optimizer(e.step, setup.abstract)
        restored = e.step, _fresh_optimizer(setup, state), data_state
        _log.warning(
            f"config.reset_optimizer: kept the parameters of step {e.step} and started a fresh "
            "optimizer state (Adam moments zero, the learning-rate schedule where it was)"
        )
    except TrainingError:
        if not config.allow_fresh_start:
            raise
        _log.warning("no usable checkpoint; config.allow_fresh_start: training from scratch")
        restored = None
    if restored is None and had_checkpoints and not config.allow_fresh_start:
        raise TrainingError(  # e.g. every step directory deleted between listing and restoring
            f"{workdir} had checkpoints but none is usable (damaged ones are in "
            f"{os.path.join(workdir, ckpt.DAMAGED_DIR)}); restore them from a backup, or pass "
            "--config.allow_fresh_start=True to train from scratch in this workdir"
        )
    if restored is None:
        _trim_metrics(workdir, 0)  # rows of a run killed before its first checkpoint
        return steps.init_train_state(setup), RunTotals()
    latest, state, data_state = restored
    saved = data_state["iterators"]
    if not train_iter.set_global_state(saved):
        _log.warning(
            f"the checkpoint has {len(saved)} data shard(s), this run reads "
            f"{train_iter.num_shards}: the data order differs from an uninterrupted run "
            f"(set --config.data_shards={len(saved)} to resume it exactly)"
        )
    _trim_metrics(workdir, latest)
    _log.info(f"resumed from step {latest} ({manager.directory})")
    return state, RunTotals.from_checkpoint(data_state)


# --- The job ------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Train `config` into `workdir` (resuming if it holds a checkpoint); return a summary.

    Summary keys: step, preempted, train_loss, best_eval_bleu, final eval metrics
    (eval_loss, eval_bleu, eval_chrf, ...), tokens_seen, train_seconds, total_seconds.
    """
    t_start = time.time()
    log.setup()
    config_lib.validate(config)
    is_main = jax.process_index() == 0
    _check_writable(workdir)
    # Checkpoint steps on disk, or damaged ones moved aside by an earlier run.
    had_checkpoints = bool(_step_dirs(workdir)) or bool(_step_dirs(workdir, ckpt.DAMAGED_DIR))
    changes = config_lib.check_resume(config, workdir) if had_checkpoints else {}

    # --- Data ------------------------------------------------------------------------
    train_corpus, dev = data.load_split(config, "train"), data.load_split(config, "dev")
    tokenizer = _tokenizer(config, workdir, train_corpus)

    # --- Mesh, model and optimizer -------------------------------------------------------
    mesh = make_mesh(config)
    setup = steps.train_setup(config, mesh)
    num_params = sum(x.size for x in jax.tree.leaves(setup.abstract.params))
    _log.info(f"mesh {dict(mesh.shape)}, {num_params / 1e6:.2f}M params, {jax.default_backend()}")
    rows_multiple = batch_divisor(mesh) * config.grad_accum_steps  # rows of the global batch
    train_iter = ShardedInput(
        config, tokenizer, train_corpus, global_multiple=rows_multiple, workdir=workdir
    )
    keep = config.max_checkpoints_to_keep and max(
        config.max_checkpoints_to_keep, config.average_last
    )
    manager = ckpt.Checkpoints(workdir, max_to_keep=keep or None)
    state, totals = _restore_or_init(
        config, workdir, setup, manager, train_iter, had_checkpoints, changes
    )
    if is_main:
        config_lib.save_config(config, workdir)

    # --- Compiled steps ----------------------------------------------------------------
    train_step, eval_step = steps.make_train_step(setup), steps.make_eval_step(setup)

    # --- Loop --------------------------------------------------------------------------
    total, step = config.num_train_steps, int(jax.device_get(state.step))
    start = step
    run = _Run.start(workdir, setup, tokenizer, dev, train_iter, manager, eval_step, totals, step)
    preempted = False
    stop = distributed.StopRequest()
    with stop, distributed.PeerWatchdog(config.peer_timeout_seconds), manager:
        batches = iter(train_iter)
        while step < total:
            batch = next(batches)
            state, step_metrics = train_step(state, shard_batch(batch, mesh))
            step += 1
            run.window.add(step_metrics, batch["src"].shape[1], batch["tgt_out"].shape[1])
            if step % config.log_every_steps == 0 or step == total:
                run.flush(step)
            if run.save_due(step, total):
                run.save(state, step)
            if _due(step, config.eval_every_steps, total):
                run.evaluate(state, step, config.eval_max_examples)
            if stop.reached(step):
                preempted = True
                if run.window.steps:  # a window cut short: its tokens and time still count
                    run.flush(step, log_row=False)
                break
        if run.last_saved != step:
            run.save(state, step)
        summary: dict[str, Any] = {"preempted": preempted, "train_loss": run.train_loss}
        if not preempted:  # --- Final evaluation: the last state, and the average -------
            summary.update(run.evaluate(state, step, config.final_eval_max_examples))
            if config.average_last > 1:
                summary["average"] = run.evaluate_average(
                    state, step, config.average_last, config.final_eval_max_examples
                )
    run.progress.close()

    # --- Summary ---------------------------------------------------------------------------
    if preempted:
        _log.info(
            f"{stop.describe()}: saved a checkpoint at step {step}; re-run the same command "
            "to resume"
        )
    run.writer.close()
    summary.update(
        step=step,
        best_eval_bleu=run.best_bleu,
        tokens_seen=totals.tokens_seen,
        train_seconds=totals.train_seconds,
        total_seconds=time.time() - t_start,
        data=train_iter.stats(),
    )
    _log.info(
        f"done: step {step} ({step - start} this run), {totals.tokens_seen / 1e6:.2f}M target "
        f"tokens in {totals.train_seconds / 60:.1f} min of training "
        f"({summary['total_seconds'] / 60:.1f} min total); best dev BLEU "
        + ("-" if run.best_bleu is None else f"{run.best_bleu:.2f}")
    )
    return summary

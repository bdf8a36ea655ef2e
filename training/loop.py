"""`train_and_evaluate(config, workdir)`: the whole training job, top to bottom.

Sections: setup -> data -> mesh, model and optimizer (born sharded, or restored:
training/resume.py) -> compiled steps -> the loop -> final evaluation and summary.
The loop is a list of "is it time?" questions, each answered by the part of the
run that owns the answer:

    _Training     the state and the train step; each log window's metrics, the
                  non-finite policy, and the totals over every run of the workdir
    _Evaluation   dev loss, BLEU and examples (training/evaluate.py), of the state or
                  of the mean of the last checkpoints
    _Saving       when to checkpoint (every N steps or minutes), the checkpoint, and
                  when to stop (SIGTERM/SIGINT on any process)

Re-running with the same workdir resumes from the newest complete checkpoint:
params, optimizer state, step, dropout RNG streams and the data position all
come back, so the run continues exactly as if it had never stopped.

Multi-process: every process runs this function (same config, same workdir on
shared storage); each reads its data shard, all take part in each compiled
step and checkpoint, and only process 0 writes logs, metrics and config.json.
A process that dies makes the others stop within config.peer_timeout_seconds
with a clear error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from attention_jax import data
from attention_jax.runtime import distributed, log
from attention_jax.runtime.errors import UserError
from attention_jax.training import checkpoints as ckpt
from attention_jax.training import config as config_lib
from attention_jax.training import evaluate, init_from, metrics, retention, steps
from attention_jax.training.input import ShardedInput
from attention_jax.training.mesh import batch_divisor, make_mesh, shard_batch
from attention_jax.training.resume import RunTotals, previous_run, restore_or_init
from attention_jax.training.state_buffers import BufferLayout

_log = logging.getLogger(__name__)


def _due(step: int, every: int, total: int) -> bool:
    """Is it time for a periodic action (0 = never)? The last step has its own."""
    return every > 0 and step % every == 0 and step < total


# --- The parts of a run ------------------------------------------------------------------


class _Training:
    """The train state and step, and what the steps report: the metrics window, the
    non-finite policy and the run totals (written to metrics.jsonl by process 0)."""

    def __init__(self, setup, state, totals: RunTotals, writer, progress, newest_checkpoint):
        config = setup.config
        # The state lives packed in a few buffers: a step's call costs a fraction of the
        # host time it costs on the state's hundreds of arrays (training/state_buffers.py).
        leaves, treedef = jax.tree.flatten(state)
        layout = BufferLayout.of(leaves, pack=config.state_buffers)
        buffered = steps.make_buffered_steps(setup, treedef, layout)
        self.buffers = buffered.pack(state) if layout.groups else leaves  # none packed: no copy
        del state, leaves  # the buffers hold the state from here on
        self.train_step, self.unpack, self.totals = buffered.step, buffered.unpack, totals
        self.writer, self.progress, self.newest_checkpoint = writer, progress, newest_checkpoint
        peak = metrics.peak_flops_per_device(config)
        self.window = metrics.TrainWindow(setup.model_config, peak, jax.device_count())
        self.nonfinite = metrics.NonFinite(
            config.nonfinite_policy, config.max_consecutive_nonfinite, totals.nonfinite_steps
        )
        self.train_loss: float | None = None  # of the last logged window

    @property
    def state(self) -> steps.TrainState:
        """The train state (a copy; its buffers go on to the next step)."""
        return self.unpack(self.buffers)

    def step(self, batches: Iterator[dict[str, Any]], mesh: jax.sharding.Mesh) -> None:
        """One train step on the next batch; the host's time by part goes to the window."""
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        placed = shard_batch(batch, mesh)
        t2 = time.perf_counter()
        self.buffers, step_metrics = self.train_step(self.buffers, placed)
        t3 = time.perf_counter()
        for part, seconds in (("input", t1 - t0), ("put", t2 - t1), ("dispatch", t3 - t2)):
            self.window.time(part, seconds)
        self.window.add(step_metrics, batch["src"].shape[1], batch["tgt_out"].shape[1])
        self.window.wait()  # bounded: a SIGTERM waits for at most RUN_AHEAD_SECONDS of steps

    def nonfinite_error(self, step: int) -> str | None:
        """The non-finite policy over the window's steps not checked yet: the error to stop
        with, or None (a 'skip' is counted and warned about)."""
        error = self.nonfinite.check(self.window.fetch(), step, self.newest_checkpoint())
        self.totals.nonfinite_steps = self.nonfinite.total
        return error

    def flush(self, step: int, *, log_row: bool = True) -> None:
        """Close the metrics window at `step`: add it to the totals, write its row to
        metrics.jsonl and the progress line, then stop on a non-finite step (UserError)."""
        error = self.nonfinite_error(step)
        _, row = self.window.flush()
        self.totals.tokens_seen += row.pop("tokens")
        self.totals.train_seconds += row.pop("seconds")
        if log_row:
            row["nonfinite_steps"] = self.nonfinite.total
            self.writer.write(step, row)
            self.progress.update(step, row)
            self.train_loss = row["train_loss"]
        if error:
            raise UserError(error)


class _Evaluation:
    """Dev-set evaluation of a state, written to metrics.jsonl and the log."""

    def __init__(self, setup, eval_step, tokenizer: data.Tokenizer, dev: Any, writer, progress):
        self.setup, self.eval_step, self.tokenizer, self.dev = setup, eval_step, tokenizer, dev
        self.writer, self.progress = writer, progress
        self.best_bleu: float | None = None

    def is_best(self, totals: RunTotals, metrics: dict[str, Any], step: int) -> bool:
        """Count the evaluation `metrics` of `step` in `totals` (config.best_metric's best,
        and the evaluations since): whether it is a new best. Process 0's metrics decide,
        so that every process keeps and stops at the same step."""
        key, _ = retention.BEST_METRICS[self.setup.config.best_metric]
        value = distributed.allgather_json(float(metrics[key]))[0]
        return totals.evaluated(self.setup.config.best_metric, {key: value}, step)

    def patience_spent(self, totals: RunTotals) -> str | None:
        """Why training stops early (config.early_stop_patience evaluations in a row without
        a better best_metric), or None."""
        patience = self.setup.config.early_stop_patience
        if not patience or totals.evals_since_best < patience:
            return None
        name = self.setup.config.best_metric
        return (
            f"early stop: dev {name} has not improved on {totals.best:.4g} (step "
            f"{totals.best_step}) in {totals.evals_since_best} evaluations "
            f"(config.early_stop_patience={patience}); decode.py --checkpoint=best decodes "
            f"step {totals.best_step}"
        )

    def run(
        self, state: steps.TrainState, step: int, max_examples: int, averaged: list[int] = ()
    ) -> dict[str, Any]:
        """Evaluate `state` (the parameters of the checkpoints `averaged`, if given) on the
        first `max_examples` dev pairs (0 = all); returns the metrics."""
        ev, examples = evaluate.evaluate(
            state, self.setup, self.eval_step, self.tokenizer, self.dev, max_examples=max_examples
        )
        report, prefix = evaluate.report(step, ev, examples), ""
        if averaged:
            ev["eval_checkpoints_averaged"] = len(averaged)
            report = (
                f"average of the last {len(averaged)} checkpoints (steps {averaged[0]}.."
                f"{averaged[-1]}):\n{report}"
            )
            prefix = "avg_"
        self.writer.write(step, {prefix + k: v for k, v in ev.items() if k != "bleu_signature"})
        self.progress.write(report)
        self.best_bleu = max(self.best_bleu or 0.0, ev["eval_bleu"])
        return ev

    def run_average(self, training: _Training, checkpoints: ckpt.Checkpoints, step: int, n: int):
        """Evaluate the mean parameters of the last n checkpoints (paper 6.1); None if < 2."""
        checkpoints.wait()
        chosen = checkpoints.all_steps()[-n:]
        if len(chosen) < 2:
            _log.info(f"config.average_last={n}: only {len(chosen)} checkpoint, nothing to average")
            return None
        params = checkpoints.mean_params(chosen, self.setup.abstract.params)
        state = training.state.replace(params=params)
        return self.run(state, step, self.setup.config.final_eval_max_examples, chosen)


class _Saving:
    """Checkpoints: when one is due, and writing it with every shard's data position and
    the run totals; and the stop request (SIGTERM/SIGINT), honoured at one step by all."""

    def __init__(self, config, checkpoints: ckpt.Checkpoints, inputs: ShardedInput, step: int):
        self.config, self.checkpoints, self.inputs = config, checkpoints, inputs
        self.last_saved, self.saved_at = step, time.time()  # the newest checkpoint's step
        self.stop = distributed.StopRequest()

    def due(self, step: int) -> bool:
        """Every checkpoint_every_steps, or checkpoint_every_minutes after the last save.

        Time is looked at on log steps only, and any process's clock decides for
        all of them (one small collective), so every process saves at the same step.
        """
        config, total = self.config, self.config.num_train_steps
        if _due(step, config.checkpoint_every_steps, total):
            return True
        if not config.checkpoint_every_minutes or step % config.log_every_steps or step >= total:
            return False
        late = time.time() - self.saved_at >= 60 * config.checkpoint_every_minutes
        return any(distributed.allgather_json(late))

    def save(self, training: _Training, step: int, evaluated: dict[str, Any] | None = None) -> None:
        """Checkpoint the state, every shard's data position (a collective) and the totals;
        with the dev metrics of this step if it was evaluated (the best is kept)."""
        # Never checkpoint past a non-finite step.
        if training.nonfinite.policy == "stop" and (error := training.nonfinite_error(step)):
            raise UserError(error)
        position = {"iterators": self.inputs.global_state()}
        metrics = None
        if evaluated is not None:
            keys = [key for key, _ in retention.BEST_METRICS.values()]
            metrics = {k: float(evaluated[k]) for k in keys if k in evaluated}
        totals = dataclasses.asdict(training.totals)
        self.checkpoints.save(training.state, {**position, **totals}, metrics)
        self.last_saved, self.saved_at = step, time.time()


def _check_writable(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write-test-{jax.process_index()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(
            f"workdir {workdir!r} is not writable ({e}); pick another --workdir or fix its "
            "permissions/free space"
        ) from e


# --- The job ------------------------------------------------------------------------


@dataclasses.dataclass
class _Parts:
    """A run ready to train: its mesh, input, checkpoints and the three parts above."""

    mesh: jax.sharding.Mesh
    inputs: ShardedInput
    checkpoints: ckpt.Checkpoints
    training: _Training
    evaluation: _Evaluation
    saving: _Saving


def _start(config: ml_collections.ConfigDict, workdir: str) -> _Parts:
    """Setup, data, mesh, model and optimizer (born sharded, or restored) of a run."""
    log.setup()
    config = init_from.adopt_model(config, workdir)
    config_lib.validate(config)
    is_main = jax.process_index() == 0
    _check_writable(workdir)
    previous = previous_run(config, workdir)

    # --- Data ------------------------------------------------------------------------
    train_corpus, dev = data.load_split(config, "train"), data.load_split(config, "dev")
    tokenizer = init_from.run_tokenizer(config, workdir, train_corpus)

    # --- Mesh, model and optimizer -------------------------------------------------------
    mesh = make_mesh(config)
    setup = steps.train_setup(config, mesh)
    eval_step = steps.make_eval_step(setup)  # compiled at its first call
    num_params = sum(x.size for x in jax.tree.leaves(setup.abstract.params))
    _log.info(f"mesh {dict(mesh.shape)}, {num_params / 1e6:.2f}M params, {jax.default_backend()}")
    rows_multiple = batch_divisor(mesh) * config.grad_accum_steps  # rows of the global batch
    inputs = ShardedInput(
        config, tokenizer, train_corpus, global_multiple=rows_multiple, workdir=workdir
    )
    keep = config.max_checkpoints_to_keep and max(
        config.max_checkpoints_to_keep, config.average_last
    )
    checkpoints = ckpt.Checkpoints(
        workdir, max_to_keep=keep or None, best_metric=config.best_metric
    )
    state, totals = restore_or_init(config, workdir, setup, checkpoints, inputs, previous)
    if is_main:
        config_lib.save_config(config, workdir)

    # --- The parts of the run (compiled steps; outputs written by process 0) -------------
    step = int(jax.device_get(state.step))
    writer = metrics.MetricWriter(workdir, enabled=is_main)
    progress = metrics.Progress(config.num_train_steps, step, enabled=is_main)
    training = _Training(setup, state, totals, writer, progress, checkpoints.latest_step)
    evaluation = _Evaluation(setup, eval_step, tokenizer, dev, writer, progress)
    saving = _Saving(config, checkpoints, inputs, step)
    return _Parts(mesh, inputs, checkpoints, training, evaluation, saving)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Train `config` into `workdir` (resuming if it holds a checkpoint); return a summary.

    Summary keys: step, preempted, stopped_early (config.early_stop_patience), best_step
    (of config.best_metric), train_loss, best_eval_bleu, final eval metrics
    (eval_loss, eval_bleu, eval_chrf, ...), average (of the last checkpoints' params),
    tokens_seen, train_seconds, total_seconds, data.
    """
    t_start = time.time()
    run = _start(config, workdir)
    training, evaluation, saving = run.training, run.evaluation, run.saving
    total, start = config.num_train_steps, saving.last_saved
    step, preempted = start, False
    stopped_early = evaluation.patience_spent(training.totals)  # a run that already stopped

    # --- Loop --------------------------------------------------------------------------
    with saving.stop, distributed.PeerWatchdog(config.peer_timeout_seconds), run.checkpoints:
        if config.eval_at_start and start == 0:  # the starting model's scores, as step 0
            evaluation.run(training.state, 0, config.eval_max_examples)
        batches = iter(run.inputs)
        while step < total and not stopped_early:
            training.step(batches, run.mesh)
            step += 1
            if step % config.log_every_steps == 0 or step == total:
                training.flush(step)
            evaluated = None
            if _due(step, config.eval_every_steps, total):
                evaluated = evaluation.run(training.state, step, config.eval_max_examples)
                training.window.restart_clock()  # evaluation time is not training time
            best = evaluated is not None and evaluation.is_best(training.totals, evaluated, step)
            if saving.due(step) or best:  # a new best is kept, whenever it comes
                saving.save(training, step, evaluated)
            if evaluated is not None and (
                stopped_early := evaluation.patience_spent(training.totals)
            ):
                if training.window.steps:  # the run ends here: its last steps get their row
                    training.flush(step)
                break
            if saving.stop.reached(step):
                preempted = True
                if training.window.steps:  # a window cut short: its tokens and time count
                    training.flush(step, log_row=False)
                break
        if saving.last_saved != step:
            saving.save(training, step)
        summary: dict[str, Any] = {"preempted": preempted, "train_loss": training.train_loss}
        if stopped_early:
            _log.info(stopped_early)
        summary.update(stopped_early=bool(stopped_early), best_step=training.totals.best_step)
        if not preempted:  # --- Final evaluation: the last state, and the average -------
            summary.update(evaluation.run(training.state, step, config.final_eval_max_examples))
            if config.average_last > 1:
                summary["average"] = evaluation.run_average(
                    training, run.checkpoints, step, config.average_last
                )
    evaluation.progress.close()
    evaluation.writer.close()

    # --- Summary ---------------------------------------------------------------------------
    if preempted:
        _log.info(
            f"{saving.stop.describe()}: saved a checkpoint at step {step}; re-run the same "
            "command to resume"
        )
    totals = training.totals
    summary.update(
        step=step,
        best_eval_bleu=evaluation.best_bleu,
        tokens_seen=totals.tokens_seen,
        train_seconds=totals.train_seconds,
        total_seconds=time.time() - t_start,
        data=run.inputs.stats(),
    )
    best = "-" if evaluation.best_bleu is None else f"{evaluation.best_bleu:.2f}"
    _log.info(
        f"done: step {step} ({step - start} this run), {totals.tokens_seen / 1e6:.2f}M target "
        f"tokens in {totals.train_seconds / 60:.1f} min of training "
        f"({summary['total_seconds'] / 60:.1f} min total); best dev BLEU {best}"
    )
    return summary

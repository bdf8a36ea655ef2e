"""`train_and_evaluate(config, workdir)`: the whole training job, top to bottom.

Sections: setup -> data -> mesh, model and optimizer (born sharded, or restored)
-> compiled steps -> the loop (log, evaluate, checkpoint, stop on a signal)
-> final evaluation and summary.

Re-running with the same workdir resumes from the newest complete checkpoint:
params, optimizer state, step, dropout RNG streams and the data position all
come back, so the run continues exactly as if it had never stopped. A damaged
checkpoint is skipped (with a warning) for the one before it; a workdir whose
checkpoints are all unusable is an error, not a silent fresh start.

Multi-process: every process runs this function (same config, same workdir on
shared storage); each reads its data shard, all take part in each compiled
step and checkpoint, and only process 0 writes logs, metrics and config.json.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

import data
from training import checkpoints as ckpt
from training import distributed, evaluate, metrics, optim, steps
from training.errors import TrainingError
from training.input import ShardedInput, num_shards
from training.mesh import (
    AXES,
    BATCH_AXES,
    axis_rules,
    batch_divisor,
    make_mesh,
    mesh_shape,
    shard_batch,
    state_shardings,
)

NONFINITE_POLICIES = ("skip", "stop")


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


# --- Setup --------------------------------------------------------------------------


def _unknown_keys(config: Any, reference: Any, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, close matches) for every key of `config` that `reference` lacks."""
    out = []
    for key in config:
        name = f"{prefix}{key}"
        if key not in reference:
            out.append((name, difflib.get_close_matches(key, list(reference.keys()), n=1)))
        elif isinstance(config[key], ml_collections.ConfigDict) and isinstance(
            reference[key], ml_collections.ConfigDict
        ):
            out += _unknown_keys(config[key], reference[key], name + ".")
    return out


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raise TrainingError naming the first bad field (before anything slow happens).

    Also checks what depends on the machine: the mesh against the device count,
    and the batch against the batch axes of the mesh.
    """
    from configs import default  # the reference list of fields

    unknown = _unknown_keys(config, default.get_config())
    if unknown:
        hints = [f"config.{k}" + (f" (did you mean {m[0]!r}?)" if m else "") for k, m in unknown]
        raise TrainingError(f"unknown config field(s): {', '.join(hints)}")
    positive = ("num_train_steps", "batch_tokens", "log_every_steps", "max_length", "vocab_size")
    for name in positive:
        if not int(config[name]) > 0:
            raise TrainingError(f"config.{name} must be > 0, got {config[name]!r}")
    for name in ("eval_every_steps", "checkpoint_every_steps", "eval_max_examples"):
        if int(config[name]) < 0:
            raise TrainingError(f"config.{name} must be >= 0 (0 = never/all), got {config[name]}")
    if config.eval_beam_size < 1:
        raise TrainingError(f"config.eval_beam_size must be >= 1, got {config.eval_beam_size}")
    try:
        steps.model_config(config)
    except ValueError as e:
        raise TrainingError(f"bad model config: {e}") from e
    optim.make_optimizer(config)  # raises for unknown optimizer/schedule names
    policy = config.get("nonfinite_policy", "skip")
    if policy not in NONFINITE_POLICIES:
        raise TrainingError(
            f"config.nonfinite_policy must be one of {NONFINITE_POLICIES}, got {policy!r}"
        )
    sizes = [config[f"mesh_{a}"] for a in AXES]
    shape = dict(zip(AXES, mesh_shape(sizes, jax.device_count()), strict=True))
    num_shards(config)  # data_shards against the process count
    # The longest bucket must hold one row per batch-axis device (times grad_accum_steps).
    rows_multiple = shape["data"] * shape["fsdp"] * int(config.grad_accum_steps)
    need = rows_multiple * int(config.max_length)
    if int(config.batch_tokens) < need:
        raise TrainingError(
            f"config.batch_tokens={config.batch_tokens} cannot fill the batch axes: the mesh "
            f"has {rows_multiple // int(config.grad_accum_steps)} devices along "
            f"{BATCH_AXES} (mesh {shape}) and grad_accum_steps={config.grad_accum_steps}, so a "
            f"batch needs at least {rows_multiple} rows of up to max_length={config.max_length} "
            f"tokens: set --config.batch_tokens={need} or more, lower max_length, or put "
            "devices on the 'tensor' axis"
        )


def check_resume_compatible(config: ml_collections.ConfigDict, workdir: str) -> None:
    """The model in WORKDIR's checkpoints must be the one `config` describes.

    Compares the model fields (and vocab_size) of WORKDIR/config.json, written
    by the run that made the checkpoints, with `config`; TrainingError lists
    the differences. A workdir without config.json is not checked.
    """
    path = os.path.join(workdir, ckpt.CONFIG_FILE)
    if not os.path.isfile(path):
        return
    try:
        saved = ckpt.load_config(workdir)
    except (OSError, ValueError) as e:
        raise TrainingError(f"{path} cannot be read ({e}); fix or delete it") from e
    old = {f"model.{k}": v for k, v in saved.get("model", {}).items()}
    old["vocab_size"] = saved.get("vocab_size")
    new = {f"model.{k}": v for k, v in config.model.items()}
    new["vocab_size"] = config.vocab_size
    differ = [
        f"{k}: checkpoint {old.get(k)!r}, config {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if k in old and k in new and old[k] != new[k]
    ]
    if differ:
        raise TrainingError(
            f"the checkpoints in {workdir} were trained with another model config ("
            + "; ".join(differ)
            + "). Use the same model settings to resume, or a fresh --workdir for a new model"
        )


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


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop checkpoints and returns. A second signal is fatal."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum
        for sig, handler in self._previous.items():  # the next signal acts as usual
            signal.signal(sig, handler)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


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
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


# --- Evaluation ---------------------------------------------------------------------


def run_eval(
    state: steps.TrainState,
    graphdef: nnx.GraphDef,
    eval_step: Any,
    config: Any,
    tokenizer: data.Tokenizer,
    dev: Any,
    mesh: jax.sharding.Mesh,
    *,
    max_examples: int,
) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """Dev loss/accuracy on all of `dev`; BLEU/chrF on its first `max_examples` (0 = all)."""
    t0 = time.time()
    loss = evaluate.eval_loss(eval_step, state.params, state.rngs, config, tokenizer, dev, mesh)
    out: dict[str, Any] = {f"eval_{k}": v for k, v in loss.items() if k != "tokens"}
    subset = evaluate.Subset(dev, max_examples)
    model = nnx.merge(graphdef, state.params, state.rngs)
    hyps = evaluate.translate_corpus(
        model,
        tokenizer,
        subset,
        config,
        mesh,
        beam_size=int(config.eval_beam_size),
        alpha=float(config.eval_alpha),
    )
    refs = [subset[i][1] for i in range(len(subset))]
    scores = evaluate.bleu_chrf(hyps, refs)
    out.update(eval_bleu=scores["bleu"], eval_chrf=scores["chrf"])
    out["eval_examples"] = len(subset)
    out["eval_seconds"] = time.time() - t0
    out["bleu_signature"] = scores["bleu_signature"]
    examples = [(subset[i][0], subset[i][1], hyps[i]) for i in range(len(subset))]
    return out, examples[: int(config.num_examples_to_print)]


def _format_eval(step: int, ev: dict[str, Any], examples: list[tuple[str, str, str]]) -> str:
    lines = [
        f"eval @ step {step}: loss {ev['eval_loss']:.3f} acc {ev['eval_accuracy']:.3f} "
        f"BLEU {ev['eval_bleu']:.2f} chrF {ev['eval_chrf']:.2f} "
        f"({ev['eval_examples']} sentences, {ev['eval_seconds']:.0f}s)",
        f"  {ev['bleu_signature']}",
    ]
    for src, ref, hyp in examples:
        lines += [f"  SRC: {src}", f"  REF: {ref}", f"  HYP: {hyp}"]
    return "\n".join(lines)


# --- The job ------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Train `config` into `workdir` (resuming if it holds a checkpoint); return a summary.

    Summary keys: step, preempted, train_loss, best_eval_bleu, final eval metrics
    (eval_loss, eval_bleu, eval_chrf, ...), tokens_seen, train_seconds, total_seconds.
    """
    t_start = time.time()
    validate_config(config)
    is_main = jax.process_index() == 0
    _check_writable(workdir)
    # Checkpoint steps on disk, or damaged ones moved aside by an earlier run.
    had_checkpoints = bool(_step_dirs(workdir)) or bool(_step_dirs(workdir, ckpt.DAMAGED_DIR))
    if had_checkpoints:
        check_resume_compatible(config, workdir)

    # --- Data ------------------------------------------------------------------------
    train_corpus = data.load_split(config, "train")
    dev = data.load_split(config, "dev")
    if is_main:  # process 0 trains the tokenizer; the others then load it
        tokenizer = data.get_tokenizer(config, workdir, train_corpus)
    distributed.sync("tokenizer")
    if not is_main:
        tokenizer = data.get_tokenizer(config, workdir, train_corpus)

    # --- Mesh, model, optimizer --------------------------------------------------------
    mesh = make_mesh(config)
    tx = optim.make_optimizer(config)
    graphdef, abstract = steps.abstract_train_state(config, tx)
    shardings = state_shardings(mesh, abstract, axis_rules(config))
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    num_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    _log(f"mesh {dict(mesh.shape)}, {num_params / 1e6:.2f}M params, {jax.devices()[0].platform}")

    multiple = batch_divisor(mesh) * int(config.grad_accum_steps)  # rows of the global batch
    train_iter = ShardedInput(config, tokenizer, train_corpus, global_multiple=multiple)
    manager = ckpt.Checkpoints(workdir, max_to_keep=int(config.max_checkpoints_to_keep) or None)
    try:
        restored = manager.restore_latest(abstract)
    except TrainingError:
        if not config.get("allow_fresh_start", False):
            raise
        _log("WARNING: no usable checkpoint; config.allow_fresh_start: training from scratch")
        restored = None
    if restored is None and had_checkpoints and not config.get("allow_fresh_start", False):
        raise TrainingError(  # e.g. every step directory deleted between listing and restoring
            f"{workdir} had checkpoints but none is usable (damaged ones are in "
            f"{os.path.join(workdir, ckpt.DAMAGED_DIR)}); restore them from a backup, or pass "
            "--config.allow_fresh_start=True to train from scratch in this workdir"
        )
    tokens_seen, train_seconds, nonfinite_total = 0, 0.0, 0  # totals over all runs
    if restored is None:
        latest = None
        state = steps.init_train_state(config, tx, shardings)
        _trim_metrics(workdir, 0)  # rows of a run killed before its first checkpoint
    else:
        latest, state, data_state = restored
        saved = data_state.get("iterators") or [data_state["iterator"]]
        if not train_iter.set_global_state(saved):
            _log(
                f"WARNING: the checkpoint has {len(saved)} data shard(s), this run reads "
                f"{train_iter.num_shards}: the data order differs from an uninterrupted run "
                f"(set --config.data_shards={len(saved)} to resume it exactly)"
            )
        tokens_seen, train_seconds = data_state["tokens_seen"], data_state["train_seconds"]
        nonfinite_total = int(data_state.get("nonfinite_steps", 0))
        _trim_metrics(workdir, latest)
        _log(f"resumed from step {latest} ({manager.directory})")
    if is_main:
        ckpt.save_config(config, workdir)

    # --- Compiled steps -------------------------------------------------------------
    train_step = steps.make_train_step(graphdef, tx, config, shardings, mesh)
    eval_step = steps.make_eval_step(graphdef, config, mesh)

    # --- Loop -----------------------------------------------------------------------
    total = int(config.num_train_steps)
    start = int(jax.device_get(state.step))
    writer = metrics.MetricWriter(workdir, enabled=is_main)
    progress = metrics.Progress(total, start, enabled=is_main)
    model_cfg = steps.model_config(config)
    peak = metrics.peak_flops_per_device(config)
    log_every = int(config.log_every_steps)
    eval_every, ckpt_every = int(config.eval_every_steps), int(config.checkpoint_every_steps)
    summary: dict[str, Any] = {"preempted": False, "best_eval_bleu": None}
    window: list[dict[str, jax.Array]] = []
    window_tokens, window_flops, window_start = 0, 0.0, time.time()
    step = start
    last_saved = start if latest is not None else None

    policy = config.get("nonfinite_policy", "skip")
    max_in_a_row = int(config.get("max_consecutive_nonfinite", 0))
    nonfinite_run = 0  # consecutive non-finite steps up to the last check

    def data_position() -> dict[str, Any]:
        """The `data` item: every shard's position (a collective) and run totals."""
        states = train_iter.global_state()
        return {
            "iterator": states[0],  # the layout of older checkpoints
            "iterators": states,
            "tokens_seen": tokens_seen,
            "train_seconds": train_seconds,
            "nonfinite_steps": nonfinite_total,
        }

    def check_nonfinite(fetched: list[dict[str, Any]], last_step: int) -> str | None:
        """Count skipped steps; the error to raise per config.nonfinite_policy, or None."""
        nonlocal nonfinite_total, nonfinite_run
        flags = [int(m["nonfinite"]) for m in fetched]
        nonfinite_total += sum(flags)
        for f in flags:
            nonfinite_run = nonfinite_run + 1 if f else 0
        if not any(flags):
            return None
        first = last_step - len(flags) + 1 + flags.index(1)
        good = manager.latest_step() if last_saved is not None else None
        keep = (
            f"the newest checkpoint (step {good}) has only finite values"
            if good is not None
            else "no checkpoint was written"
        )
        if policy == "stop":
            return (
                f"non-finite loss or gradients at step {first} (config.nonfinite_policy="
                f"'stop'); the update was not applied and {keep}. Lower the learning rate, "
                "check the data, or use --config.nonfinite_policy=skip"
            )
        if max_in_a_row and nonfinite_run >= max_in_a_row:
            return (
                f"{nonfinite_run} non-finite steps in a row up to step {last_step} "
                f"(config.max_consecutive_nonfinite={max_in_a_row}): training diverged; "
                f"{keep}. Lower the learning rate or check the data"
            )
        _log(
            f"WARNING: skipped {sum(flags)} update(s) with non-finite loss/gradients "
            f"(first at step {first}; {nonfinite_total} in all)"
        )
        return None

    with StopSignal() as stop:
        batches: Iterator[dict[str, np.ndarray]] = iter(train_iter)
        try:
            while step < total:
                batch = next(batches)
                state, step_metrics = train_step(state, shard_batch(batch, mesh))
                step += 1
                window.append(step_metrics)
                n_tgt, n_src = (
                    int(np.count_nonzero(batch["tgt_out"])),
                    int(np.count_nonzero(batch["src"])),
                )
                s_len, t_len = batch["src"].shape[1], batch["tgt_out"].shape[1]
                window_tokens += n_tgt
                window_flops += metrics.train_flops(model_cfg, n_src, n_tgt, s_len, t_len)

                if step % log_every == 0 or step == total:
                    fetched = jax.device_get(window)  # waits for the steps in flight
                    elapsed = time.time() - window_start
                    nonfinite_error = check_nonfinite(fetched, step)
                    finite = [m for m in fetched if not m["nonfinite"]] or fetched
                    mean = {k: float(np.mean([m[k] for m in finite])) for k in finite[0]}
                    row = {
                        "train_loss": mean["loss"],
                        "train_accuracy": mean["accuracy"],
                        "train_perplexity": mean["perplexity"],
                        "grad_norm": mean["grad_norm"],
                        "learning_rate": float(fetched[-1]["learning_rate"]),
                        "tokens_per_sec": window_tokens / elapsed,
                        "steps_per_sec": len(fetched) / elapsed,
                        "mfu": window_flops / elapsed / (peak * jax.device_count())
                        if peak
                        else None,
                        "nonfinite_steps": nonfinite_total,
                    }
                    writer.write(step, row)
                    progress.update(step, row)
                    if nonfinite_error:
                        raise TrainingError(nonfinite_error)
                    summary["train_loss"] = row["train_loss"]
                    tokens_seen += window_tokens
                    train_seconds += elapsed
                    window, window_tokens, window_flops = [], 0, 0.0
                    window_start = time.time()

                if ckpt_every and step % ckpt_every == 0 and step < total:
                    if policy == "stop" and window:  # never checkpoint past a non-finite step
                        window = jax.device_get(window)
                        if nonfinite_error := check_nonfinite(window, step):
                            raise TrainingError(nonfinite_error)  # (else it counted nothing)
                    manager.save(state, data_position())
                    last_saved = step
                if eval_every and step % eval_every == 0 and step < total:
                    ev, examples = run_eval(
                        state,
                        graphdef,
                        eval_step,
                        config,
                        tokenizer,
                        dev,
                        mesh,
                        max_examples=int(config.eval_max_examples),
                    )
                    writer.write(step, {k: v for k, v in ev.items() if k != "bleu_signature"})
                    progress.write(_format_eval(step, ev, examples))
                    best = summary["best_eval_bleu"]
                    summary["best_eval_bleu"] = max(best or 0.0, ev["eval_bleu"])
                    window_start = time.time()  # evaluation time is not training time
                if stop.received is not None:
                    summary["preempted"] = True
                    break
        except BaseException:
            # Let the save in flight finish, so the newest checkpoint before the
            # error (non-finite step, disk full, ...) is complete, then re-raise.
            with contextlib.suppress(Exception):
                manager.wait()
                manager.close()
            raise

        tokens_seen += window_tokens  # a window cut short by a signal
        if last_saved != step:
            manager.save(state, data_position())
        manager.wait()
        manager.close()
        progress.close()

        # --- Final evaluation and summary -----------------------------------------------
        if summary["preempted"]:
            name = signal.Signals(stop.received).name
            _log(f"{name}: saved a checkpoint at step {step}; re-run the same command to resume")
        else:
            ev, examples = run_eval(
                state,
                graphdef,
                eval_step,
                config,
                tokenizer,
                dev,
                mesh,
                max_examples=int(config.get("final_eval_max_examples", 0)),
            )
            writer.write(step, {k: v for k, v in ev.items() if k != "bleu_signature"})
            if is_main:
                print(_format_eval(step, ev, examples), file=sys.stderr, flush=True)
            summary.update(ev)
            best = summary["best_eval_bleu"]
            summary["best_eval_bleu"] = max(best or 0.0, ev["eval_bleu"])
    writer.close()

    summary.update(
        step=step,
        tokens_seen=tokens_seen,
        train_seconds=train_seconds,
        total_seconds=time.time() - t_start,
    )
    with contextlib.suppress(Exception):
        summary["data"] = train_iter.stats()
    if is_main:
        _log(
            f"done: step {step}, {tokens_seen / 1e6:.2f}M target tokens in "
            f"{train_seconds / 60:.1f} min of training ({summary['total_seconds'] / 60:.1f} min "
            f"total); best dev BLEU {summary['best_eval_bleu']}"
        )
    return summary

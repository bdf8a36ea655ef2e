"""`train_and_evaluate(config, workdir)`: the whole training job, top to bottom.

Sections: setup -> data -> mesh, model and optimizer (born sharded, or restored)
-> compiled steps -> the loop (log, evaluate, checkpoint, stop on a signal)
-> final evaluation and summary.

Re-running with the same workdir resumes from the newest complete checkpoint:
params, optimizer state, step, dropout RNG streams and the data position all
come back, so the run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import contextlib
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
from training import evaluate, metrics, optim, steps
from training.errors import TrainingError
from training.mesh import axis_rules, batch_divisor, make_mesh, shard_batch, state_shardings


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"[train] {msg}", file=sys.stderr, flush=True)


# --- Setup --------------------------------------------------------------------------


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raise TrainingError naming the first bad field (before anything slow happens)."""
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
    os.makedirs(workdir, exist_ok=True)

    # --- Data ------------------------------------------------------------------------
    train_corpus = data.load_split(config, "train")
    dev = data.load_split(config, "dev")
    tokenizer = data.get_tokenizer(config, workdir, train_corpus)
    if is_main:
        ckpt.save_config(config, workdir)

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

    multiple = max(batch_divisor(mesh) // jax.process_count(), 1) * int(config.grad_accum_steps)
    train_iter = data.train_iterator(config, tokenizer, train_corpus, batch_multiple=multiple)
    manager = ckpt.Checkpoints(workdir, max_to_keep=int(config.max_checkpoints_to_keep) or None)
    latest = manager.latest_step()
    tokens_seen, train_seconds = 0, 0.0  # totals over all runs into this workdir
    if latest is None:
        state = steps.init_train_state(config, tx, shardings)
    else:
        state, data_state = manager.restore(latest, abstract)
        train_iter.set_state(data_state["iterator"])
        tokens_seen, train_seconds = data_state["tokens_seen"], data_state["train_seconds"]
        _trim_metrics(workdir, latest)
        _log(f"resumed from step {latest} ({manager.directory})")

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

    def data_position() -> dict[str, Any]:
        it = {"iterator": train_iter.get_state(), "tokens_seen": tokens_seen}
        return {**it, "train_seconds": train_seconds}

    with StopSignal() as stop:
        batches: Iterator[dict[str, np.ndarray]] = iter(train_iter)
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
                mean = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
                row = {
                    "train_loss": mean["loss"],
                    "train_accuracy": mean["accuracy"],
                    "train_perplexity": mean["perplexity"],
                    "grad_norm": mean["grad_norm"],
                    "learning_rate": float(fetched[-1]["learning_rate"]),
                    "tokens_per_sec": window_tokens / elapsed,
                    "steps_per_sec": len(fetched) / elapsed,
                    "mfu": window_flops / elapsed / (peak * jax.device_count()) if peak else None,
                }
                writer.write(step, row)
                progress.update(step, row)
                summary["train_loss"] = row["train_loss"]
                tokens_seen += window_tokens
                train_seconds += elapsed
                window, window_tokens, window_flops = [], 0, 0.0
                window_start = time.time()

            if ckpt_every and step % ckpt_every == 0 and step < total:
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

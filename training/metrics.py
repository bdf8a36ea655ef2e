"""What a run reports: per-window train metrics, the non-finite policy, the FLOP count for
MFU, and the outputs (metrics.jsonl, TensorBoard, the progress line).

    window = TrainWindow(model_cfg, peak_flops_per_device(config), jax.device_count())
    window.add(step_metrics, src_len, tgt_len)       # every step; nothing waits
    fetched, row = window.flush()                    # every log_every_steps
    nonfinite.check(fetched, step)                   # error text per config.nonfinite_policy
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from attention_jax import TransformerConfig

METRICS_FILE = "metrics.jsonl"

_log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device (vendor datasheets), by `jax.Device.device_kind`.
PEAK_FLOPS = {
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops_per_device(config: Any, device: jax.Device | None = None) -> float | None:
    """config.peak_flops_per_device if set, else the table entry for the device, else None."""
    if config.peak_flops_per_device:
        return float(config.peak_flops_per_device)
    kind = (device or jax.devices()[0]).device_kind
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):  # longest (most specific) first
        if kind.startswith(name):
            return PEAK_FLOPS[name]
    return None


def train_flops(cfg: TransformerConfig, src_tokens: int, tgt_tokens: int, s: int, t: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward).

    A matmul with an [D_in, D_out] weight costs 2 * D_in * D_out FLOPs per token.
    Per source token (encoder, L_e layers, plus the decoder's cross-attention K/V):
        2 * L_e * (4 D^2 + 2 D F)  +  2 * L_d * 2 D^2  +  L_e * 4 S D   (QK^T and AV)
    Per target token (decoder, L_d layers, then the output projection):
        2 * L_d * (4 D^2 + 2 D^2 + 2 D F)  +  2 D V  +  L_d * 4 (T + S) D
    S and T are the padded lengths attended over; tokens are the non-padding ones,
    so padding costs time but earns no FLOPs. Embedding lookups and LayerNorms
    are not counted.
    """
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    le, ld = cfg.num_encoder_layers, cfg.num_decoder_layers
    per_src = 2 * le * (4 * d * d + 2 * d * f) + 2 * ld * 2 * d * d + le * 4 * s * d
    per_tgt = 2 * ld * (6 * d * d + 2 * d * f) + 2 * d * v + ld * 4 * (t + s) * d
    return 3.0 * (per_src * src_tokens + per_tgt * tgt_tokens)


# Train steps dispatched but not finished, at most (TrainWindow.wait): enough for the
# host to prepare the next batches while the device works, few enough that a SIGTERM
# is answered within about a second of steps instead of after every step JAX queued.
RUN_AHEAD_SECONDS = 1.0
HOST_PARTS = ("input", "put", "dispatch", "wait")
MIN_RUN_AHEAD_STEPS = 2


class TrainWindow:
    """The train steps since the last log line: their metrics (on device until flushed),
    FLOPs and wall time.

    Token counts come from the step's metrics, which the step sums over the global
    batch, so tokens/s and MFU count every process's tokens against every device.
    """

    def __init__(self, model_cfg: TransformerConfig, peak_flops: float | None, num_devices: int):
        self.model_cfg, self.peak_flops, self.num_devices = model_cfg, peak_flops, num_devices
        self.steps: list[Any] = []  # per step: metrics dict (device arrays, then fetched)
        self.lengths: list[tuple[int, int]] = []  # per step: padded (S, T)
        # host seconds by part over the window's steps: input (the next batch), put (onto
        # the devices), dispatch (the step's call), wait (for the steps in flight)
        self.host: dict[str, float] = dict.fromkeys(HOST_PARTS, 0.0)
        self.start = time.time()
        # Steps allowed in flight: about RUN_AHEAD_SECONDS of them at the last window's
        # pace (fast steps keep a queue that absorbs the host's hiccups), at least 2.
        self.in_flight = MIN_RUN_AHEAD_STEPS

    def add(self, step_metrics: Mapping[str, Any], src_len: int, tgt_len: int) -> None:
        self.steps.append(step_metrics)
        self.lengths.append((src_len, tgt_len))

    def time(self, part: str, seconds: float) -> None:
        """Count `seconds` of host time to `part` (one of HOST_PARTS)."""
        self.host[part] += seconds

    def wait(self) -> None:
        """Wait until at most `self.in_flight` of the window's steps are still running.

        JAX dispatches steps asynchronously, so the loop can otherwise run far ahead
        of the device (on CPU until the next log line; on a GPU as far as its runtime
        queues). A stop request (SIGTERM) is then honoured only once all of them have
        run, which at seconds a step outlasts a preemption notice. Steps chain through
        the train state, so waiting for one waits for every step before it.
        """
        if len(self.steps) > self.in_flight:
            t0 = time.perf_counter()
            jax.block_until_ready(self.steps[-1 - self.in_flight])
            self.host["wait"] += time.perf_counter() - t0

    def fetch(self) -> list[dict[str, Any]]:
        """The window's step metrics on the host (waits for the steps in flight)."""
        self.steps = jax.device_get(self.steps)
        return self.steps

    def restart_clock(self) -> None:
        """Start timing afresh (evaluation time is not training time)."""
        self.start = time.time()

    def flush(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the fetched step metrics, the log row), then start a new window.

        The row averages the finite steps (all steps if none is finite) and adds
        throughput: target tokens/s, steps/s and MFU (None when the peak is unknown).
        """
        fetched, elapsed = self.fetch(), time.time() - self.start
        finite = [m for m in fetched if not m["nonfinite"]] or fetched
        mean = lambda k: float(np.mean([m[k] for m in finite]))
        flops = sum(
            train_flops(self.model_cfg, int(m["src_tokens"]), int(m["tokens"]), s, t)
            for m, (s, t) in zip(fetched, self.lengths, strict=True)
        )
        tokens = int(sum(m["tokens"] for m in fetched))
        row = {
            "train_loss": mean("loss"),
            "train_accuracy": mean("accuracy"),
            "train_perplexity": mean("perplexity"),
            "grad_norm": mean("grad_norm"),
            "learning_rate": float(fetched[-1]["learning_rate"]),
            "tokens": tokens,
            "seconds": elapsed,
            "tokens_per_sec": tokens / elapsed,
            "steps_per_sec": len(fetched) / elapsed,
            "mfu": flops / elapsed / (self.peak_flops * self.num_devices)
            if self.peak_flops
            else None,
            # the host's milliseconds per step by part; the rest of a step's wall time
            # (1000 / steps_per_sec) is the loop's other work
            **{f"host_{k}_ms": 1e3 * v / len(fetched) for k, v in self.host.items()},
        }
        self.steps, self.lengths = [], []
        self.host = dict.fromkeys(HOST_PARTS, 0.0)
        self.in_flight = max(MIN_RUN_AHEAD_STEPS, int(RUN_AHEAD_SECONDS * row["steps_per_sec"]))
        self.restart_clock()
        return fetched, row


class NonFinite:
    """config.nonfinite_policy over the steps' `nonfinite` flags.

    'skip': the step changed nothing (the train step keeps the old state); count
    it and warn, unless `max_in_a_row` such steps came one after another.
    'stop': the first one is an error.
    """

    def __init__(self, policy: str, max_in_a_row: int, total: int = 0):
        self.policy, self.max_in_a_row = policy, max_in_a_row
        self.total = total  # non-finite steps over all runs (checkpointed)
        self.in_a_row = 0
        self._seen = -1  # last step counted (a window may be checked twice)

    def check(
        self, fetched: list[Mapping[str, Any]], last_step: int, newest_checkpoint: int | None
    ) -> str | None:
        """Count the flags of steps not seen yet; the error to raise, or None."""
        first_step = last_step - len(fetched) + 1
        flags = [
            (first_step + i, int(m["nonfinite"]))
            for i, m in enumerate(fetched)
            if first_step + i > self._seen
        ]
        self._seen = max(self._seen, last_step)
        for _, flag in flags:
            self.in_a_row = self.in_a_row + 1 if flag else 0
            self.total += flag
        bad = [step for step, flag in flags if flag]
        if not bad:
            return None
        keep = (
            f"the newest checkpoint (step {newest_checkpoint}) has only finite values"
            if newest_checkpoint is not None
            else "no checkpoint was written"
        )
        if self.policy == "stop":
            return (
                f"non-finite loss or gradients at step {bad[0]} (config.nonfinite_policy="
                f"'stop'); the update was not applied and {keep}. Lower the learning rate, "
                "check the data, or use --config.nonfinite_policy=skip"
            )
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            return (
                f"{self.in_a_row} non-finite steps in a row up to step {last_step} "
                f"(config.max_consecutive_nonfinite={self.max_in_a_row}): training diverged; "
                f"{keep}. Lower the learning rate or check the data"
            )
        _log.warning(
            f"skipped {len(bad)} update(s) with non-finite loss/gradients "
            f"(first at step {bad[0]}; {self.total} in all)"
        )
        return None


class MetricWriter:
    """One JSON object per logged step in WORKDIR/metrics.jsonl, plus TensorBoard scalars.

    Only process 0 writes. Values that are None or not finite numbers are kept
    out of TensorBoard but written to JSON as null.
    """

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._file = open(os.path.join(workdir, METRICS_FILE), "a")  # noqa: SIM115
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=workdir)
        except ImportError:  # TensorBoard files are a nicety, not a requirement
            self._tb = None

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        for k, v in metrics.items():
            if v is not None and not isinstance(v, str):
                v = float(v)
                v = v if math.isfinite(v) else None
            row[k] = v
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, float):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A tqdm bar on a terminal; plain `step N/M ...` lines otherwise (logs, CI)."""

    def __init__(self, total: int, initial: int, *, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.start_step, self.start_time = initial, time.time()
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Report the metrics of `step` (called every log_every_steps)."""
        if not self.enabled:
            return
        parts = {
            "loss": f"{metrics['train_loss']:.3f}",
            "lr": f"{metrics['learning_rate']:.2e}",
            "tok/s": f"{metrics['tokens_per_sec']:.0f}",
        }
        if self._bar is not None:
            self._bar.set_postfix(parts, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        done = step - self.start_step
        eta = (time.time() - self.start_time) / max(done, 1) * (self.total - step)
        fields = " ".join(f"{k} {v}" for k, v in parts.items())
        print(f"step {step}/{self.total} {fields} eta {_hms(eta)}", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        """A message that does not break the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"

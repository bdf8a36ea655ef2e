"""Metric output (metrics.jsonl, TensorBoard, progress line) and the FLOP count for MFU."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax

from model import TransformerConfig

METRICS_FILE = "metrics.jsonl"

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
    if config.get("peak_flops_per_device", 0.0):
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

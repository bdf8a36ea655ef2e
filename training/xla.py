"""XLA flags that help on NVIDIA GPUs (Ampere/Hopper), set by the CLIs and benchmarks.

They only take effect if set before JAX initializes its backend, which is why
`train.py`, `decode.py` and `bench/*` call `set_gpu_flags()` first thing;
users never need to export them. Flags already in $XLA_FLAGS win.
"""

from __future__ import annotations

import os

GPU_XLA_FLAGS = (
    # Schedule collectives (FSDP all-gathers, gradient reduce-scatters) to overlap compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # cuBLAS GEMMs rather than Triton-generated ones for the large dense matmuls.
    "--xla_gpu_enable_triton_gemm=false",
)


def set_gpu_flags() -> None:
    """Append GPU_XLA_FLAGS to $XLA_FLAGS (CPU and TPU backends ignore xla_gpu_* flags)."""
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in GPU_XLA_FLAGS if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()

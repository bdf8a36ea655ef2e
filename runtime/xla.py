"""XLA settings the CLIs apply before JAX starts: GPU flags and the compilation cache.

GPU flags only take effect if set before JAX initializes its backend, which is
why `train.py`, `decode.py` and `bench/*` call `set_gpu_flags()` first thing;
users never need to export them. Flags already in $XLA_FLAGS win.

The persistent compilation cache keeps compiled programs on disk, keyed by the
program, the backend and the JAX version, so a second `decode.py` or `train.py`
with the same shapes loads them instead of compiling again. It is safe to
delete at any time (the next run compiles and refills it).
"""

from __future__ import annotations

import os

CACHE_ENV = "ATTENTION_JAX_COMPILATION_CACHE"

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


def default_cache_dir() -> str:
    """$ATTENTION_JAX_COMPILATION_CACHE, else $XDG_CACHE_HOME (~/.cache)/attention-jax/xla."""
    if CACHE_ENV in os.environ:
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-jax", "xla")


def enable_compilation_cache(directory: str) -> str | None:
    """Cache every compiled program in `directory` ('' or 'off' = no cache); returns it.

    Thresholds are zero because the programs that matter most for start-up
    (the beam search of each batch shape) each compile in about a second.
    """
    if directory in ("", "off"):
        return None
    import jax

    directory = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory

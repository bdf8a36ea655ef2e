"""The flags of a job's process, train.py's and decode.py's alike: the compilation cache
and the distributed runtime's. Importing this module defines them (absl's flags are
global), so both CLIs import it instead of declaring their own; it loads absl alone,
not JAX, so that `--help` and flag errors stay fast.

    from attention_jax.runtime import process_flags
    cache = process_flags.CACHE.value
    distributed.initialize(*process_flags.where(), mode=process_flags.DISTRIBUTED.value)
"""

from __future__ import annotations

from absl import flags

CACHE = flags.DEFINE_string(
    "compilation_cache", None,
    "Persistent XLA compilation cache and kept search programs, so that a restart does not "
    "compile again ('off' = none; default: $ATTENTION_JAX_COMPILATION_CACHE or "
    "~/.cache/attention-jax/xla).",
)  # fmt: skip
COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "Several processes (hosts) in one job: HOST:PORT of process 0 (jax.distributed), with "
    "--num_processes and --process_id.",
)  # fmt: skip
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Several processes: how many.")
PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Several processes: this one's index (0 writes)."
)
DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],  # runtime/distributed.py MODES
    "jax.distributed.initialize: 'auto' = when the flags above are given or a cluster is "
    "detected (TPU VM, SLURM with >1 task, Open MPI, JAX_COORDINATOR_ADDRESS); 'on' = "
    "always (JAX reads the cluster's settings); 'off' = never.",
)  # fmt: skip
NAMES = ("compilation_cache", "coordinator_address", "num_processes", "process_id", "distributed")


def where() -> tuple[str | None, int | None, int | None]:
    """(coordinator address, process count, process index), as given."""
    return COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value

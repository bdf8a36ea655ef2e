"""Multi-controller JAX: starting the distributed runtime and small host-side collectives.

    initialize(mode="auto")            # before anything touches a JAX backend
    states = allgather_json(my_state)  # [state of process 0, state of process 1, ...]

Every process runs the same program (`train.py`); `jax.distributed.initialize`
connects them through a coordinator (process 0) so that `jax.devices()` lists
the devices of all processes and one jitted step runs on all of them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import jax
import numpy as np

from training.errors import TrainingError

MODES = ("auto", "on", "off")

_log = logging.getLogger(__name__)


def cluster_detected() -> str | None:
    """The cluster kind whose environment this process runs in, or None (a plain machine).

    Only environment variables and device files are looked at: nothing is
    contacted. `jax.distributed.initialize()` itself then reads the details
    (coordinator, process count and id) from the same environment.
    """
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in env:
        return "Open MPI"
    if env.get("TPU_WORKER_HOSTNAMES") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "TPU (GKE/multislice)"
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "Cloud TPU VM"  # one or many hosts: initialize() asks the metadata server
    return None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    mode: str = "auto",
) -> bool:
    """Start `jax.distributed` if asked (any argument, or mode 'on') or on a detected cluster.

    Returns True if the distributed runtime was started. Must run before the
    first JAX computation. On CPU, collectives across processes use gloo.
    """
    if mode not in MODES:
        raise TrainingError(f"--distributed must be one of {MODES}, got {mode!r}")
    explicit = [x is not None for x in (coordinator_address, num_processes, process_id)]
    if any(explicit) and not all(explicit):
        raise TrainingError(
            "--coordinator_address, --num_processes and --process_id go together: pass all "
            "three (or none, to let JAX detect the cluster)"
        )
    if mode == "off" or (mode == "auto" and not any(explicit) and cluster_detected() is None):
        return False
    if all(explicit) and not 0 <= int(process_id) < int(num_processes):
        raise TrainingError(f"--process_id={process_id} must be in [0, {num_processes})")
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU devices of different processes talk through gloo (TCP); harmless elsewhere.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if all(explicit):
        kwargs = dict(
            coordinator_address=coordinator_address,
            num_processes=int(num_processes),
            process_id=int(process_id),
        )
    jax.distributed.initialize(**kwargs)
    _log.info(
        f"jax.distributed: {jax.process_count()} processes, "
        f"{jax.device_count()} devices ({jax.local_device_count()} per process)"
    )
    return True


def allgather_json(value: Any) -> list[Any]:
    """[value of process 0, value of process 1, ...] for a JSON-serializable `value`.

    One collective on every process (all must call it); a plain list of one
    element on a single process.
    """
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    n = int(np.max(multihost_utils.process_allgather(np.array([raw.size], np.int64))))
    padded = np.zeros(n, np.uint8)
    padded[: raw.size] = raw
    gathered = np.asarray(multihost_utils.process_allgather(padded))  # [P, n]
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in gathered]


def sync(name: str) -> None:
    """Wait until every process reaches this point."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

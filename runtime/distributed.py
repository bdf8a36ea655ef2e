"""Multi-controller JAX: starting the distributed runtime, small host-side collectives,
and stopping together.

    initialize(mode="auto")            # before anything touches a JAX backend
    states = allgather_json(my_state)  # [state of process 0, state of process 1, ...]
    with StopRequest() as stop, PeerWatchdog(timeout=60):
        ... if stop.reached(step): save and leave the loop

Every process runs the same program (`train.py`); `jax.distributed.initialize`
connects them through a coordinator (process 0) so that `jax.devices()` lists
the devices of all processes and one jitted step runs on all of them.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from attention_jax.runtime.errors import UserError

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


def will_start(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    mode: str = "auto",
) -> bool:
    """Whether `initialize` would start the distributed runtime (UserError for bad flags)."""
    if mode not in MODES:
        raise UserError(f"--distributed must be one of {MODES}, got {mode!r}")
    explicit = [x is not None for x in (coordinator_address, num_processes, process_id)]
    if any(explicit) and not all(explicit):
        raise UserError(
            "--coordinator_address, --num_processes and --process_id go together: pass all "
            "three (or none, to let JAX detect the cluster)"
        )
    if mode == "off" or (mode == "auto" and not any(explicit) and cluster_detected() is None):
        return False
    if all(explicit) and not 0 <= int(process_id) < int(num_processes):
        raise UserError(f"--process_id={process_id} must be in [0, {num_processes})")
    return True


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
    if not will_start(coordinator_address, num_processes, process_id, mode=mode):
        return False
    explicit = coordinator_address is not None
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU devices of different processes talk through gloo (TCP); harmless elsewhere.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if explicit:
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


# --- Stopping together -------------------------------------------------------------------


class StopRequest:
    """A stop asked for by SIGTERM or SIGINT, honoured by every process at the same step.

        with StopRequest() as stop:
            while ...:
                step += 1
                if stop.reached(step): save, break

    One process: the signals set a flag (a second signal acts as usual).
    Several: JAX's preemption service (started by jax.distributed.initialize)
    catches SIGTERM on any process and tells the others;
    `multihost_utils.reached_preemption_sync_point(step)` then turns True on
    every process at the same step, so all save one cooperative checkpoint and
    exit 0. SIGINT (Ctrl-C on one host) is sent on to this process as SIGTERM,
    to take the same path. `reached` must be called at every step.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self.multi = jax.process_count() > 1

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self
        # Multi-process: SIGTERM stays with JAX's handler (installed at initialize).
        sigs = (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)
        for sig in sigs:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum
        for sig, handler in self._previous.items():  # the next signal acts as usual
            signal.signal(sig, handler)
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

    def reached(self, step: int) -> bool:
        """Stop after `step`? The same answer on every process."""
        if not self.multi:
            return self.received is not None
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)

    def describe(self) -> str:
        if self.received is not None and not self.multi:
            return signal.Signals(self.received).name
        return "a stop request (SIGTERM or SIGINT to a process of this job)"

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


EXIT_PEER_LOST = 75  # EX_TEMPFAIL: re-running the job resumes it


class PeerWatchdog:
    """Ends this process with one clear line when another process of the job is gone.

    A process killed outright (SIGKILL, out of memory, a lost host) leaves the
    others blocked in a collective that never completes; JAX's coordination
    service ends them only after its heartbeat timeout, with an abort and a C++
    stack. Here a thread bumps this process's counter in the distributed
    runtime's key-value store every `interval` seconds and watches the others':
    a counter that has not moved for `timeout` seconds since it was first seen
    (or a store that cannot be reached any more: process 0 holds it) means that
    process is gone, and this one exits with EXIT_PEER_LOST. A busy process
    (compiling, evaluating, saving) keeps beating: the thread needs only the
    GIL for a moment (XLA compiles without it).

    Processes reach the loop at different times (each tokenizes and plans its
    own shard, and a loaded host compiles slower), so a peer is only watched
    from its first beat on: one still getting ready is waited for, as the first
    collective would wait. One that dies before its first beat is left to JAX's
    coordination service (and `supervise` says what happened).
    """

    def __init__(self, timeout: float, interval: float = 2.0, *, on_lost=None):
        self.timeout, self.interval = timeout, interval
        self._on_lost = on_lost or _exit_peer_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeerWatchdog:
        from jax._src import distributed as jax_distributed  # the runtime's client

        client = jax_distributed.global_state.client
        if jax.process_count() > 1 and self.timeout > 0 and client is not None:
            self._thread = threading.Thread(
                target=self.watch,
                args=(client, jax.process_index(), jax.process_count()),
                name="peer-watchdog",
                daemon=True,
            )
            self._thread.start()
        return self

    def watch(self, client, me: int, n: int) -> None:
        """Beat as process `me` of `n` and watch the others until stopped or one is lost.

        `client` has `key_value_set(key, value, allow_overwrite=True)` and
        `key_value_try_get(key)` (raising while the key is unset), as JAX's
        distributed client does.
        """
        key = lambda p: f"attention_jax/alive/{p}"
        seen: dict[int, tuple[str, float]] = {}  # peer -> (its last counter, when it changed)
        beat = 0
        while True:  # the first beat at once: peers watch us from it on
            beat += 1
            try:
                client.key_value_set(key(me), str(beat), allow_overwrite=True)
            except Exception as e:  # the store lives in process 0
                self._on_lost(f"the job's coordination service (process 0) is unreachable: {e}")
                return
            for p in range(n):
                if p == me:
                    continue
                try:
                    now = client.key_value_try_get(key(p))
                except Exception:  # not written yet: that process is still getting ready
                    continue
                if p not in seen or seen[p][0] != now:
                    seen[p] = (now, time.monotonic())
                elif time.monotonic() - seen[p][1] > self.timeout:
                    self._on_lost(f"process {p} sent no heartbeat for {self.timeout:.0f} s")
                    return
            if self._stop.wait(self.interval):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()


def _exit_peer_lost(reason: str) -> None:
    _log.error(
        f"another process of this job is gone ({reason}): it was probably killed (SIGKILL, "
        "out of memory, a lost host). Stopping this process too; re-run the same command on "
        "every host to resume from the last checkpoint"
    )
    sys.stderr.flush()
    os._exit(EXIT_PEER_LOST)  # the main thread may be blocked in a collective forever


SUPERVISED_ENV = "ATTENTION_JAX_SUPERVISED"  # set in the child of `supervise`


def die_with_parent() -> None:
    """In the child of `supervise`: be killed when the parent dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # another OS: the child may outlive a SIGKILLed parent
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(EXIT_PEER_LOST)


def supervise(argv: list[str]) -> int:
    """Run this command again as a child process; explain how it ended. Returns its exit code.

    In a multi-host job a process can end from outside Python when another one
    dies: gloo aborts when a peer's connection breaks in the middle of a
    collective, and JAX's coordination service aborts a process whose peer
    stopped sending heartbeats; both leave C++ messages that do not say what
    happened. The parent stays out of JAX, passes SIGTERM and SIGINT on to the
    child, and when the child dies of a signal prints one line that does. The
    child calls `die_with_parent`, so that killing the parent kills the whole
    process, as a lost host would.
    """
    child = subprocess.Popen(
        [sys.executable, *argv],
        env=dict(os.environ, **{SUPERVISED_ENV: "1"}),
        start_new_session=True,  # signals to our process group reach the child once, via us
    )
    forward = lambda signum, frame: child.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    rc = child.wait()
    if rc >= 0:
        return rc
    _log.error(
        f"this process of the job ended abnormally ({signal.Signals(-rc).name}): in a "
        "multi-host job that usually means another process died first (SIGKILL, out of "
        "memory, a lost host) and broke a collective; see the first error on the other "
        "hosts. Re-run the same command on every host to resume from the last checkpoint"
    )
    return EXIT_PEER_LOST

"""Train a Transformer: `python train.py --config=configs/tiny.py --workdir=workdir/tiny`.

Any config field can be overridden, e.g. `--config.num_train_steps=500`.
Re-running the same command resumes from the newest checkpoint in the workdir.
User errors (bad flags or config values, missing data) print one line and exit 1.

On a cluster, run the same command on every host: JAX's distributed runtime
starts by itself where it detects one (TPU VMs, SLURM, Open MPI), or from
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I`. SIGTERM or
SIGINT to any host stops every host at the same step with one checkpoint (exit
0); if a host dies, the others stop within config.peer_timeout_seconds with one
error line (exit 75). Either way, re-running the command on every host resumes.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, tokenizer.")
flags.mark_flags_as_required(["config", "workdir"])
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process: HOST:PORT of process 0 (jax.distributed)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process: process count.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process: this process's index.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    ["auto", "on", "off"],
    "jax.distributed.initialize: 'auto' = when the flags above are given or a cluster is "
    "detected (TPU VM, SLURM with >1 task, Open MPI, JAX_COORDINATOR_ADDRESS); 'on' = always "
    "(JAX reads the cluster's settings); 'off' = never.",
)


_SUPERVISE = flags.DEFINE_boolean(
    "supervise",
    True,
    "Multi-process: train in a child process and, if it is ended by a signal (a peer "
    "that died broke a collective), say so in one line and exit 75.",
)
_CACHE = flags.DEFINE_string(
    "compilation_cache",
    None,
    "Persistent XLA compilation cache, so that a restart does not compile again ('off' = "
    "none; default: $ATTENTION_JAX_COMPILATION_CACHE or ~/.cache/attention-jax/xla).",
)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with one clear line instead of a traceback for a bad override."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}\nPass --helpfull to see the flags.", file=sys.stderr)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        msg = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        print(f"error: bad --config override: {msg}", file=sys.stderr)
    sys.exit(1)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from training import xla

    xla.set_gpu_flags()  # before JAX initializes a backend
    xla.enable_compilation_cache(xla.default_cache_dir() if _CACHE.value is None else _CACHE.value)
    # Imported here so that `--help` and flag errors are fast and JAX-free.
    from data import DataError
    from training import TrainingError, distributed, log, train_and_evaluate

    log.setup()

    where = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    try:
        multi = distributed.will_start(*where, mode=_DISTRIBUTED.value)
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if os.environ.get(distributed.SUPERVISED_ENV):
        distributed.die_with_parent()
    elif multi and _SUPERVISE.value:
        sys.exit(distributed.supervise(sys.argv))
    distributed.initialize(*where, mode=_DISTRIBUTED.value)

    config = _CONFIG.value
    try:
        config.keys()  # the config file is loaded lazily: fail here, cleanly
    except OSError as e:
        print(f"error: cannot load --config: {str(e).splitlines()[-1].strip()}", file=sys.stderr)
        sys.exit(1)
    try:
        train_and_evaluate(config, _WORKDIR.value)
    except (TrainingError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

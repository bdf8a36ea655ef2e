"""Train a Transformer: `python train.py --config=configs/tiny.py --workdir=workdir/tiny`.

`--compile_for=tpu:v5e-256` (or gpu:h100x8, ...) instead compiles the train, eval
and decode steps for that slice or GPU box here, without chips or data, and
reports memory per chip, FLOPs, collectives and a step-time estimate.

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

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from attention_jax.runtime import process_flags  # the flags train.py shares with decode.py

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, tokenizer.")
flags.mark_flags_as_required(["config"])
_COMPILE_FOR = flags.DEFINE_string(
    "compile_for",
    None,
    "Instead of training: compile the train, eval and decode steps for a TPU slice or GPU box "
    "on this machine (no chips, data or workdir needed; e.g. tpu:v5e-8, tpu:v5e-256, "
    "tpu:v5p-128, tpu:v4-8, tpu:v6e-64, gpu:h100, gpu:h100x8, gpu:a100x8) and print bytes per "
    "chip against HBM, FLOPs, collectives and a step-time estimate (JSON on stdout, a table "
    "on stderr; exit 2 if it does not fit). Needs jax[tpu] or jax[cuda13] (docs/aot.md).",
)
_SLICES = flags.DEFINE_integer(
    "compile_for_slices", 1, "--compile_for=tpu:...: this many slices (data parallel across them)."
)
_ALL_BUCKETS = flags.DEFINE_boolean(
    "compile_all_buckets", False, "--compile_for: compile every train width, not only the widest."
)
_DUMP = flags.DEFINE_string(
    "compile_dump", None, "--compile_for: write each program's optimized HLO into this directory."
)
_FIND_BATCH = flags.DEFINE_boolean(
    "find_batch", False, "--compile_for: also search the largest batch_tokens that fits."
)
_SUPERVISE = flags.DEFINE_boolean(
    "supervise",
    True,
    "Multi-process: train in a child process and, if it is ended by a signal (a peer "
    "that died broke a collective), say so in one line and exit 75.",
)
flags.adopt_module_key_flags(process_flags)  # --help lists them as train.py's


def _parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with one clear line instead of a traceback for a bad override."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"error: {e}\nPass --helpfull to see the flags.", file=sys.stderr)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        msg = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'")
        from attention_jax.configs.default import RENAMED  # JAX-free, as the config files

        if msg in RENAMED:
            msg += f" (renamed: --config.{RENAMED[msg]})"
        print(f"error: bad --config override: {msg}", file=sys.stderr)
    sys.exit(1)


def _compile_for() -> int:
    """--compile_for: the ahead-of-time report (aot/fit.py); no training."""
    from attention_jax.aot import hardware

    try:
        target = hardware.parse_target(_COMPILE_FOR.value)
    except ValueError as e:  # UserError
        print(f"error: {e}", file=sys.stderr)
        return 1
    hardware.prepare_environment(target)  # before JAX starts a backend
    from attention_jax.aot import fit
    from attention_jax.aot import report as aot_report
    from attention_jax.runtime import log, xla
    from attention_jax.runtime.errors import UserError
    from attention_jax.training.init_from import adopt_model

    xla.set_gpu_flags()  # what train.py runs with on a GPU

    log.setup()
    config = _load_config()
    label = config_flags.get_config_filename(flags.FLAGS["config"])
    target, slices = _COMPILE_FOR.value, _SLICES.value
    try:
        config = adopt_model(config)  # config.init_from: the imported model's shape
        report = fit.compile_for(
            config, target, slices=slices, all_buckets=_ALL_BUCKETS.value, label=label,
            dump_dir=_DUMP.value,
        )  # fmt: skip
        if _FIND_BATCH.value:
            report["find_batch"] = fit.find_batch(config, target, slices=slices)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report["advice"] = aot_report.advice(report)
    print(json.dumps(report), flush=True)
    print(aot_report.table(report), file=sys.stderr)
    return 0 if report["fits"] else 2  # 2: something does not fit


def _load_config():
    config = _CONFIG.value
    try:
        config.keys()  # the config file is loaded lazily: fail here, cleanly
    except OSError as e:
        print(f"error: cannot load --config: {str(e).splitlines()[-1].strip()}", file=sys.stderr)
        sys.exit(1)
    return config


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    if _COMPILE_FOR.value:
        sys.exit(_compile_for())
    if not _WORKDIR.value:
        print("error: --workdir is required (or --compile_for=TARGET)", file=sys.stderr)
        sys.exit(1)
    from attention_jax.runtime import xla

    xla.set_gpu_flags()  # before JAX initializes a backend
    cache = process_flags.CACHE.value
    cache = xla.default_cache_dir() if cache is None else cache
    cache = xla.enable_compilation_cache(cache)
    # Imported here so that `--help` and flag errors are fast and JAX-free.
    from attention_jax.runtime import distributed, log
    from attention_jax.runtime.errors import UserError
    from attention_jax.search import programs
    from attention_jax.training import train_and_evaluate

    programs.enable_beside(cache)  # the evaluation's search programs, as decode.py's

    log.setup()

    where = process_flags.where()
    try:
        multi = distributed.will_start(*where, mode=process_flags.DISTRIBUTED.value)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if os.environ.get(distributed.SUPERVISED_ENV):
        distributed.die_with_parent()
    elif multi and _SUPERVISE.value:
        sys.exit(distributed.supervise(sys.argv))
    distributed.initialize(*where, mode=process_flags.DISTRIBUTED.value)

    config = _load_config()
    try:
        train_and_evaluate(config, _WORKDIR.value)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

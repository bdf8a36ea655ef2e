"""Train a Transformer: `python train.py --config=configs/tiny.py --workdir=workdir/tiny`.

Any config field can be overridden, e.g. `--config.num_train_steps=500`.
Re-running the same command resumes from the newest checkpoint in the workdir.
User errors (bad flags or config values, missing data) print one line and exit 1.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, tokenizer.")
flags.mark_flags_as_required(["config", "workdir"])


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
    # Imported here so that `--help` and flag errors are fast and JAX-free.
    from data import DataError
    from training import TrainingError, train_and_evaluate

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

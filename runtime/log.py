"""One way to report progress and warnings: Python logging, printed to stderr.

Library modules log through `logging.getLogger(__name__)` and print nothing
themselves; `setup()` (called by train.py, decode.py and `train_and_evaluate`)
prints their records as one line each:

    [train] resumed from step 500
    [data] WARNING: train.tsv: skipped 3 malformed line(s) of 1000

Process 0 prints everything from INFO up; the other processes of a multi-host
job print only warnings and errors, tagged with their index (`[train p3]`), so
a job's log is not N copies of the same lines.
"""

from __future__ import annotations

import logging
import sys

# The library's root logger: every module logs under it (`__name__`).
ROOT_LOGGER = "attention_jax"
# Its subpackages -> the tag printed in front of their lines; the network's modules
# (attention_jax.attention, ...) print as [model], any other subpackage by its name.
TAGS = {
    "training": "train",
    "data": "data",
    "inference": "inference",
    "backends": "backends",  # exports, CTranslate2, OPUS-MT
    "runtime": "job",  # runtime/distributed.py: the processes of a train or decode job
}
SUBPACKAGES = (*TAGS, "search", "aot", "configs")


def tag(name: str) -> str:
    """The tag of logger `name`: 'attention_jax.training.loop' -> 'train'."""
    parts = name.split(".")
    if parts[0] != ROOT_LOGGER:
        return name
    sub = parts[1] if len(parts) > 1 else ""
    return TAGS.get(sub, sub) if sub in SUBPACKAGES else "model"


def _process_index() -> int:
    # Only if JAX is already up: logging must never be what starts a backend
    # (jax.distributed.initialize has to come first).
    jax = sys.modules.get("jax")
    try:
        return jax.process_index() if jax is not None else 0
    except Exception:  # a backend that failed to start is reported elsewhere
        return 0


class _StderrHandler(logging.Handler):
    """`[tag] LEVEL: message` on the current sys.stderr (looked up per record, so that
    tests capturing stderr see it)."""

    def emit(self, record: logging.LogRecord) -> None:
        index = _process_index()
        if index != 0 and record.levelno < logging.WARNING:
            return
        label = tag(record.name)
        if index != 0:
            label += f" p{index}"
        level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        try:
            print(f"[{label}] {level}{record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


def setup(level: int = logging.INFO) -> None:
    """Route this project's loggers to stderr (idempotent)."""
    logger = logging.getLogger(ROOT_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(level)
    logger.propagate = False  # absl's root handler would print them a second time

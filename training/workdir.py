"""A training workdir read back, for inference: the one module of training/ that
inference/ imports.

    model, config, step = restore_model("workdir/tiny", average_last=5)
    model, config, step, tokenizer = load_workdir("workdir/tiny")   # decode.py's: UserError

The workdir's config.json says how to build the model (training/config.py: the
code that built it for training), and its checkpoints
hold the parameters (training/checkpoints.py); only the `params` item is read.
Nothing else of training/ imports it: the in-loop evaluation already holds its model.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import ml_collections
from flax import nnx

from attention_jax import Transformer
from attention_jax.data import (
    TOKENIZER_FILENAME,
    Tokenizer,
    files_identity,
    has_tokenizer,
    load_tokenizer,
    tokenizer_names,
)
from attention_jax.runtime.errors import UserError
from attention_jax.training.checkpoints import CHECKPOINT_DIR, Checkpoints
from attention_jax.training.config import CONFIG_FILE, build_model, load_config, model_config

_log = logging.getLogger(__name__)


def restore_model(
    workdir: str,
    *,
    step: int | str | None = None,
    average_last: int = 1,
    sharding: jax.sharding.Sharding | None = None,
) -> tuple[Transformer, ml_collections.ConfigDict, int]:
    """The trained model of WORKDIR, its config, and the checkpoint step it was loaded from.

    Args:
      workdir: a training workdir (config.json + checkpoints/).
      step: the checkpoint to load; None = the newest complete one; "best" = the one
        of the best dev evaluation by config.best_metric (kept beside the newest).
      average_last: average the parameters of this many checkpoints ending at
        `step` (paper section 6.1); 1 = no averaging.
      sharding: where every array of the model goes (e.g. replicated over a mesh of
        all devices); None = the first local device.
    Raises:
      UserError: no workdir, no config.json, no checkpoint, unknown step, or a
        checkpoint that cannot be read (see `Checkpoints.restore_params`).
    """
    config = load_config(workdir)
    if average_last < 1:
        raise UserError(f"average_last must be >= 1, got {average_last}")
    try:
        model_cfg = model_config(config)  # attention resolved here, once, before tracing
    except ValueError as e:  # a hand-edited config.json
        raise UserError(f"{workdir}/{CONFIG_FILE}: {e}") from e
    device = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    graphdef, abstract_params, rngs = _fresh_model(config, model_cfg, device)
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(directory):
        raise UserError(f"no complete checkpoint in {directory}; train the model first")
    best_metric = config.get("best_metric", "chrf")
    with Checkpoints(workdir, create=False, best_metric=best_metric) as checkpoints:
        if step == "best":
            step = _best(checkpoints, best_metric, directory)
        step, chosen = _choose(checkpoints.all_steps(), step, average_last, directory)
        params = checkpoints.mean_params(chosen, abstract_params)
    return nnx.merge(graphdef, params, rngs), config, step


# (model config, seed, device) -> `_fresh_model`'s answer: another restore in this process
# (a second job, an ensemble's members) neither traces nor compiles the model's construction.
_FRESH: dict[tuple, tuple[nnx.GraphDef, Any, nnx.State]] = {}


def _fresh_model(
    config: ml_collections.ConfigDict, model_cfg: Any, device: jax.sharding.Sharding
) -> tuple[nnx.GraphDef, Any, nnx.State]:
    """(graphdef, the params as ShapeDtypeStructs on `device`, fresh dropout streams) of the
    model `config` builds: one trace of its construction, whose compiled program computes
    the streams alone (XLA drops the unused params init; a loaded model is for inference)."""
    key = (model_cfg, config.seed, device)
    if key not in _FRESH:
        _FRESH[key] = _traced_model(config, model_cfg, device)
    graphdef, params, rngs = _FRESH[key]
    # Variables of their own (nnx.merge adopts them): the same arrays, other Variables.
    return graphdef, params, jax.tree.map(lambda x: x, rngs)


def _traced_model(
    config: ml_collections.ConfigDict, model_cfg: Any, device: jax.sharding.Sharding
) -> tuple[nnx.GraphDef, Any, nnx.State]:
    """`_fresh_model`'s answer, traced and compiled (the graphdef and shapes noted as the
    trace passes by)."""
    traced = {}

    def streams() -> nnx.State:
        graphdef, params, rest = nnx.split(build_model(config, model_cfg), nnx.Param, ...)
        as_shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
        traced.update(graphdef=graphdef, params=jax.tree.map(as_shape, params))
        return rest

    rngs = jax.jit(streams, out_shardings=device)()
    return traced["graphdef"], traced["params"], rngs


def _best(checkpoints: Checkpoints, best_metric: str, directory: str) -> int:
    """The step of the best evaluated checkpoint (UserError if none was evaluated)."""
    best = checkpoints.best()
    if best is None:
        raise UserError(
            f"no checkpoint in {directory} holds a dev evaluation (config.best_metric="
            f"{best_metric}): train with config.eval_every_steps > 0, or decode a step"
        )
    step, metrics = best
    _log.info(f"the best checkpoint: step {step}, {metrics}")
    return step


def _choose(
    available: list[int], step: int | None, average_last: int, directory: str
) -> tuple[int, list[int]]:
    """(the step asked for, or the newest; the steps whose parameters to average)."""
    if not available:
        raise UserError(f"no complete checkpoint in {directory}; train the model first")
    if step is None:
        step = available[-1]
    if step not in available:
        raise UserError(f"no checkpoint for step {step} in {directory}; have {available}")
    chosen = [s for s in available if s <= step][-average_last:]
    if average_last > 1:
        what = f"averaged the parameters of {len(chosen)} checkpoint(s), steps {chosen}"
        if len(chosen) < average_last:
            _log.warning(
                f"asked to average the last {average_last} checkpoints up to step {step}, "
                f"but only {len(chosen)} exist: {what}"
            )
        else:
            _log.info(what)
    return step, chosen


def load_workdir(
    workdir: str,
    *,
    step: int | str | None = None,
    average_last: int = 1,
    sharding: jax.sharding.Sharding | None = None,
) -> tuple[Transformer, ml_collections.ConfigDict, int, Tokenizer]:
    """`restore_model` and the workdir's tokenizer, for decode.py: UserError says what is
    wrong (a missing workdir, tokenizer, config.json or checkpoint)."""
    if os.path.isdir(workdir) and not has_tokenizer(workdir):
        tokenizer_path = os.path.join(workdir, TOKENIZER_FILENAME)
        raise UserError(f"{tokenizer_path} is missing; was {workdir} made by train.py?")
    model, config, step = restore_model(
        workdir, step=step, average_last=average_last, sharding=sharding
    )
    return model, config, step, load_tokenizer(workdir)


def workdir_identity(workdir: str, step: int, average_last: int = 1) -> dict:
    """What a model restored by `restore_model(workdir, step=step, average_last=...)` is made
    of, for decode.py's resumable jobs: the workdir, the steps averaged, and a digest of the
    names, sizes and mtimes of their checkpoint files, config.json and the tokenizer (a
    retrained or edited workdir gives another identity)."""
    directory = os.path.join(workdir, CHECKPOINT_DIR)
    steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit() and int(d) <= step)
    steps = steps[-average_last:]
    files = [os.path.join(workdir, n) for n in (CONFIG_FILE, *tokenizer_names(workdir))]
    files += [os.path.join(directory, str(s)) for s in steps]
    return {"workdir": os.path.abspath(workdir), "steps": steps, "files": files_identity(files)}

"""Orbax checkpoints in WORKDIR/checkpoints: saving, resuming, and moving damaged ones aside.

A checkpoint step directory holds three items:
    params  the model parameters (restored alone by training/workdir.py)
    train   step, optimizer state and dropout RNG streams
    data    the input position of every data shard, and run totals (JSON)
`config.json` and `tokenizer.model` sit beside `checkpoints/` in the workdir.

Every process calls `save` and `restore`: Orbax writes and reads each process's
shards of the arrays cooperatively (process 0 writes the JSON item and
finalizes the step).

Orbax writes each step to a temporary directory and renames it only once
complete, so a save cut short (SIGKILL, power loss) is never picked up. Old
steps leave the same way: renamed into checkpoints/deleted/ (one atomic step),
then removed there, so a kill while an old step is removed file by file never
leaves a half-deleted step under a step number.
A step directory damaged later (a truncated or deleted file) fails to restore;
`restore_latest` then moves it to `checkpoints_damaged/` with a warning and
falls back to the previous step. Only evidence of damage does that: a restore
that fails otherwise (out of memory, a storage that refuses, an interrupt, an
error of the program) stops with what to change and moves nothing
(training/checkpoint_errors.py). Restoring takes abstract arrays that carry
the *current* shardings, so a checkpoint written on one mesh restores onto
another (8 devices -> 1, 2 processes -> 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from attention_jax.runtime import distributed
from attention_jax.runtime.errors import UserError
from attention_jax.training import retention, steps
from attention_jax.training.checkpoint_errors import (
    DAMAGED,
    WriteErrors,
    classify,
    describe,
    retry,
    stop_error,
)

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints_damaged"
TRASH_DIR = "deleted"  # inside checkpoints/: old steps on their way out

_log = logging.getLogger(__name__)


# --- Storage form -----------------------------------------------------------------
# Orbax stores plain arrays: nnx Variables are unwrapped to their values, and
# typed PRNG keys to their raw uint32 data.


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _storable(tree: Any) -> Any:
    def f(x):
        x = x.get_value() if _is_var(x) else x
        return jax.random.key_data(x) if _is_key(x) else x

    return jax.tree.map(f, tree, is_leaf=_is_var)


def _abstract_storable(abstract: Any) -> Any:
    """ShapeDtypeStructs (with shardings) in storage form."""

    def f(x):
        x = x.get_value() if _is_var(x) else x
        if _is_key(x):
            shape = jax.eval_shape(jax.random.key_data, x).shape
            return jax.ShapeDtypeStruct(shape, jnp.uint32, sharding=x.sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return jax.tree.map(f, abstract, is_leaf=_is_var)


def _from_storable(stored: Any, abstract: Any) -> Any:
    """Put restored plain arrays back into `abstract`'s structure (Variables, typed keys)."""
    abstract_leaves, treedef = jax.tree.flatten(abstract)
    leaves = [
        jax.random.wrap_key_data(x) if _is_key(a) else x
        for x, a in zip(jax.tree.leaves(stored), abstract_leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey/FlattenedIndexKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _arrays(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{dotted path: (shape, dtype)} of a tree's arrays, named as Orbax names them."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        ".".join(_key_name(k) for k in path): (tuple(x.shape), str(jnp.dtype(x.dtype)))
        for path, x in leaves
    }


def _differences(saved: dict, wanted: dict, limit: int = 3) -> list[str]:
    """What keeps `saved` arrays from restoring into `wanted` ones (the first few of each)."""
    out = []
    for names, where in (
        (sorted(set(saved) - set(wanted)), "only in the checkpoint"),
        (sorted(set(wanted) - set(saved)), "missing from it"),
    ):
        if names:
            out.append(f"{len(names)} array(s) {where} ({', '.join(names[:limit])})")
    for name in sorted(set(saved) & set(wanted)):
        if saved[name][0] != wanted[name][0]:
            out.append(f"{name}: shape {saved[name][0]} in the checkpoint, {wanted[name][0]} now")
    return out[: 2 + limit]


class StructureMismatch(UserError):
    """The checkpoint holds other arrays than the state to restore: a config change, not damage.

    items: {"params" | "train": [differences]} for the items that do not match.
    """

    def __init__(self, step: int, items: dict[str, list[str]]):
        self.step, self.items = step, items
        what = "; ".join(f"{k}: {', '.join(v)}" for k, v in items.items())
        super().__init__(f"checkpoint step {step} does not match the state to restore ({what})")


# --- The manager -----------------------------------------------------------------


class Checkpoints:
    """`ocp.CheckpointManager` over WORKDIR/checkpoints with our three items; with a
    `best_metric` (config.best_metric), the checkpoint of the best dev evaluation is kept
    beside the last `max_to_keep`."""

    def __init__(
        self,
        workdir: str,
        *,
        max_to_keep: int | None = 5,
        best_metric: str | None = None,
        create: bool = True,
    ):
        self.directory = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
        self.best_metric = best_metric
        self._orbax = ocp.CheckpointManager(
            self.directory,
            options=retention.manager_options(max_to_keep, best_metric, create, TRASH_DIR),
            item_names=("params", "train", "data"),
        )

    def best(self) -> tuple[int, dict[str, Any]] | None:
        """(step, its dev metrics) of the best evaluated checkpoint kept; None if no
        checkpoint was saved with an evaluation (or no best_metric is tracked)."""
        if self.best_metric is None:
            return None
        step = self._orbax.best_step()
        metrics = None if step is None else self._orbax.metrics(step)
        key, _ = retention.BEST_METRICS[self.best_metric]
        return None if not metrics or key not in metrics else (step, metrics)

    def all_steps(self) -> list[int]:
        """Complete checkpoints only, oldest first."""
        return sorted(self._orbax.all_steps())

    def latest_step(self) -> int | None:
        return self._orbax.latest_step()

    def save(
        self,
        state: steps.TrainState,
        data_state: dict[str, Any],
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Start an asynchronous save of `state` at `state.step`; returns once arrays are copied.
        metrics: the dev evaluation of this step, if there was one (the best is kept).

        Raises UserError if this save, or the previous one still in flight,
        cannot be written (disk full, workdir not writable); earlier complete
        checkpoints are never touched by a failed save.
        """
        stored = _storable(state)
        train = {"step": stored.step, "opt_state": stored.opt_state, "rngs": stored.rngs}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(stored.params),
            train=ocp.args.StandardSave(train),
            data=ocp.args.JsonSave(data_state),
        )
        step = int(jax.device_get(state.step))
        with self._write_errors(step):
            self._orbax.wait_until_finished()  # what save() starts with: the trash is settled
            self._empty_trash()
            tracked = None
            if self.best_metric is not None:  # every save has some: Orbax warns otherwise
                tracked = {"step": step, **(metrics or {})}
            self._orbax.save(step, args=args, force=True, metrics=tracked)

    def _empty_trash(self) -> None:
        """Remove the old steps Orbax moved to checkpoints/deleted/ (process 0; its other
        processes share the filesystem). The folder itself stays, for Orbax's next rename."""
        trash = os.path.join(self.directory, TRASH_DIR)
        if jax.process_index() == 0 and os.path.isdir(trash):
            for name in os.listdir(trash):
                shutil.rmtree(os.path.join(trash, name), ignore_errors=True)

    def _write_errors(self, step: int) -> WriteErrors:
        return WriteErrors(self.directory, step, self.all_steps)

    def restore(
        self, step: int, abstract_state: steps.TrainState
    ) -> tuple[steps.TrainState, dict[str, Any]]:
        """(TrainState placed as `abstract_state`'s shardings say, data iterator state)."""
        target = _abstract_storable(abstract_state)
        train = {"step": target.step, "opt_state": target.opt_state, "rngs": target.rngs}
        out = self._orbax.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target.params),
                train=ocp.args.StandardRestore(train),
                data=ocp.args.JsonRestore(),
            ),
        )
        t = out["train"]
        stored = steps.TrainState(t["step"], out["params"], t["opt_state"], t["rngs"])
        return _from_storable(stored, abstract_state), out["data"]

    def restore_params(self, step: int, abstract_params: nnx.State) -> nnx.State:
        """Only the `params` item (no optimizer state is read).

        Raises UserError saying why if it cannot be read (a damaged checkpoint,
        out of memory, ...; see training/checkpoint_errors.py); moves nothing.
        """
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract_storable(abstract_params))
        )
        try:
            out = retry(lambda: self._orbax.restore(step, args=args))
        except Exception as e:
            if classify(e) == DAMAGED:
                raise UserError(
                    f"checkpoint step {step} in {self.directory} cannot be read ({describe(e)}): "
                    "its files are damaged; use another checkpoint"
                ) from e
            if (error := stop_error(e, step, self.directory)) is None:
                raise
            raise error from e
        return _from_storable(out["params"], abstract_params)

    def mean_params(self, chosen: Sequence[int], abstract_params: nnx.State) -> nnx.State:
        """The element-wise mean of the params of steps `chosen` (paper 6.1: the last 5 or 20).

        A running sum: one parameter set in memory besides the total, however many steps.
        """
        total = None
        for step in chosen:
            params = self.restore_params(step, abstract_params)
            total = params if total is None else jax.tree.map(jnp.add, total, params)
        return total if len(chosen) == 1 else jax.tree.map(lambda x: x / len(chosen), total)

    def wait(self) -> None:
        """Block until the save in flight is on disk (UserError if it could not be written)."""
        with self._write_errors(-1):
            self._orbax.wait_until_finished()
            self._orbax.check_for_errors()

    def _mismatch(self, step: int, abstract_state: steps.TrainState) -> dict[str, list[str]]:
        """{item: differences} between step's stored arrays and the state to restore.

        Reads only the items' metadata (no arrays); raises if that cannot be read.
        """
        target = _abstract_storable(abstract_state)
        wanted = {
            "params": target.params,
            "train": {"step": target.step, "opt_state": target.opt_state, "rngs": target.rngs},
        }
        out = {}
        for item, tree in wanted.items():
            path = epath.Path(self.directory) / str(step) / item
            handler = ocp.PyTreeCheckpointHandler()
            try:
                meta = retry(lambda h=handler, p=path: h.metadata(p))
            finally:
                handler.close()
            saved = _arrays(getattr(meta, "tree", meta))
            if differences := _differences(saved, _arrays(tree)):
                out[item] = differences
        return out

    def restore_latest(
        self, abstract_state: steps.TrainState, *, quarantine: bool = True
    ) -> tuple[int, steps.TrainState, dict[str, Any]] | None:
        """(step, state, data) of the newest checkpoint that restores; None if there is none.

        A checkpoint whose arrays differ from `abstract_state` (another model or
        optimizer config) raises StructureMismatch and is left where it is. A step
        whose files are damaged (missing, truncated, undecodable), still after
        retries for storage that hiccups, is reported and, with `quarantine`,
        moved to WORKDIR/checkpoints_damaged/; the previous step is tried next.
        Any other failure, on any process, stops every process and moves nothing
        (training/checkpoint_errors.py). Raises UserError if checkpoints exist
        but none of them restores.
        """
        tried: list[str] = []
        for step in reversed(self.all_steps()):
            verdict, result = self._try_restore(step, abstract_state)
            # Every process must agree (one of them may hold the damaged shard, or fail).
            verdicts = distributed.allgather_json(verdict)
            if verdict == "failed":
                raise result
            if "failed" in verdicts:
                raise UserError(
                    f"process {verdicts.index('failed')} could not restore checkpoint step "
                    f"{step} (its log says why); the checkpoints were not touched"
                )
            if all(v == "ok" for v in verdicts):
                mismatch, state, data_state = result
                if mismatch:
                    raise StructureMismatch(step, mismatch)
                if tried:
                    _log.warning(f"resuming from step {step}, the newest usable checkpoint")
                return step, state, data_state
            reason = result if verdict == DAMAGED else "another process could not read its part"
            tried.append(f"step {step} ({reason})")
            _log.warning(f"checkpoint {self.directory}/{step} is damaged and is skipped: {reason}")
            if quarantine:
                self._quarantine(step)
        if tried:
            raise UserError(
                f"no usable checkpoint in {self.directory}: "
                + "; ".join(tried)
                + ". Restore the directory from a backup, or start from scratch with "
                "--config.allow_fresh_start=True (damaged steps were moved to "
                f"{os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)})"
            )
        return None

    def _try_restore(self, step: int, abstract_state: steps.TrainState) -> tuple[str, Any]:
        """("ok", (structure differences, state, data)), (DAMAGED, why), or ("failed", the
        exception to stop with). KeyboardInterrupt and SystemExit propagate."""
        try:
            mismatch = self._mismatch(step, abstract_state)
            if mismatch:
                return "ok", (mismatch, None, None)
            state, data_state = retry(lambda: self.restore(step, abstract_state))
            return "ok", ({}, state, data_state)
        except Exception as e:
            if classify(e) == DAMAGED:
                return DAMAGED, describe(e)
            return "failed", stop_error(e, step, self.directory) or e
        except (KeyboardInterrupt, SystemExit):
            _log.warning(f"interrupted while restoring checkpoint step {step}: nothing was moved")
            raise

    def restore_without_optimizer(
        self, step: int, abstract_state: steps.TrainState
    ) -> tuple[steps.TrainState, dict[str, Any]]:
        """Params, step, RNG streams and data position of `step`; opt_state is None.

        For a resume whose optimizer state changed structure (config.reset_optimizer):
        the old optimizer state is read in the structure the checkpoint's metadata
        gives (replicated: a one-time cost), then dropped.
        """
        target = _abstract_storable(abstract_state)
        mesh = getattr(jax.tree.leaves(target.params)[0].sharding, "mesh", None)
        placed = (
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            if mesh is not None
            else jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        )
        handler = ocp.PyTreeCheckpointHandler()
        try:
            path = epath.Path(self.directory) / str(step) / "train"
            meta = retry(lambda: handler.metadata(path))
        finally:
            handler.close()
        old_opt = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=placed),
            getattr(meta, "tree", meta)["opt_state"],
        )
        train = {"step": target.step, "opt_state": old_opt, "rngs": target.rngs}
        args = ocp.args.Composite(
            params=ocp.args.StandardRestore(target.params),
            train=ocp.args.StandardRestore(train),
            data=ocp.args.JsonRestore(),
        )
        out = retry(lambda: self._orbax.restore(step, args=args))
        t = out["train"]
        stored = steps.TrainState(t["step"], out["params"], None, t["rngs"])
        return _from_storable(stored, abstract_state.replace(opt_state=None)), out["data"]

    def _quarantine(self, step: int) -> None:
        """Move step `step` out of checkpoints/ (process 0), then reload the step list."""
        if jax.process_index() == 0:
            src = os.path.join(self.directory, str(step))
            dest_dir = os.path.join(os.path.dirname(self.directory), DAMAGED_DIR)
            os.makedirs(dest_dir, exist_ok=True)
            dest = os.path.join(dest_dir, f"{step}.{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(src, dest)
            _log.warning(f"moved the damaged step to {dest}")
        distributed.sync(f"quarantine-{step}")
        self._orbax.reload()

    def close(self) -> None:
        """Finish the save in flight, then remove the steps it retired."""
        self._orbax.close()
        self._empty_trash()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Let the save in flight finish, so the newest checkpoint is complete, then close.

        After an error (non-finite step, disk full, a signal's exception) the
        original error is what propagates, not a second one from the save.
        """
        if exc is None:
            try:
                self.wait()
            finally:
                with contextlib.suppress(Exception):  # wait() has raised what went wrong
                    self.close()
            return
        try:
            self.wait()
            self.close()
        except Exception as e:
            _log.warning(f"while stopping after an error, the last save failed too: {e}")

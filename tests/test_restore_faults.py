"""Restores that fail for other reasons than damage: out of memory, an interrupt, a missing
device, an error of the program, a storage that refuses. Each is injected into Orbax's
restore; each must stop the run with a clear message, leave checkpoints/ as it was (no
step moved to checkpoints_damaged/), and let the next normal run resume from the newest
step. (Real damage, truncated or missing files: tests/test_faults.py.)"""

import errno
import glob
import os
import re

import jax
import orbax.checkpoint as ocp
import pytest

from attention_jax.runtime.errors import UserError
from attention_jax.training import checkpoint_errors, train_and_evaluate
from attention_jax.training.workdir import restore_model
from tests.fault_runs import cfg, copy, run_train_py

# The fixtures `corpus` and `base` (tests/conftest.py): the fault tests' finished 20-step
# run (checkpoints at 10 and 20), one of this module's own.

OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."


def _raised_from(cause: BaseException) -> Exception:
    """An error as Orbax re-raises one from TensorStore: a wrapper, `cause` beneath it."""
    try:
        try:
            raise cause
        except BaseException as e:
            raise Exception("Encountered error while reading array index") from e
    except Exception as wrapped:
        return wrapped


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (FileNotFoundError(errno.ENOENT, "No such file"), checkpoint_errors.DAMAGED),
        (ValueError("DATA_LOSS: Error reading chunk: checksum mismatch"), "damaged"),
        (ValueError("OUT_OF_RANGE: Truncated read"), "damaged"),
        (OSError(errno.EIO, "Input/output error"), "damaged"),
        (EOFError("unexpected end"), "damaged"),
        (PermissionError(errno.EACCES, "Permission denied"), checkpoint_errors.STORAGE),
        (OSError(errno.ETIMEDOUT, "Connection timed out"), "storage"),
        (ValueError("UNAVAILABLE: GCS backend unreachable"), "storage"),
        (ValueError("DEADLINE_EXCEEDED: read timed out"), "storage"),
        (jax.errors.JaxRuntimeError(OUT_OF_MEMORY), checkpoint_errors.OUT_OF_MEMORY),
        (TypeError("an error of the program"), checkpoint_errors.BUG),
        (RuntimeError("Unable to initialize backend 'cuda'"), checkpoint_errors.OTHER),
    ],
)
def test_only_evidence_of_damage_is_classified_as_damage(error, kind):
    """The decision to move a checkpoint aside: damage only, also when Orbax wraps it."""
    assert checkpoint_errors.classify(error) == kind
    if kind != checkpoint_errors.BUG:  # a bug is judged by the outermost error only
        assert checkpoint_errors.classify(_raised_from(error)) == kind


def fail_restores(monkeypatch, error: BaseException) -> list[int]:
    """Every Orbax restore raises `error`; returns the list its calls are counted in."""
    calls = []

    def restore(self, *args, **kwargs):
        calls.append(1)
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
    return calls


def files(workdir) -> list[tuple[str, int]]:
    """Every file under WORKDIR/checkpoints, with its size."""
    paths = glob.glob(os.path.join(workdir, "checkpoints", "**"), recursive=True)
    return sorted(
        (os.path.relpath(p, workdir), os.path.getsize(p)) for p in paths if os.path.isfile(p)
    )


def resume_failing(corpus, workdir, monkeypatch, capfd, error, raised, message, attempts):
    """Resume WORKDIR (checkpoints at 10 and 20) with every restore raising `error`: it
    raises `raised` (matching `message`) after `attempts` reads, and moves nothing;
    then a resume without the fault goes on from step 20. Returns the exception."""
    before = files(workdir)
    with monkeypatch.context() as patch:
        calls = fail_restores(patch, error)
        with pytest.raises(raised, match=re.escape(message) if message else None) as e:
            train_and_evaluate(cfg(corpus, num_train_steps=22), str(workdir))
    assert len(calls) == attempts
    assert files(workdir) == before and not os.path.exists(workdir / "checkpoints_damaged")
    capfd.readouterr()
    summary = train_and_evaluate(cfg(corpus, num_train_steps=22), str(workdir))
    assert summary["step"] == 22 and "resumed from step 20" in capfd.readouterr().err
    return e.value


@pytest.mark.parametrize(
    ("error", "raised", "message"),
    [
        (jax.errors.JaxRuntimeError(OUT_OF_MEMORY), UserError, "out of memory, not damage"),
        # ~20 s each (train.py runs): out of memory in make test, the others in make test-slow.
        pytest.param(
            RuntimeError("Unable to initialize backend 'cuda'"),
            UserError,
            "not evidence of damage",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            TypeError("an error of the program"),
            TypeError,
            "an error of the program",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            AttributeError("'NoneType' object has no attribute 'shape'"),
            AttributeError,
            "shape",
            marks=pytest.mark.slow,
        ),
        pytest.param(KeyboardInterrupt(), KeyboardInterrupt, "", marks=pytest.mark.slow),
        pytest.param(SystemExit(3), SystemExit, "", marks=pytest.mark.slow),
    ],
    ids=["out-of-memory", "no-device", "type-error", "attribute-error", "ctrl-c", "exit"],
)
def test_a_restore_failing_for_another_reason_than_damage_moves_nothing(
    base, corpus, tmp_path, monkeypatch, capfd, error, raised, message
):
    """Not retried (only storage errors are), nothing moved, the next run resumes."""
    w = copy(base, tmp_path)
    e = resume_failing(corpus, w, monkeypatch, capfd, error, raised, message, attempts=1)
    if raised is UserError:
        assert "checkpoint step 20" in str(e) and "not touched" in str(e)
    if "out of memory" in message:  # what to change
        for fix in ("--config.mesh_fsdp", "fewer devices per host", "JAX_PLATFORMS=cpu"):
            assert fix in str(e)


@pytest.mark.slow  # ~26 s; test_faults' read retried once is in make test
def test_a_storage_that_refuses_is_retried_then_stops_without_moving(
    base, corpus, tmp_path, monkeypatch, capfd
):
    w = copy(base, tmp_path)
    refused = PermissionError(errno.EACCES, "Permission denied")
    message = "the storage refused or timed out"
    resume_failing(corpus, w, monkeypatch, capfd, refused, UserError, message, attempts=3)


def test_restoring_a_model_out_of_memory_says_so_and_moves_nothing(base, tmp_path, monkeypatch):
    w = copy(base, tmp_path)
    before = files(w)
    fail_restores(monkeypatch, jax.errors.JaxRuntimeError(OUT_OF_MEMORY))
    with pytest.raises(UserError, match="out of memory, not damage"):
        restore_model(str(w))
    assert files(w) == before


# train.py with every Orbax restore out of memory, as an accelerator would report it.
OOM_TRAIN = f"""
import runpy, sys
import jax, orbax.checkpoint as ocp

def restore(self, *args, **kwargs):
    raise jax.errors.JaxRuntimeError({OUT_OF_MEMORY!r})

ocp.CheckpointManager.restore = restore
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_train_py_out_of_memory_while_restoring_is_one_line_and_exit_1(base, corpus, tmp_path):
    w = copy(base, tmp_path)
    before = files(w)
    args = ["--config=tests/small_config.py", f"--workdir={w}", f"--config.dataset={corpus}"]
    args += ["--config.num_train_steps=22", "--config.final_eval_max_examples=2"]
    proc = run_train_py(*args, code=OOM_TRAIN)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "restoring checkpoint step 20" in line and "out of memory" in line
    assert "--config.mesh_fsdp" in line
    assert files(w) == before and not os.path.exists(w / "checkpoints_damaged")
    proc = run_train_py(*args)  # the next normal run
    assert proc.returncode == 0 and "resumed from step 20" in proc.stderr, proc.stderr[-3000:]

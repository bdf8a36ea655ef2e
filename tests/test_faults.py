"""Faults a long run must survive, or report clearly: damaged checkpoints, NaN/Inf
steps, a full disk or unwritable workdir, config mistakes, and a change of device
count between runs. (SIGKILL at random moments: tests/fault_trials.py, slow.)"""

import errno
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from attention_jax.runtime.errors import UserError
from attention_jax.training import checkpoints, steps, train_and_evaluate
from attention_jax.training.mesh import make_mesh, shard_batch
from attention_jax.training.workdir import restore_model
from tests.conftest import small_train_config, train_losses
from tests.fault_runs import cfg, copy, run_train_py
from tests.training import reverse_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_files(workdir, step, pattern):
    return sorted(glob.glob(str(workdir / "checkpoints" / str(step) / pattern), recursive=True))


# --- Damaged checkpoints -------------------------------------------------------------


def test_truncated_newest_checkpoint_is_skipped_for_the_previous_one(base, corpus, tmp_path, capfd):
    w = copy(base, tmp_path)
    # Truncate the largest parameter data file of step 20 (the bulk of the weights).
    data_files = [f for f in step_files(w, 20, "params/**/d/*") if os.path.isfile(f)]
    biggest = max(data_files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    summary = train_and_evaluate(cfg(corpus), str(w))
    err = capfd.readouterr().err
    assert "checkpoints/20 is damaged and is skipped" in err
    assert "resumed from step 10" in err
    assert [d.split(".")[0] for d in os.listdir(w / "checkpoints_damaged")] == ["20"]
    # Steps 11..20 were redone from step 10 and match the first run exactly.
    assert summary["step"] == 20
    assert train_losses(w)[15] == pytest.approx(train_losses(base)[15], rel=1e-6)
    assert train_losses(w)[20] == pytest.approx(train_losses(base)[20], rel=1e-6)
    assert checkpoints.Checkpoints(str(w)).all_steps() == [10, 20]


@pytest.mark.slow  # ~35 s of train.py runs
def test_no_usable_checkpoint_is_an_error_unless_a_fresh_start_is_allowed(base, corpus, tmp_path):
    w = copy(base, tmp_path)
    for step in (10, 20):  # delete the JSON data item of every checkpoint
        for f in step_files(w, step, "data/*"):
            os.remove(f)
    with pytest.raises(UserError, match="no usable checkpoint") as e:
        train_and_evaluate(cfg(corpus), str(w))
    assert "allow_fresh_start" in str(e.value)
    # The damaged steps were moved aside; a second run must still refuse.
    assert checkpoints.Checkpoints(str(w)).all_steps() == []
    with pytest.raises(UserError, match="had checkpoints but none is usable"):
        train_and_evaluate(cfg(corpus), str(w))
    summary = train_and_evaluate(cfg(corpus, allow_fresh_start=True, num_train_steps=2), str(w))
    assert summary["step"] == 2 and sorted(train_losses(w)) == [2]


def test_a_read_that_fails_once_is_retried_not_quarantined(base, corpus, tmp_path, monkeypatch):
    w = copy(base, tmp_path)
    original, calls = checkpoints.Checkpoints.restore, []

    def flaky(self, step, abstract):
        calls.append(step)
        if len(calls) == 1:
            raise OSError(5, "Input/output error (a network filesystem hiccup)")
        return original(self, step, abstract)

    monkeypatch.setattr(checkpoints.Checkpoints, "restore", flaky)
    summary = train_and_evaluate(cfg(corpus, num_train_steps=22), str(w))
    assert calls == [20, 20] and summary["step"] == 22
    assert not os.path.exists(w / "checkpoints_damaged")


# --- Config changes on resume ----------------------------------------------------------


@pytest.mark.slow  # ~20 s of train.py runs
def test_changes_that_keep_the_state_structure_resume_and_are_listed(base, corpus, tmp_path, capfd):
    w = copy(base, tmp_path)
    changed = dict(learning_rate=5e-3, grad_clip_norm=0.5, num_train_steps=24)
    changed["search.beam_size"] = 3
    summary = train_and_evaluate(cfg(corpus, **changed), str(w))
    err = capfd.readouterr().err
    assert "resumed from step 20" in err and summary["step"] == 24
    assert "config changed since the checkpoints were written" in err
    for line in ("learning_rate: checkpoint 0.002, config 0.005", "grad_clip_norm: checkpoint 1.0"):
        assert line in err
    assert not os.path.exists(w / "checkpoints_damaged")


@pytest.mark.slow  # ~17 s of train.py runs
def test_an_optimizer_structure_change_stops_and_reset_optimizer_resumes(base, corpus, tmp_path):
    w = copy(base, tmp_path)
    before = sorted(os.listdir(w / "checkpoints"))
    with pytest.raises(UserError) as e:  # no clipping: one optax transform fewer
        train_and_evaluate(cfg(corpus, grad_clip_norm=0.0, num_train_steps=24), str(w))
    msg = str(e.value)
    assert "grad_clip_norm: checkpoint 1.0, config 0.0" in msg
    assert "--config.reset_optimizer=True" in msg and "damaged" not in msg
    assert sorted(os.listdir(w / "checkpoints")) == before  # nothing moved or written
    assert not os.path.exists(w / "checkpoints_damaged")

    # The way forward keeps the parameters, the step and the data position.
    summary = train_and_evaluate(
        cfg(corpus, grad_clip_norm=0.0, num_train_steps=24, reset_optimizer=True), str(w)
    )
    assert summary["step"] == 24
    manager = checkpoints.Checkpoints(str(w))
    assert manager.all_steps()[-1] == 24
    config = cfg(corpus, grad_clip_norm=0.0)
    setup = steps.train_setup(config, make_mesh(config))
    restored, _ = manager.restore(24, setup.abstract)  # the new structure is what is saved
    counts = [
        int(x)
        for p, x in jax.tree_util.tree_leaves_with_path(restored.opt_state)
        if getattr(p[-1], "name", None) == "count"
    ]
    assert counts and set(counts) == {24}  # the schedule went on from step 20


def test_a_model_structure_change_names_the_fields(base, corpus, tmp_path):
    w = copy(base, tmp_path)
    with pytest.raises(UserError) as e:
        train_and_evaluate(cfg(corpus, vocab_size=280, reset_optimizer=True), str(w))
    assert "vocab_size: checkpoint 300, config 280" in str(e.value)
    assert "fresh --workdir" in str(e.value)


# --- Vocabulary sizes --------------------------------------------------------------------


def test_a_vocabulary_too_small_for_the_corpus_is_one_line_naming_the_minimum(corpus, tmp_path):
    proc = run_train_py(
        "--config=tests/small_config.py",
        f"--workdir={tmp_path}",
        f"--config.dataset={corpus}",
        "--config.vocab_size=262",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "config.vocab_size=262 is too small for this corpus" in line
    assert "need at least" in line and "or more" in line


@pytest.mark.slow  # ~40 s: trains and decodes
def test_a_vocabulary_larger_than_the_corpus_supports_trains_and_decodes(corpus, tmp_path, capfd):
    from attention_jax.data import Tokenizer

    w = tmp_path / "w"
    summary = train_and_evaluate(cfg(corpus, vocab_size=3000, num_train_steps=10), str(w))
    tok = Tokenizer.load(str(w / "tokenizer.model"))
    assert summary["step"] == 10 and tok.vocab_size < 3000
    assert f"supports only {tok.vocab_size} pieces" in capfd.readouterr().err
    # The model has 3000 output rows; decode.py (like the evaluation) never emits the
    # ids the tokenizer lacks, even from a barely trained model.
    with open(corpus[len("tsv:") :]) as f:
        sources = "".join(line.split("\t")[0] + "\n" for line in f.readlines()[:20])
    proc = subprocess.run(
        [sys.executable, "decode.py", f"--workdir={w}", "--output_format=jsonl", "--n_best=2"],
        input=sources,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = [
        t
        for line in proc.stdout.splitlines()
        for h in json.loads(line)["hypotheses"]
        for t in h["tokens"]
    ]
    assert tokens and max(tokens) < tok.vocab_size


# --- NaN / Inf -----------------------------------------------------------------------


def _poison_loss(monkeypatch):
    """loss_sums returns a NaN loss for batches whose first target token is 5."""
    original = steps.loss_sums

    def poisoned(logits, targets, label_smoothing):
        sums = original(logits, targets, label_smoothing)
        bad = targets[0, 0] == 5
        sums["loss"] = jax.numpy.where(bad, jax.numpy.nan, sums["loss"])
        return sums

    monkeypatch.setattr(steps, "loss_sums", poisoned)


def test_nonfinite_step_leaves_params_and_optimizer_state_unchanged(monkeypatch):
    _poison_loss(monkeypatch)
    config = small_train_config(vocab_size=64)
    mesh = make_mesh(config)
    setup = steps.train_setup(config, mesh)
    state = steps.init_train_state(setup)
    train_step = steps.make_train_step(setup)
    rng = np.random.default_rng(0)
    good, bad = reverse_batch(rng, 8, 10, 64), reverse_batch(rng, 8, 10, 64)
    good["tgt_out"][0, 0], bad["tgt_out"][0, 0] = 7, 5
    before = jax.device_get((state.params, state.opt_state))
    state, m = train_step(state, shard_batch(bad, mesh))
    after = jax.device_get((state.params, state.opt_state))
    assert int(m["nonfinite"]) == 1 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    state, m = train_step(state, shard_batch(good, mesh))
    assert int(m["nonfinite"]) == 0 and np.isfinite(float(m["loss"]))
    moved = jax.tree.leaves(jax.device_get(state.params))
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after[0]), moved, strict=True)
    )


# lr 1e30: the first Adam update makes the weights ~1e29, the next logits overflow.
DIVERGE = dict(learning_rate=1e30, warmup_steps=1, grad_clip_norm=0.0, num_train_steps=12)


# ~17 s: test_nonfinite_step_leaves_params_and_optimizer_state_unchanged is in make test.
@pytest.mark.slow
def test_nonfinite_stop_policy_stops_and_keeps_the_last_checkpoint(corpus, tmp_path):
    w = tmp_path / "w"
    config = cfg(corpus, nonfinite_policy="stop", checkpoint_every_steps=1, **DIVERGE)
    with pytest.raises(UserError, match=r"non-finite loss or gradients at step \d+") as e:
        train_and_evaluate(config, str(w))
    assert "nonfinite_policy" in str(e.value)
    saved = checkpoints.Checkpoints(str(w)).all_steps()
    assert saved, "the finite steps before the blow-up were checkpointed"
    model, _, _ = restore_model(str(w))
    from flax import nnx

    assert all(
        np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.Param))
    )


@pytest.mark.slow  # ~16 s of train.py runs
def test_nonfinite_skip_policy_counts_and_gives_up_on_divergence(corpus, tmp_path):
    w = tmp_path / "w"
    config = cfg(corpus, nonfinite_policy="skip", max_consecutive_nonfinite=3, **DIVERGE)
    with pytest.raises(UserError, match="non-finite steps in a row"):
        train_and_evaluate(config, str(w))
    with open(w / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    counted = [r["nonfinite_steps"] for r in rows if "nonfinite_steps" in r]
    assert counted and counted[-1] >= 3


def test_old_steps_leave_by_rename_so_a_kill_while_removing_one_leaves_complete_steps(
    base, corpus, tmp_path, monkeypatch
):
    """Removing a step is many file deletions; were they done under the step's name, a
    SIGKILL among them would leave a step directory that lists as complete and does not
    restore (seen in the SIGKILL trials). Steps leave checkpoints/ by one rename."""
    w = copy(base, tmp_path)
    config = cfg(corpus)
    setup = steps.train_setup(config, make_mesh(config))
    removed = []
    real_rmtree = shutil.rmtree

    def spy(path, *args, **kwargs):
        removed.append(os.path.relpath(str(path), w / "checkpoints"))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", spy)
    manager = checkpoints.Checkpoints(str(w), max_to_keep=2)
    state, data = manager.restore(20, setup.abstract)
    manager.save(state.replace(step=state.step + 10), data)  # step 30: step 10 goes
    manager.wait()
    assert manager.all_steps() == [20, 30]
    assert not [p for p in removed if p.split(os.sep)[0].isdigit()], removed  # none in place

    def killed(path, *args, **kwargs):  # removes one file of the step, then the process dies
        victim = next(f for f in glob.glob(f"{path}/**", recursive=True) if os.path.isfile(f))
        os.remove(victim)
        raise SystemExit("SIGKILL")

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(SystemExit):
        manager.save(state.replace(step=state.step + 20), data)
    monkeypatch.setattr(shutil, "rmtree", spy)
    manager._orbax.close()
    after = checkpoints.Checkpoints(str(w), max_to_keep=2)
    assert after.all_steps() == [20, 30]
    for step in after.all_steps():
        after.restore(step, setup.abstract)
    after.save(state.replace(step=state.step + 20), data)  # step 40 empties the trash
    after.wait()
    assert after.all_steps() == [30, 40]
    after.close()
    assert os.listdir(w / "checkpoints" / checkpoints.TRASH_DIR) == []


# --- Disk full / unwritable -----------------------------------------------------------


def test_disk_full_during_a_save_is_a_clear_error_and_keeps_earlier_checkpoints(
    base, corpus, tmp_path, monkeypatch
):
    from orbax.checkpoint._src.path import async_path

    w = copy(base, tmp_path)

    async def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(async_path, "write_text", full)
    with pytest.raises(UserError, match="No space left on device") as e:
        train_and_evaluate(cfg(corpus, num_train_steps=25, checkpoint_every_steps=5), str(w))
    msg = str(e.value)
    assert "free disk space" in msg and "re-run the same command" in msg
    monkeypatch.undo()
    assert checkpoints.Checkpoints(str(w)).all_steps() == [10, 20]
    _, _, step = restore_model(str(w))
    assert step == 20


def test_unwritable_workdir_fails_before_training(corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="not writable"):
        train_and_evaluate(cfg(corpus), str(blocker / "workdir"))


# --- Config mistakes, found before compiling ----------------------------------------------


@pytest.fixture
def no_compile(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a config mistake must be reported before compiling")

    monkeypatch.setattr(steps, "make_train_step", fail)
    monkeypatch.setattr(steps, "make_buffered_steps", fail)  # the one the loop calls
    monkeypatch.setattr(steps, "init_train_state", fail)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh_data": 3}, r"multiply to 3, but there are 1 devices"),
        ({"grad_accum_steps": 32}, r"batch_tokens=256 cannot fill the batch axes"),
        ({"nonfinite_policy": "ignore"}, r"nonfinite_policy must be one of"),
        ({"data_shards": -1}, r"data_shards"),
    ],
)
def test_config_mistakes(corpus, tmp_path, no_compile, overrides, message):
    with pytest.raises(UserError, match=message):
        train_and_evaluate(cfg(corpus, **overrides), str(tmp_path / "w"))


def test_unknown_config_key_names_the_closest_field(corpus, tmp_path, no_compile):
    config = cfg(corpus)
    config.num_train_step = 5
    config.model.d_modle = 64
    with pytest.raises(UserError) as e:
        train_and_evaluate(config, str(tmp_path / "w"))
    msg = str(e.value)
    assert "config.num_train_step (did you mean 'num_train_steps'?)" in msg
    assert "config.model.d_modle (did you mean 'd_model'?)" in msg


def test_resume_with_another_model_config_says_what_differs(base, corpus, tmp_path, no_compile):
    w = copy(base, tmp_path)
    config = cfg(corpus)
    config.model.d_model, config.model.num_encoder_layers = 64, 2
    with pytest.raises(UserError) as e:
        train_and_evaluate(config, str(w))
    msg = str(e.value)
    assert "model.d_model: checkpoint 32, config 64" in msg
    assert "model.num_encoder_layers: checkpoint 1, config 2" in msg
    assert "fresh --workdir" in msg
    with open(w / "config.json") as f:
        assert json.load(f)["model"]["d_model"] == 32  # not overwritten


def test_tokenizer_vocabulary_must_match_the_config(base, corpus, tmp_path, no_compile):
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(base / "tokenizer.model", w / "tokenizer.model")
    with pytest.raises(UserError, match=r"vocabulary of 300, but config\.vocab_size is 280"):
        train_and_evaluate(cfg(corpus, vocab_size=280), str(w))


# --- Resume on another device count -----------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    import jax
    from tests.conftest import small_train_config
    from attention_jax.training import train_and_evaluate
    assert jax.device_count() == int(sys.argv[3]), jax.devices()
    overrides = json.loads(sys.argv[1])
    s = train_and_evaluate(small_train_config(**overrides), sys.argv[2])
    print("STEP", s["step"])
    """
)


def run_on_devices(n, overrides, workdir):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(overrides), str(workdir), str(n)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


@pytest.mark.slow
def test_resume_on_another_device_count(base, corpus, tmp_path):
    """8 devices -> 1 (this process) and 1 -> 4 (a child): the run goes on from the step."""
    over = dict(dataset=corpus, final_eval_max_examples=2)
    w8 = tmp_path / "w8"
    run_on_devices(8, {**over, "num_train_steps": 10}, w8)
    summary = train_and_evaluate(cfg(corpus, num_train_steps=20), str(w8))
    assert summary["step"] == 20 and sorted(train_losses(w8)) == [5, 10, 15, 20]
    # The resumed 1-device run starts from the 8-device parameters: step 15 is close to
    # the all-1-device run (batches differ: the row multiple changed with the mesh).
    assert train_losses(w8)[15] == pytest.approx(train_losses(base)[15], rel=0.1)

    w1 = copy(base, tmp_path, "w1")
    err = run_on_devices(4, {**over, "num_train_steps": 30}, w1)
    assert "resumed from step 20" in err
    assert sorted(train_losses(w1)) == [5, 10, 15, 20, 25, 30]
    assert checkpoints.Checkpoints(str(w1)).all_steps()[-1] == 30


@pytest.mark.slow
def test_sigkill_trials(tmp_path):
    """Two SIGKILL trials of tests/fault_trials.py (the full 10: run the script)."""
    proc = subprocess.run(
        [sys.executable, "tests/fault_trials.py", "--trials=2", f"--dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2/2 trials OK" in proc.stdout

"""End-to-end training runs on a small TSV corpus: outputs, resume after SIGKILL,
SIGTERM checkpointing, restore_model with averaging, and clean CLI errors."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from attention_jax.runtime.errors import UserError
from attention_jax.training import checkpoints
from attention_jax.training import config as config_lib
from attention_jax.training.workdir import restore_model
from tests.conftest import small_train_config, train_rows, write_reversal_tsv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs train_and_evaluate in a child process; the train step sends `SIG` to the
# process itself once the state reaches step `AT` (a deterministic "preemption").
# Checkpoints are saved asynchronously, so before a SIGKILL the child waits until
# the last checkpoint due before `AT` is complete on disk: the test is about a
# kill *between* checkpoints, not about how fast a save finishes.
CHILD = textwrap.dedent(
    """
    import dataclasses, json, os, signal, sys, time
    import jax
    from tests.conftest import small_train_config
    from attention_jax.training import loop, steps

    overrides, workdir, sig = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    at = int(sys.argv[4])
    make = steps.make_buffered_steps  # the steps the loop calls

    def make_killing(setup, treedef, packing):
        packed = make(setup, treedef, packing)
        train_step = packed.step

        def step(buffers, batch):
            buffers, metrics = train_step(buffers, batch)
            if int(jax.tree.unflatten(treedef, packing.unpack(buffers)).step) == at:
                if sig == "SIGKILL":
                    every = small_train_config(**overrides).checkpoint_every_steps
                    done = os.path.join(workdir, "checkpoints", str(at // every * every))
                    deadline = time.time() + 120
                    while not os.path.isdir(done) and time.time() < deadline:
                        time.sleep(0.05)
                os.kill(os.getpid(), getattr(signal, sig))
            return buffers, metrics

        return dataclasses.replace(packed, step=step)

    if at > 0:
        steps.make_buffered_steps = make_killing
    summary = loop.train_and_evaluate(small_train_config(**overrides), workdir)
    print("SUMMARY " + json.dumps({"step": summary["step"], "preempted": summary["preempted"]}))
    """
)


@pytest.fixture(scope="module")
def corpus_tsv(tmp_path_factory):
    """Reversal pairs: 'a b c' -> 'c b a' over 300 pseudo-words (enough pieces for V=300)."""
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    return write_reversal_tsv(path, num_pairs=1500, max_words=5, seed=0)


def _child(overrides, workdir, sig="SIGKILL", at=0):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(overrides), str(workdir), sig, str(at)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def uninterrupted(corpus_tsv, tmp_path_factory):
    """A 30-step run (checkpoints at 10, 20, 30) trained in this process."""
    from attention_jax.training import train_and_evaluate

    workdir = str(tmp_path_factory.mktemp("full"))
    summary = train_and_evaluate(small_train_config(dataset=f"tsv:{corpus_tsv}"), workdir)
    return workdir, summary


def test_run_writes_the_workdir_files(uninterrupted):
    workdir, summary = uninterrupted
    files = os.listdir(workdir)
    for name in ("checkpoints", "tokenizer.model", "config.json", "metrics.jsonl"):
        assert name in files
    assert any(f.startswith("events.out.tfevents") for f in files)
    assert checkpoints.Checkpoints(workdir).all_steps() == [10, 20, 30]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    train_rows = [r for r in rows if "train_loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
    for key in (
        "train_accuracy",
        "train_perplexity",
        "grad_norm",
        "learning_rate",
        "tokens_per_sec",
    ):
        assert key in train_rows[0]
    # It learns: 5.82 -> 4.29 here; batch noise alone passes a plain `<`.
    assert train_rows[-1]["train_loss"] < 0.9 * train_rows[0]["train_loss"]
    final = rows[-1]
    assert final["step"] == 30 and {"eval_loss", "eval_bleu", "eval_chrf"} <= set(final)
    assert summary["step"] == 30 and not summary["preempted"]
    assert summary["tokens_seen"] > 0 and summary["best_eval_bleu"] is not None


def test_resume_after_sigkill_continues_the_same_trajectory(uninterrupted, corpus_tsv, tmp_path):
    full, _ = uninterrupted
    overrides = {"dataset": f"tsv:{corpus_tsv}"}
    killed = _child(overrides, tmp_path, "SIGKILL", at=17)  # between checkpoints 10 and 20
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert checkpoints.Checkpoints(str(tmp_path)).all_steps() == [10]
    resumed = _child(overrides, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 10" in resumed.stderr
    want, got = train_rows(full), train_rows(str(tmp_path))
    assert sorted(got) == sorted(want) == [5, 10, 15, 20, 25, 30]
    for step in (15, 20, 25, 30):  # after the resume point
        assert got[step]["train_loss"] == pytest.approx(want[step]["train_loss"], rel=1e-6)
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5)


@pytest.mark.slow  # ~20 s; the SIGKILL resume is tested in make test
def test_sigterm_saves_a_checkpoint_at_the_current_step(corpus_tsv, tmp_path):
    proc = _child({"dataset": f"tsv:{corpus_tsv}"}, tmp_path, "SIGTERM", at=13)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGTERM: saved a checkpoint at step 13" in proc.stderr
    assert '"preempted": true' in proc.stdout
    assert checkpoints.Checkpoints(str(tmp_path)).all_steps() == [10, 13]


def test_restore_model_loads_and_averages_checkpoints(uninterrupted):
    workdir, _ = uninterrupted
    model, config, step = restore_model(workdir)
    assert step == 30 and config.model.d_model == 32
    src = np.array([[5, 6, 7, 1]], np.int32)
    tgt_in = np.array([[2, 7, 6, 5]], np.int32)
    assert model(src, tgt_in).shape == (1, 4, config.vocab_size)

    def embedding(m):
        return np.asarray(m.src_embed.embedding[...])

    averaged, _, step = restore_model(workdir, step=30, average_last=2)
    at20, _, _ = restore_model(workdir, step=20)
    np.testing.assert_allclose(
        embedding(averaged), (embedding(model) + embedding(at20)) / 2, rtol=1e-6, atol=1e-7
    )
    with pytest.raises(UserError, match="step 7"):
        restore_model(workdir, step=7)
    with pytest.raises(UserError, match="does not exist"):
        restore_model(os.path.join(workdir, "nope"))

    # Models restored in one process share the traced construction, not their variables:
    # a dropout stream drawn from in one leaves the other's where it was.
    def counts(m):
        return [int(c) for c in jax.tree.leaves(nnx.state(m, nnx.RngCount))]

    fresh = counts(model)
    assert fresh and fresh == counts(at20) == [0] * len(fresh)
    at20.decoder_layers[0].ffn_res.dropout.rngs()  # one draw
    assert counts(model) == fresh and counts(at20) != fresh


@pytest.mark.slow  # ~37 s of training
def test_time_based_checkpoints_and_the_final_average(corpus_tsv, tmp_path):
    """checkpoint_every_minutes saves on log steps; average_last scores the mean params."""
    from attention_jax.data import Tokenizer, load_split
    from attention_jax.training import evaluate, steps, train_and_evaluate
    from attention_jax.training.mesh import make_mesh

    config = small_train_config(
        dataset=f"tsv:{corpus_tsv}",
        num_train_steps=10,
        checkpoint_every_steps=0,
        checkpoint_every_minutes=1e-6,  # due at every log step (every 5)
        average_last=2,
        max_checkpoints_to_keep=1,  # raised to average_last
    )
    workdir = str(tmp_path)
    summary = train_and_evaluate(config, workdir)
    assert checkpoints.Checkpoints(workdir).all_steps() == [5, 10]
    avg = summary["average"]
    assert avg["eval_checkpoints_averaged"] == 2
    assert avg["eval_loss"] != summary["eval_loss"]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert rows[-1]["avg_eval_loss"] == pytest.approx(avg["eval_loss"])
    # The same number from the averaged parameters of restore_model.
    model, cfg, _ = restore_model(workdir, average_last=2)
    setup = steps.train_setup(cfg, make_mesh(cfg))
    eval_step = steps.make_eval_step(setup)
    from flax import nnx

    _, params, rngs = nnx.split(model, nnx.Param, ...)
    tok = Tokenizer.load(os.path.join(workdir, "tokenizer.model"))
    dev = load_split(cfg, "dev")
    loss = evaluate.eval_loss(eval_step, params, rngs, cfg, tok, dev, setup.mesh)
    assert loss["loss"] == pytest.approx(avg["eval_loss"], rel=1e-5)


def test_restore_model_without_checkpoints(tmp_path):
    config_lib.save_config(small_train_config(), str(tmp_path))
    with pytest.raises(UserError, match="no complete checkpoint"):
        restore_model(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"config\.json is missing"):
        restore_model(str(empty))


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--config.num_train_steps=0", "num_train_steps must be > 0"),
        ("--config.dataset=nope:x", "nope"),
        # 7 does not divide tiny's d_model (192), so the model config is invalid.
        ("--config.model.num_heads=7", "divisible by num_heads"),
        ("--config.no_such_field=1", "no_such_field"),
        ("--config.eval_beam_size=3", "eval_beam_size (renamed: --config.search.beam_size)"),
        ("--config.search.alpha=-1", "bad config.search: alpha must be >= 0"),
    ],
)
def test_cli_user_errors_are_one_clear_line(tmp_path, flag, message):
    proc = subprocess.run(
        [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={tmp_path}", flag],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr


def test_params_are_float32_and_born_sharded():
    from attention_jax.training import steps
    from attention_jax.training.mesh import make_mesh

    cfg = small_train_config()
    cfg.model.dtype = "bfloat16"
    state = steps.init_train_state(steps.train_setup(cfg, make_mesh(cfg)))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}

"""Fine-tuning an OPUS-MT / Marian model with train.py (configs/marian.py, config.init_from):
the run starts from the imported weights and tokenizer, learns, resumes, and its workdir
translates with decode.py. The step-0 loss is checked against CTranslate2's scores of
the same directory (its own OpusMTConverter), not against our import."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.decode_runs import run_decode
from tests.digits import digit_pairs
from tests.marian_files import opus_mt_directory

ctranslate2 = pytest.importorskip("ctranslate2")

STEPS = 30


def train(workdir, *flags, steps=STEPS):
    """train.py with configs/marian.py in a child: a digit task's fine-tune, no dropout or
    label smoothing (so that the dev loss is the plain NLL), evaluated at its end."""
    args = [
        "--config=configs/marian.py", f"--workdir={workdir}", "--config.batch_tokens=512",
        "--config.label_smoothing=0", "--config.model.dropout_rate=0",
        "--config.learning_rate=3e-3", "--config.warmup_steps=5",
        f"--config.num_train_steps={steps}", f"--config.eval_every_steps={STEPS}",
        f"--config.checkpoint_every_steps={STEPS}", "--config.log_every_steps=10", *flags,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def ct2_dev_nll(directory, out, pairs) -> float:
    """CTranslate2's mean negative log-likelihood of the targets (and </s>) given the
    sources, cut into pieces by the directory's source.spm and target.spm."""
    import sentencepiece as spm

    ctranslate2.converters.OpusMTConverter(directory).convert(str(out))
    translator = ctranslate2.Translator(str(out), device="cpu")
    cut = [
        spm.SentencePieceProcessor(model_file=f"{directory}/{n}.spm") for n in ("source", "target")
    ]
    scored = translator.score_batch(
        [cut[0].encode(s, out_type=str) for s, _ in pairs],
        [cut[1].encode(t, out_type=str) for _, t in pairs],
    )
    log_probs = np.concatenate([np.asarray(r.log_probs, np.float64) for r in scored])
    return float(-log_probs.mean())


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def fine_tune(tmp_path):
    """A fine-tune of an OPUS-MT directory on the digit task: (directory, workdir, the
    train.py flags of its data, the dev pairs); asserted to have run."""
    directory, _, _ = opus_mt_directory(tmp_path)
    train_tsv, dev_tsv = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    dev = digit_pairs(np.random.default_rng(6), 40)
    train_tsv.write_text(
        "".join(f"{s}\t{t}\n" for s, t in digit_pairs(np.random.default_rng(5), 400))
    )
    dev_tsv.write_text("".join(f"{s}\t{t}\n" for s, t in dev))
    data = [f"--config.init_from={directory}", f"--config.dataset=tsv:{train_tsv}"]
    data += [f"--config.eval_dataset=tsv:{dev_tsv}"]
    wd = tmp_path / "wd"
    run = train(wd, *data)
    assert run.returncode == 0, run.stderr[-3000:]
    return directory, wd, data, dev


@pytest.mark.slow  # ~38 s: train.py in a child; in make test, the import (test_marian) and
# the refusals below; the checkpoint's init is test_train_loop's
def test_a_fine_tune_starts_from_the_imported_model_learns_and_translates(tmp_path):
    directory, wd, _, dev = fine_tune(tmp_path)
    # The step-0 evaluation is the imported model's: CTranslate2 scores the dev set alike.
    rows = [r for r in metrics(wd) if "eval_loss" in r]
    assert [r["step"] for r in rows] == [0, STEPS]
    want = ct2_dev_nll(directory, tmp_path / "ct2", dev)
    assert abs(rows[0]["eval_loss"] - want) <= 1e-5 * want, (rows[0]["eval_loss"], want)
    assert rows[1]["eval_loss"] < 0.8 * rows[0]["eval_loss"]  # and it learns
    # Marian's tokenizer, not a fitted one; the model's shape is the import's.
    names = set(os.listdir(wd))
    assert {"source.spm", "target.spm", "marian_vocab.json"} <= names
    assert "tokenizer.model" not in names
    with open(wd / "config.json") as f:
        config = json.load(f)
    assert config["model"]["zero_start"] and config["model"]["positions"] == "sinusoid_halves"
    (tmp_path / "dev.de").write_text("".join(f"{s}\n" for s, _ in dev))
    out = run_decode(f"--workdir={wd}", f"--input={tmp_path / 'dev.de'}", "--beam_size=1")
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert len(out.stdout.decode().splitlines()) == len(dev)
    assert f"from step {STEPS}" in out.stderr.decode()


@pytest.mark.slow  # ~20 s: a second train.py run; resuming is test_train_loop's in make test
def test_a_resumed_fine_tune_needs_no_imported_model(tmp_path):
    directory, wd, data, _ = fine_tune(tmp_path)
    # Resumed, the run restores its checkpoint: the import's directory is no longer needed.
    os.rename(directory, f"{directory}.moved")
    run = train(wd, *data, steps=STEPS + 10)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from step 30" in run.stderr and "parameters from" not in run.stderr
    assert [r["step"] for r in metrics(wd) if "eval_loss" in r] == [0, STEPS, STEPS + 10]


def test_a_fine_tune_without_a_model_is_one_clear_line(tmp_path):
    run = train(tmp_path / "a")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "pass --config.init_from=DIR" in run.stderr


def test_a_missing_model_or_a_workdir_with_another_tokenizer_is_refused(tmp_path):
    from attention_jax.configs import marian as marian_config
    from attention_jax.runtime.errors import UserError
    from attention_jax.training import init_from

    config = marian_config.get_config()
    config.init_from = str(tmp_path / "nowhere")
    with pytest.raises(UserError, match="nowhere: not a directory"):
        init_from.adopt_model(config, str(tmp_path / "wd"))
    config.init_from, _, _ = opus_mt_directory(tmp_path)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tokenizer.model").write_bytes(
        (tmp_path / "opus" / "source.spm").read_bytes()
    )
    with pytest.raises(UserError, match=r"holds another tokenizer.*fresh workdir"):
        init_from.write_tokenizer(config, str(tmp_path / "c"))
    assert os.listdir(tmp_path / "c") == ["tokenizer.model"]  # nothing written beside it

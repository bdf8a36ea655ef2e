"""The digit task (German digit words -> English, word for word) and its trained workdir.

`build_digit_workdir` trains a SentencePiece tokenizer and a small Transformer for a
few hundred Adam steps on the task, then saves them as train.py would (config.json,
checkpoints/, tokenizer.model): once per test session, for tests/conftest.py's
`workdir` fixture. `digit_pairs` and `hostile_input` make the lines those tests
translate.
"""

import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attention_jax import EOS_ID, shift_right
from attention_jax.configs import tiny
from attention_jax.data import Tokenizer
from attention_jax.data.tokenizer import train_tokenizer
from attention_jax.training import checkpoints, steps
from attention_jax.training import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Enough Adam steps that the exact-translation test does not hinge on float rounding
# (at 350 steps jax 0.8 and 0.10 trained models that differed on one repeated word).
TRAIN_STEPS = 600
DE = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun"]
EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digit_pairs(rng, n, max_words=6):
    """n (German, English) sentences of 1..max_words digit words."""
    out = []
    for _ in range(n):
        d = rng.integers(0, 10, size=rng.integers(1, max_words + 1))
        out.append((" ".join(DE[i] for i in d), " ".join(EN[i] for i in d)))
    return out


def pad(rows, width):
    a = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        a[i, : len(r)] = r
    return a


def train_digits(model, tok, num_steps=TRAIN_STEPS, batch=64, width=24, seed=0):
    """A plain Adam loop on random digit sentences (teacher forcing, no label smoothing)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 30, num_steps, 3e-4))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, src, tgt):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p, rest)(src, shift_right(tgt))
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt)
            w = tgt != 0
            return jnp.sum(ce * w) / jnp.sum(w)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(num_steps):
        pairs = digit_pairs(rng, batch)
        src = pad([[*tok.encode(s), EOS_ID] for s, _ in pairs], width)
        tgt = pad([[*tok.encode(t), EOS_ID] for _, t in pairs], width)
        params, opt_state, loss = step(params, opt_state, src, tgt)
    nnx.update(model, params)
    return float(loss)


def build_once(shared: str, build: Callable[[str], None]) -> None:
    """build(directory) made into `shared` once, by whichever process comes first (a lock:
    the others wait for it); `shared` is complete, or not there."""
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(shared):
            building = f"{shared}.building"
            shutil.rmtree(building, ignore_errors=True)
            build(building)
            os.rename(building, shared)


def build_digit_workdir(shared: str) -> None:
    """The trained digit workdir in `shared` (`build_once`), trained in a child with JAX
    state of its own. Its 600 steps run compiled with LLVM's optimizations (8 s instead
    of 18 without, as the tests compile: few programs, run many times); the parity checks
    against CTranslate2 allow near-ties (tests/parity.py), so its rounding does not
    matter."""

    def trained(building: str) -> None:
        os.makedirs(building)
        # tests.conftest: the tests' compilation cache, as in the test processes.
        train = "from tests.digits import train_digit_workdir as t"
        code = f"import tests.conftest; {train}; t({building!r})"
        level = "--xla_backend_optimization_level"
        flags = re.sub(rf"{level}=\d+", "", os.environ.get("XLA_FLAGS", ""))
        env = {**os.environ, "XLA_FLAGS": f"{flags} {level}=2".strip()}
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)

    build_once(shared, trained)


def train_digit_workdir(wd: str) -> None:
    """Train a tokenizer and a model on the digit task into wd, as train.py lays it out."""
    texts = [s for pair in digit_pairs(np.random.default_rng(1), 400) for s in pair]
    proto = train_tokenizer(texts, 320)  # room for every word as one piece
    with open(os.path.join(wd, "tokenizer.model"), "wb") as f:
        f.write(proto)
    tok = Tokenizer.load(os.path.join(wd, "tokenizer.model"))

    config = tiny.get_config()
    tsv = os.path.join(wd, "digits.tsv")
    with open(tsv, "w") as f:
        f.writelines(f"{s}\t{t}\n" for s, t in digit_pairs(np.random.default_rng(2), 200))
    config.dataset = f"tsv:{tsv}"
    config.vocab_size = tok.vocab_size
    config.max_length = 24
    config.model.update(
        d_model=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1, d_ff=128
    )
    config.model.update(dropout_rate=0.0, max_len=64)
    config_lib.save_config(config, wd)
    model = config_lib.build_model(config, config_lib.model_config(config))
    loss = train_digits(model, tok)
    assert loss < 0.05, f"the digit task did not train (loss {loss})"

    _, params, rngs = nnx.split(model, nnx.Param, ...)
    state = steps.TrainState(
        jnp.asarray(TRAIN_STEPS, jnp.int32), params, optax.sgd(1.0).init(params), rngs
    )
    manager = checkpoints.Checkpoints(wd)
    manager.save(state, {})
    manager.wait()
    manager.close()


def hostile_input(seed=5, n=30):
    """(input bytes, expected English or None per line): n >= 20 lines of digits, with empty,
    long, bad-UTF-8 and CRLF lines in between, and no newline at the end."""
    pairs = digit_pairs(np.random.default_rng(seed), n)
    lines, expected = [s.encode() for s, _ in pairs], [t for _, t in pairs]
    bad = {
        2: (b"", ""),
        3: (b"  ", ""),
        7: (b"eins \xff zwei", None),
        8: (b"drei\r", "three"),
        13: (b" ".join([b"sieben"] * 100), None),
        21: (b"", ""),
    }
    for i, (line, want) in sorted(bad.items()):
        lines.insert(i, line)
        expected.insert(i, want)
    return b"\n".join(lines), expected

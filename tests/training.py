"""Train-step helpers shared by the training tests (test_train_steps, test_loss_precision,
test_faults, test_train_mesh's child): reversal batches, a config's mesh, train step and
state, and label-smoothed cross-entropy in NumPy."""

import numpy as np

from attention_jax.training import steps
from attention_jax.training.mesh import make_mesh


def numpy_smoothed_ce(logits, targets, eps):
    """(loss, perplexity) of label-smoothed cross-entropy in NumPy float64: the target gets
    1 - eps, every other token eps / (V - 1); padding (target 0) weighs nothing."""
    logits = logits.astype(np.float64)
    v = logits.shape[-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    q = np.full(logits.shape, eps / (v - 1))
    np.put_along_axis(q, targets[..., None], 1.0 - eps, axis=-1)
    ce = -(q * logp).sum(-1)
    w = targets != 0
    return (ce * w).sum() / w.sum(), np.exp(
        (-np.take_along_axis(logp, targets[..., None], -1)[..., 0] * w).sum() / w.sum()
    )


def setup_train_step(cfg):
    """(mesh, compiled train step, initial train state) of `cfg` on all devices."""
    mesh = make_mesh(cfg)
    setup = steps.train_setup(cfg, mesh)
    return mesh, steps.make_train_step(setup), steps.init_train_state(setup)


def reverse_batch(rng, rows, length, vocab):
    """Source: random ids in [4, vocab) then EOS; target: the same ids reversed, then EOS."""
    lens = rng.integers(length // 2, length, size=rows)
    src = np.zeros((rows, length), np.int32)
    tgt_out = np.zeros((rows, length), np.int32)
    for i, n in enumerate(lens):
        ids = rng.integers(4, vocab, size=n - 1)
        src[i, :n] = [*ids, 1]
        tgt_out[i, :n] = [*ids[::-1], 1]
    tgt_in = np.concatenate([np.full((rows, 1), 2), tgt_out[:, :-1]], axis=1).astype(np.int32)
    tgt_in[tgt_out == 0] = 0
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}

"""Tiny: trains in about 10 minutes on 2 CPU cores on the embedded 'ding' corpus.

    make train            # = python train.py --config=configs/tiny.py --workdir=workdir/tiny

Measured from a fresh clone on the 2-core CPU box (jax 0.10.2), `make train`:
9 min 54 s in all -- venv setup ~50 s, tokenizer 16 s, 700 packed steps of 2048
tokens (1.25M target tokens, ~2,700 tokens/s) in 7.7 min, evals 1 min. Dev set
(1000 pairs, beam 4): BLEU 0.91, chrF 12.0, token accuracy 32%; test set
(decode.py --split=test): BLEU 0.82, chrF 12.0. A smoke test of the whole
pipeline, not a usable translator: ten CPU minutes are ~1.5 epochs of Ding.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.vocab_size = 4000  # small softmax: the output layer dominates a CPU step
    c.max_length = 64
    c.batch_tokens = 2048
    # Packed rows carry ~9% padding instead of ~28% with length buckets, so each
    # CPU-second trains on ~1.3x more real tokens (bench/train.py).
    c.packing = True
    c.tokenizer_sample_size = 100_000
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_encoder_layers = 2
    c.model.num_decoder_layers = 2
    c.model.d_ff = 1024
    c.model.dropout_rate = 0.1
    c.model.max_len = 256
    c.schedule = "linear_rsqrt"
    c.learning_rate = 2e-3
    c.warmup_steps = 150
    c.grad_clip_norm = 1.0
    c.num_train_steps = 700
    c.log_every_steps = 25
    c.eval_every_steps = 350
    c.checkpoint_every_steps = 250
    c.eval_max_examples = 100  # periodic evals decode 100 dev pairs; the final one all
    return c

"""Tiny: trains in about 10 minutes on 2 CPU cores on the embedded 'ding' corpus.

    make train            # = python train.py --config=configs/tiny.py --workdir=workdir/tiny

Measured (2 shared CPU cores, jax 0.10.2 CPU): 9 min 27 s wall in all -- tokenizer
13 s, 700 steps of ~1300 target tokens (0.86M tokens, ~1800 tokens/s) in 8.1 min,
final beam-4 decode of the 1000-pair dev set 41 s. Dev (full, 1000 pairs): BLEU
0.25, chrF 7.8, loss 4.79, token accuracy 27%. This is a smoke test of the whole
pipeline, not a usable translator: the model has seen under one epoch of Ding.
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

"""Tiny: trains in minutes on 2 CPU cores on the embedded 'ding' corpus.

    make train            # = python train.py --config=configs/tiny.py --workdir=workdir/tiny

Runtime and BLEU are filled in from measurements (see README).
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.vocab_size = 8000
    c.max_length = 64
    c.batch_tokens = 4096
    c.tokenizer_sample_size = 200_000
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_encoder_layers = 3
    c.model.num_decoder_layers = 3
    c.model.d_ff = 1024
    c.model.dropout_rate = 0.1
    c.model.max_len = 256
    c.schedule = "linear_rsqrt"
    c.learning_rate = 2e-3
    c.warmup_steps = 400
    c.grad_clip_norm = 1.0
    c.num_train_steps = 3000
    c.log_every_steps = 50
    c.eval_every_steps = 1000
    c.checkpoint_every_steps = 500
    c.eval_max_examples = 0
    return c

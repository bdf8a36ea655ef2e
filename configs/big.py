"""Transformer-big (paper Table 3): d_model 1024, 16 heads, 6+6 layers, d_ff 4096, dropout 0.3.

    python train.py --config=configs/big.py --workdir=workdir/big \
        --config.dataset=tfds:wmt14_translate/de-en

The paper trains 300k steps on 8 P100s (3.5 days) to 28.4 BLEU on
newstest2014 En->De. Our measured runtime and BLEU go in the README.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.vocab_size = 37000
    c.num_train_steps = 300_000
    c.model.d_model = 1024
    c.model.num_heads = 16
    c.model.d_ff = 4096
    c.model.dropout_rate = 0.3
    c.model.dtype = "bfloat16"
    return c

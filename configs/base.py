"""Transformer-base (paper Table 3): d_model 512, 8 heads, 6+6 layers, d_ff 2048, dropout 0.1.

    python train.py --config=configs/base.py --workdir=workdir/base \
        --config.dataset=tfds:wmt14_translate/de-en

The paper trains 100k steps of ~25k+25k tokens on 8 P100s (12 h) to 27.3 BLEU
on newstest2014 En->De. Our measured runtime and BLEU go in the README.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.vocab_size = 37000
    c.num_train_steps = 100_000
    c.model.dtype = "bfloat16"
    return c

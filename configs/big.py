"""Transformer-big (paper Table 3): d_model 1024, 16 heads, 6+6 layers, d_ff 4096, dropout 0.3.

German->English (the default direction):

    python train.py --config=configs/big.py --workdir=workdir/big \
        --config.dataset=tfds:wmt14_translate/de-en

English->German on WMT14, the direction the paper reports:

    python train.py --config=configs/big.py --workdir=workdir/big-en-de \
        --config.dataset=tfds:wmt14_translate/de-en \
        --config.source_lang=en --config.target_lang=de
    python decode.py --workdir=workdir/big-en-de --split=test --average_last=20

The paper trains 300k steps on 8 P100s (3.5 days) and reports 28.4 BLEU on
newstest2014 **En->De** (41.8 En->Fr; dropout 0.1 there): tokenized BLEU of the
average of the last 20 checkpoints, beam 4, alpha 0.6. We report sacreBLEU on
detokenized output (signature printed), which is not the paper's tokenized,
compound-split BLEU and typically comes out lower on the same output (Post,
2018); and German->English numbers are not comparable to English->German
ones. Our measured runtimes and BLEU are in the README.
"""

import ml_collections

from attention_jax.configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.vocab_size = 37000
    c.num_train_steps = 300_000
    c.model.d_model = 1024
    c.model.num_heads = 16
    c.model.d_ff = 4096
    c.model.dropout_rate = 0.3
    c.model.dtype = "bfloat16"
    # The loss in 2048-token chunks: the [25k tokens, 37k vocab] float32 logits are never
    # held whole, which saves a large part of big's step's temporaries (docs/aot.md).
    c.loss_chunk_tokens = 2048
    # Paper 6.1: the last 20 checkpoints averaged (10-minute intervals, as for base).
    c.checkpoint_every_minutes = 10.0
    c.average_last = 20
    return c

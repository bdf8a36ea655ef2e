"""A Transformer sized and regularized for Ding (1.2M target tokens), German->English.

    python train.py --config=configs/ding.py --workdir=workdir/ding
    python decode.py --workdir=workdir/ding --split=test

Ding's ~85k training pairs (17k example sentences, 68k multi-word phrases) are
about a tenth of IWSLT14 de-en, so this takes the IWSLT14 recipe of the
low-resource literature (fairseq's transformer_iwslt_de_en; Sennrich and Zhang,
2019): d_model 512, 4 heads, d_ff 1024, dropout 0.3, a small shared vocabulary
(8k pieces instead of 37k, so that rare pieces are seen often enough), AdamW
with weight decay, label smoothing 0.1. Paper-base on the same data overfits
early (configs/base.py).

Runs on one GPU in packed 8192-token batches (one compiled step); on a CPU it
is slow (use configs/tiny.py there). The README's results table has its
measured curve and test BLEU.
"""

import ml_collections

from attention_jax.configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.dataset = "ding"
    c.vocab_size = 8000
    c.batch_tokens = 8192
    c.packing = True
    c.max_length = 128  # Ding's longest sentences are far shorter; packed rows of 128

    c.model.d_model = 512
    c.model.num_heads = 4
    c.model.num_encoder_layers = 6
    c.model.num_decoder_layers = 6
    c.model.d_ff = 1024
    c.model.dropout_rate = 0.3
    c.model.dtype = "bfloat16"

    c.optimizer = "adamw"
    c.weight_decay = 1e-4
    c.schedule = "linear_rsqrt"
    c.learning_rate = 7e-4
    c.warmup_steps = 1500
    c.label_smoothing = 0.1

    c.num_train_steps = 6000
    c.log_every_steps = 100
    c.eval_every_steps = 1000
    c.eval_max_examples = 500
    c.checkpoint_every_steps = 1000
    c.max_checkpoints_to_keep = 3
    return c

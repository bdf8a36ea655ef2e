"""Fine-tune a trained OPUS-MT / Marian model on your own data.

    python train.py --config=configs/marian.py --config.init_from=opus-mt-de-en \
        --config.dataset=tsv:my-domain.tsv --workdir=workdir/opus-de-en-domain
    python decode.py --workdir=workdir/opus-de-en-domain --input=in.de --output=out.en

`init_from` (required) is a model directory as decode.py --marian reads it: an
OPUS-MT release or Hugging Face's MarianMT layout. Its shape, weights and
tokenizer (source.spm, target.spm, the joint vocabulary) are the run's; no
SentencePiece model is fitted. Step 0 evaluates the imported model on the dev
set, so metrics.jsonl starts with the baseline the fine-tune has to beat.

The recipe is a fine-tune's, not the paper's from-scratch one: a peak learning
rate of 5e-5 reached in 500 steps, then decaying as 1/sqrt(step), with
OPUS-MT's dropout and label smoothing (0.1). Set `model.dtype=bfloat16` on a
GPU or TPU.
"""

import ml_collections
from ml_collections import config_dict

from attention_jax.configs import default


def get_config() -> ml_collections.ConfigDict:
    c = default.get_config()
    c.init_from = config_dict.placeholder(str)  # required: --config.init_from=DIR
    c.eval_at_start = True
    c.batch_tokens = 8192

    c.model.dropout_rate = 0.1
    c.schedule = "linear_rsqrt"
    c.learning_rate = 5e-5
    c.warmup_steps = 500
    c.label_smoothing = 0.1

    c.num_train_steps = 10_000
    c.log_every_steps = 100
    c.eval_every_steps = 1000
    c.checkpoint_every_steps = 1000
    c.eval_max_examples = 500
    return c

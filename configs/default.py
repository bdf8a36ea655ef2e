"""Defaults shared by every config: the paper's training recipe.

Each field has a comment (the model's, in model/config.py); `tiny.py`, `base.py` and
`big.py` override a few.
Every field can be overridden on the command line, e.g.
`python train.py --config=configs/base.py --config.batch_tokens=8192`.
"""

import dataclasses

import ml_collections

from attention_jax.config import TransformerConfig
from attention_jax.search.settings import config_block

# Fields renamed, old -> new: a workdir's config.json written before keeps loading
# (training/config.py), and a config file or --config flag that still sets the old name
# is told the new one.
RENAMED = {
    "eval_beam_size": "search.beam_size",
    "eval_alpha": "search.alpha",
    "pack_state": "state_buffers",
}


def model_fields() -> dict:
    """TransformerConfig's fields and defaults, vocab_size aside (the data's field)."""
    fields = dataclasses.fields(TransformerConfig)
    return {f.name: f.default for f in fields if f.name != "vocab_size"}


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    # --- Data -------------------------------------------------------------
    # 'ding' (embedded German->English dictionary corpus), 'tfds:NAME'
    # (e.g. 'tfds:wmt14_translate/de-en') or 'tsv:PATH' (source<TAB>target).
    c.dataset = "ding"
    # Same kinds as `dataset`; '' means the dev split of `dataset`.
    c.eval_dataset = ""
    # Translation direction (TFDS datasets have both languages per example).
    c.source_lang = "de"
    c.target_lang = "en"
    # Where TFDS looks for prepared datasets ('' = TFDS default).
    c.tfds_data_dir = ""
    # The Ding dictionary file for 'ding' ('' = $ATTENTION_JAX_DING, else
    # /usr/share/trans/de-en from the Debian/Ubuntu package trans-de-en).
    c.ding_path = ""
    # Shared source+target SentencePiece vocabulary size (paper: ~37000 BPE).
    c.vocab_size = 37000
    # 'unigram' or 'bpe'.
    c.tokenizer_type = "unigram"
    # Sentences (both sides together) sampled to train the tokenizer. SentencePiece
    # holds the whole sample in memory (docs/data.md), so 250k keeps a first run
    # small; still several times the Flax WMT example's 10M-character sample.
    c.tokenizer_sample_size = 250_000
    # Maximum tokens per side, EOS included.
    c.max_length = 256
    # What to do with longer pairs: 'drop' or 'truncate'.
    c.long_pairs = "drop"
    # Token budget per global batch, per side (paper: ~25000 src + 25000 tgt).
    c.batch_tokens = 25_000
    # Padded lengths used for batching (one compiled train step each); () = at most
    # num_length_buckets widths, those that pad the training corpus least, fitted to
    # its length histogram at start (docs/data.md).
    c.length_buckets = ()
    c.num_length_buckets = 34  # little padding on WMT-like corpora at max_length 256 (data.md)
    # Pack several pairs into one row (segment ids + positions) instead of padding.
    c.packing = False
    # Shuffle buffer / seed offset for the data order.
    c.shuffle_seed = 0
    # Processes that tokenize the corpus when its cache is built (0 = one per CPU core).
    c.data_workers = 0
    # Where each shard of the training corpus is cached, tokenized ('' = WORKDIR/data_cache).
    # Keyed on the corpus, tokenizer, max_length, long_pairs and shard, so a directory
    # shared by several workdirs is safe; delete it to reclaim the space.
    c.data_cache_dir = ""
    # Unmap the cached corpus's pages from the process whenever its mapped files hold more
    # than this many GB of its RSS (0 = never). They are page cache, shared and dropped by
    # the kernel under memory pressure, but RSS counts them: random batches from a large
    # cache come to hold most of it. With a limit, RSS stays near it but the pipeline
    # reads fewer tokens/s: unmapped pages are mapped again when read (docs/data.md).
    c.mapped_cache_gb = 0.0

    # --- Model: model/config.py's TransformerConfig, each field with its default there
    # (and its meaning in a comment beside it); vocab_size is the field above.
    c.model = ml_collections.ConfigDict(model_fields())

    # Start from a trained OPUS-MT / Marian model (a directory in either layout that
    # decode.py --marian reads): its model shape, weights and tokenizer replace the
    # fields above and the tokenizer fitting (configs/marian.py, training/init_from.py).
    c.init_from = ""

    # --- Optimization (paper section 5.3) --------------------------------
    c.optimizer = "adam"  # 'adam' or 'adamw' (decoupled weight decay)
    c.adam_b1 = 0.9
    c.adam_b2 = 0.98
    c.adam_eps = 1e-9
    c.weight_decay = 0.0
    # 'rsqrt' (paper: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)),
    # 'linear_rsqrt' (peak `learning_rate`, then inverse sqrt) or 'cosine'.
    c.schedule = "rsqrt"
    c.learning_rate = 1.0  # multiplier for 'rsqrt', peak value otherwise
    c.warmup_steps = 4000
    c.grad_clip_norm = 0.0  # 0 = no clipping
    c.grad_accum_steps = 1  # micro-batches per update
    c.label_smoothing = 0.1
    # Compute the loss over the vocabulary in chunks of this many tokens (0 = all at
    # once): the [tokens, vocab] float32 logits, the largest buffers of a big batch,
    # are then never held whole (training/loss.py; same loss and gradients).
    c.loss_chunk_tokens = 0
    # With loss_chunk_tokens > 0: how a chunk's logits are stored between the passes over
    # them, 'float32' or 'bfloat16' (half the bytes; each logit rounded to bf16, the
    # statistics still summed in float32). Evaluation always uses float32.
    c.loss_logits_dtype = "float32"
    # Pass the train state to each step packed into one buffer per dtype instead of its
    # hundreds of arrays (training/state_buffers.py): the step's call returns in a fraction of
    # the host time, at the cost of one more state-sized temporary on the devices.
    c.state_buffers = True

    # --- Loop ---------------------------------------------------------------
    c.num_train_steps = 100_000
    c.log_every_steps = 100
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 5000
    # Also save when this many minutes passed since the last save (0 = off); the
    # paper's base model averages 5 checkpoints written at 10-minute intervals.
    c.checkpoint_every_minutes = 0.0
    c.max_checkpoints_to_keep = 5
    # Beside those, the checkpoint of the best dev evaluation is kept (decode.py
    # --checkpoint=best), by this metric: "chrf", "bleu" or "loss".
    c.best_metric = "chrf"
    # Stop once this many evaluations in a row did not beat the best (0 = never).
    c.early_stop_patience = 0
    # The final evaluation also scores the mean of the parameters of the last N
    # checkpoints (0 or 1 = off; paper 6.1: 5 for base, 20 for big). At least N
    # checkpoints are kept whatever max_checkpoints_to_keep says.
    c.average_last = 0
    c.eval_max_examples = 0  # dev pairs decoded for BLEU at periodic evals; 0 = the whole dev set
    # Dev pairs decoded for the final BLEU at the end of training; 0 = the whole dev set.
    c.final_eval_max_examples = 0
    # Evaluate the model before the first step too (a fine-tune's baseline, as step 0).
    c.eval_at_start = False
    c.num_examples_to_print = 5
    c.seed = 0
    # The evaluations' search: search/settings.py SearchSettings' fields of the training
    # config (beam_size, alpha, length_penalty, stop, min_length), with their defaults
    # (the paper's beam 4 and alpha 0.6) and help; decode.py's flags of the same names.
    c.search = ml_collections.ConfigDict(config_block())

    # --- Reliability ----------------------------------------------------------
    # A step with a NaN/Inf loss or gradient never changes params or optimizer
    # state; then 'skip' counts it (metrics: nonfinite_steps) and trains on,
    # 'stop' ends the run with an error (the last good checkpoint stays).
    c.nonfinite_policy = "skip"
    # 'skip' only: stop anyway after this many non-finite steps in a row (0 = never).
    c.max_consecutive_nonfinite = 100
    # Train from scratch even though checkpoints/ holds steps that cannot be
    # restored (damaged). Off: such a workdir is an error, never silently overwritten.
    c.allow_fresh_start = False
    # Resume although the optimizer state's structure changed (e.g. grad_clip_norm or
    # weight_decay turned on or off, adam <-> adamw): keep the parameters, step and data
    # position, and start a fresh optimizer state (the fairseq habit). Without a
    # structure change the optimizer state is restored as usual.
    c.reset_optimizer = False
    # Multi-host: a process whose peer sent no heartbeat for this long (killed, out of
    # memory, host lost) stops with a clear error instead of waiting in a collective
    # forever (0 = leave it to JAX's coordination service, which aborts after ~100 s).
    # Counted from a process's last beat, once it has started: a host slower to reach
    # the training loop (tokenizing, planning, compiling) is waited for.
    c.peer_timeout_seconds = 60.0
    # Input shards (each read by one process, or all by one process): 0 = one
    # per process. Fixing it (e.g. to the process count of a multi-host run)
    # gives the same batches on any number of processes, so a run can resume
    # exactly on fewer machines. Multi-process runs need 0 or the process count.
    c.data_shards = 0

    # --- Parallelism ----------------------------------------------------------
    # Mesh axis sizes; -1 means "all remaining devices".
    c.mesh_data = -1
    c.mesh_fsdp = 1
    c.mesh_tensor = 1
    # Logical parameter axis -> mesh axis (None = replicated).
    c.logical_axis_rules = (
        ("batch", ("data", "fsdp")),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv", None),
        ("mlp", "tensor"),
    )
    # Peak FLOP/s per device for MFU (0 = look it up from the device kind).
    c.peak_flops_per_device = 0.0
    return c

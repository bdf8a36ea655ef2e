"""Defaults shared by every config: the paper's training recipe.

Each field has a comment; `tiny.py`, `base.py` and `big.py` override a few.
Every field can be overridden on the command line, e.g.
`python train.py --config=configs/base.py --config.batch_tokens=8192`.
"""

import ml_collections


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
    # Shared source+target SentencePiece vocabulary size (paper: ~37000 BPE).
    c.vocab_size = 37000
    # 'unigram' or 'bpe'.
    c.tokenizer_type = "unigram"
    # Sentences (both sides together) sampled to train the tokenizer.
    c.tokenizer_sample_size = 2_000_000
    # Maximum tokens per side, EOS included.
    c.max_length = 256
    # What to do with longer pairs: 'drop' or 'truncate'.
    c.long_pairs = "drop"
    # Token budget per global batch, per side (paper: ~25000 src + 25000 tgt).
    c.batch_tokens = 25_000
    # Padded lengths used for batching; () = powers of two from 8 up to max_length.
    c.length_buckets = ()
    # Pack several pairs into one row (segment ids + positions) instead of padding.
    c.packing = False
    # Shuffle buffer / seed offset for the data order.
    c.shuffle_seed = 0
    # Threads used by the grain pipeline (0 = in the main thread).
    c.data_workers = 0

    # --- Model (maps onto model.TransformerConfig) -----------------------
    c.model = ml_collections.ConfigDict()
    c.model.d_model = 512
    c.model.num_heads = 8
    c.model.num_encoder_layers = 6
    c.model.num_decoder_layers = 6
    c.model.d_ff = 2048
    c.model.dropout_rate = 0.1  # P_drop: sub-layer outputs and embeddings + PE
    c.model.attention_dropout_rate = 0.0  # the paper uses none
    c.model.activation = "relu"  # 'relu' (paper) or 'gelu'
    c.model.norm = "post"  # 'post' (paper: LayerNorm(x + Sublayer(x))) or 'pre'
    c.model.share_embeddings = True  # one table for source and target tokens
    c.model.tie_output = True  # output projection = embedding^T (paper 3.4)
    c.model.max_len = 1024  # longest position the sinusoid table covers
    c.model.dtype = "float32"  # computation dtype ('bfloat16' on accelerators)
    c.model.param_dtype = "float32"
    c.model.attention_impl = "auto"  # cuDNN flash attention on GPU (bf16), else einsum
    c.model.remat = False  # rematerialize layers in the backward pass

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

    # --- Loop ---------------------------------------------------------------
    c.num_train_steps = 100_000
    c.log_every_steps = 100
    c.eval_every_steps = 5000
    c.checkpoint_every_steps = 5000
    c.max_checkpoints_to_keep = 5
    c.eval_max_examples = 0  # dev pairs decoded for BLEU at periodic evals; 0 = the whole dev set
    # Dev pairs decoded for the final BLEU at the end of training; 0 = the whole dev set.
    c.final_eval_max_examples = 0
    c.eval_beam_size = 4
    c.eval_alpha = 0.6
    c.num_examples_to_print = 5
    c.seed = 0

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

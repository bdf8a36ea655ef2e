"""Input pipeline: corpora, SentencePiece tokenizer and batching (no model code).

corpus = load_split(config, "train")                 # random access; TSV files read by offset
tokenizer = get_tokenizer(config, workdir, corpus)
batches = TrainIterator(config, tokenizer, corpus, batch_multiple=n_local_devices,
                        cache_dir=f"{workdir}/data_cache")   # tokenized once, then mapped

The one batch planner (data/plans.py) serves training, the dev loss, translation
and alignments; it is pure: shards that must agree on batch counts (the
processes of a job) are told what to agree on by their caller (training/input.py).

This face is data/'s one door: the other packages import the names below from
`attention_jax.data`, never one of its modules (tests/test_floors.py checks it), so
which module of data/ holds a name is data/'s own business.

Importing this package loads nothing: each name below is loaded on first use (PEP 562),
so the search's settings (which read data/plans.py) need neither SentencePiece nor
grain, and the cache's worker processes never start JAX.
"""

import importlib

# module -> the names of this face that it defines
_MODULES = {
    "corpora": ("ParallelCorpus", "TsvCorpus", "load_split"),
    "files": (
        "atomic_write",
        "atomic_write_bytes",
        "files_identity",
        "read_versioned_json",
    ),
    "pipeline": (
        "AgreeCounts",
        "TrainIterator",
        "eval_batches",
        "fit_widths",
        "length_histogram",
        "train_shard",
    ),
    "plans": (
        "MIN_ROWS",
        "inference_width",
        "inference_widths",
        "length_buckets",
        "plan_static",
        "plan_translation",
        "rows_per_batch",
    ),
    "tokenized": ("TokenizedCorpus",),
    "tokenizer": (
        "TOKENIZER_FILENAME",
        "MarianTokenizer",
        "Tokenizer",
        "get_tokenizer",
        "has_tokenizer",
        "load_tokenizer",
        "read_sentencepiece_models",
        "tokenizer_names",
        "train_tokenizer",
    ),
}
# name -> the module that defines it
_LAZY = {name: f"attention_jax.data.{m}" for m, names in _MODULES.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attention_jax.data' has no attribute {name!r}")

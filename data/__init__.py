"""Input pipeline: corpora, SentencePiece tokenizer and batching (no model code).

corpus = load_split(config, "train")                 # random access; TSV files read by offset
tokenizer = get_tokenizer(config, workdir, corpus)
batches = TrainIterator(config, tokenizer, corpus, batch_multiple=n_local_devices,
                        cache_dir=f"{workdir}/data_cache")   # tokenized once, then mapped

The one batch planner (data/plans.py) serves training, the dev loss, translation
and alignments; it is pure: shards that must agree on batch counts (the
processes of a job) are told what to agree on by their caller (training/input.py).

Importing this package loads nothing: each name below is loaded on first use (PEP 562),
so the search's settings (which read data/plans.py) need neither SentencePiece nor
grain, and the cache's worker processes never start JAX.
"""

import importlib

# name -> the module that defines it
_LAZY = {
    "ParallelCorpus": "attention_jax.data.corpora",
    "TsvCorpus": "attention_jax.data.corpora",
    "load_split": "attention_jax.data.corpora",
    "TrainIterator": "attention_jax.data.pipeline",
    "eval_batches": "attention_jax.data.pipeline",
    "Tokenizer": "attention_jax.data.tokenizer",
    "get_tokenizer": "attention_jax.data.tokenizer",
}

__all__ = [
    "ParallelCorpus",
    "Tokenizer",
    "TrainIterator",
    "TsvCorpus",
    "eval_batches",
    "get_tokenizer",
    "load_split",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attention_jax.data' has no attribute {name!r}")

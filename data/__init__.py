"""Input pipeline: corpora, SentencePiece tokenizer and batching (no model code).

corpus = load_split(config, "train")                 # random access; TSV files read by offset
tokenizer = get_tokenizer(config, workdir, corpus)
batches = TrainIterator(config, tokenizer, corpus, batch_multiple=n_local_devices,
                        cache_dir=f"{workdir}/data_cache")   # tokenized once, then mapped

The one batch planner (data/plans.py) serves training, the dev loss, translation
and alignments; it is pure: shards that must agree on batch counts (the
processes of a job) are told what to agree on by their caller (training/input.py).

Importing this package is light (numpy and SentencePiece, never JAX; grain loads
when a plan is made): the cache's worker processes import it.
"""

from attention_jax.data.corpora import ParallelCorpus, TsvCorpus, load_split
from attention_jax.data.pipeline import TrainIterator, eval_batches
from attention_jax.data.tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "ParallelCorpus",
    "Tokenizer",
    "TrainIterator",
    "TsvCorpus",
    "eval_batches",
    "get_tokenizer",
    "load_split",
]

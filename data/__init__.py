"""Input pipeline: corpora, SentencePiece tokenizer and batching (no model code).

corpus = load_split(config, "train")                 # random access; TSV files read by offset
tokenizer = get_tokenizer(config, workdir, corpus)
batches = train_iterator(config, tokenizer, corpus, batch_multiple=n_local_devices,
                         cache_dir=f"{workdir}/data_cache")   # tokenized once, then mapped

Importing this package is light (numpy and SentencePiece; JAX and grain load
when a plan is made): the cache's worker processes import it.
"""

from data.corpora import ParallelCorpus, TsvCorpus, load_split
from data.files import DataError
from data.pipeline import TrainIterator, eval_batches, train_iterator
from data.tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "DataError",
    "ParallelCorpus",
    "Tokenizer",
    "TrainIterator",
    "TsvCorpus",
    "eval_batches",
    "get_tokenizer",
    "load_split",
    "train_iterator",
]

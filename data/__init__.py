"""Input pipeline: corpora, SentencePiece tokenizer and grain batching.

corpus = load_split(config, "train")
tokenizer = get_tokenizer(config, workdir, corpus)
batches = train_iterator(config, tokenizer, corpus, batch_multiple=n_local_devices)
global_batch = to_global_batch(next(batches), mesh)
"""

from data.corpora import DataError, ParallelCorpus, load_split
from data.pipeline import TrainIterator, eval_batches, to_global_batch, train_iterator
from data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, get_tokenizer

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "DataError",
    "ParallelCorpus",
    "Tokenizer",
    "TrainIterator",
    "eval_batches",
    "get_tokenizer",
    "load_split",
    "to_global_batch",
    "train_iterator",
]

"""SentencePiece tokenizer shared by source and target (one vocabulary).

Trained once per workdir on a bounded, seeded sample of the training text of
both languages, saved as `WORKDIR/tokenizer.model`, and reused on resume and by
decode.py. Ids: 0 pad, 1 eos, 2 bos, 3 unk (the model library uses the same).
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm

from data.corpora import DataError, atomic_write_bytes

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
TOKENIZER_FILENAME = "tokenizer.model"
# byte_fallback reserves 256 byte pieces, so unknown characters (emoji, rare
# scripts) round-trip exactly instead of becoming <unk>.
_NUM_BYTE_PIECES = 256


class Tokenizer:
    """A SentencePiece model with our special ids. Thread-safe for encoding."""

    def __init__(self, proto: bytes, path: str = ""):
        self._sp = spm.SentencePieceProcessor(model_proto=proto)
        self.path = path
        ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
        if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
            raise DataError(f"{path or 'tokenizer'}: special ids {ids} != (0, 1, 2, 3)")

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        with open(path, "rb") as f:
            return cls(f.read(), path=path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without EOS or BOS."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS; pad and BOS are ignored."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(i)
        return self._sp.decode(out)

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def sample_training_text(corpus: Any, sample_size: int, seed: int) -> list[str]:
    """A seeded sample of about `sample_size` sentences, both sides of each pair."""
    n = len(corpus)
    num_pairs = min(n, max(1, sample_size // 2))
    idx = np.sort(np.random.default_rng(seed).choice(n, size=num_pairs, replace=False))
    texts = []
    for i in idx:
        src, tgt = corpus[int(i)]
        texts.extend(t for t in (src, tgt) if t)
    return texts


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int,
    model_type: str = "unigram",
) -> bytes:
    """Trains a SentencePiece model on `texts` and returns its serialized proto.

    Single-threaded so that the result depends only on the input (SentencePiece
    merges per-thread statistics in a scheduling-dependent order).
    """
    if model_type not in ("unigram", "bpe"):
        raise DataError(f"tokenizer_type must be 'unigram' or 'bpe', got {model_type!r}")
    min_vocab = _NUM_BYTE_PIECES + 4 + 1
    if vocab_size < min_vocab:
        raise DataError(f"vocab_size must be at least {min_vocab}, got {vocab_size}")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=0.9995,
        byte_fallback=True,
        pad_id=PAD_ID,
        eos_id=EOS_ID,
        bos_id=BOS_ID,
        unk_id=UNK_ID,
        # We sample ourselves (seeded); SentencePiece's own sampling is not.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=16384,
        num_threads=1,
        # Small corpora cannot always fill the vocabulary; accept fewer pieces.
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


def get_tokenizer(config: Any, workdir: str, corpus: Any) -> Tokenizer:
    """Loads `workdir/tokenizer.model`, or trains it from `corpus` and saves it.

    Training is deterministic: the sample depends on `config.seed` only.
    """
    path = os.path.join(workdir, TOKENIZER_FILENAME)
    if os.path.isfile(path):
        tok = Tokenizer.load(path)
        if tok.vocab_size != config.vocab_size:
            raise DataError(
                f"{path} has a vocabulary of {tok.vocab_size}, but config.vocab_size is "
                f"{config.vocab_size}: use a fresh workdir or set "
                f"--config.vocab_size={tok.vocab_size}"
            )
        return tok
    t0 = time.time()
    texts = sample_training_text(corpus, config.tokenizer_sample_size, config.seed)
    proto = train_tokenizer(texts, config.vocab_size, config.tokenizer_type)
    tok = Tokenizer(proto, path=path)
    if tok.vocab_size != config.vocab_size:
        raise DataError(
            f"the training text ({len(texts)} sentences) supports only {tok.vocab_size} "
            f"pieces, fewer than config.vocab_size={config.vocab_size}: lower vocab_size"
        )
    atomic_write_bytes(path, proto)
    print(
        f"[data] trained {config.tokenizer_type} tokenizer ({tok.vocab_size} pieces) on "
        f"{len(texts)} sentences in {time.time() - t0:.1f}s -> {path}",
        file=sys.stderr,
        flush=True,
    )
    return tok

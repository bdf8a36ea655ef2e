"""Tokenizers: ours (one SentencePiece model for both sides) and OPUS-MT's.

Ours is trained once per workdir on a bounded, seeded sample of the training text
of both languages, saved as `WORKDIR/tokenizer.model`, and reused on resume and by
decode.py. Ids: 0 pad, 1 eos, 2 bos, 3 unk, from model/tokens.py (the model's own).

An OPUS-MT model's (`MarianTokenizer`) cuts sources with source.spm and targets
with target.spm, and numbers the pieces of both with one joint vocabulary. A
workdir fine-tuned from such a model holds those three files instead of
tokenizer.model; `load_tokenizer` reads either kind.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import sentencepiece as spm

from attention_jax.data.corpora import read_pairs
from attention_jax.data.files import atomic_write_bytes
from attention_jax.runtime.errors import UserError
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID, visible

TOKENIZER_FILENAME = "tokenizer.model"
SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"  # OPUS-MT's SentencePiece models
MARIAN_VOCAB = "marian_vocab.json"  # an OPUS-MT vocabulary in our id order
# byte_fallback reserves 256 byte pieces, so unknown characters (emoji, rare
# scripts) round-trip exactly instead of becoming <unk>.
_NUM_BYTE_PIECES = 256

_log = logging.getLogger(__name__)


class Tokenizer:
    """A SentencePiece model with our special ids. Thread-safe for encoding."""

    def __init__(self, proto: bytes, path: str = "", num_threads: int = -1):
        """`num_threads` for batch encoding: -1 = SentencePiece's default (all cores)."""
        self._sp = spm.SentencePieceProcessor(model_proto=proto, num_threads=num_threads)
        self.proto, self.path = proto, path
        # Keys the tokenized-corpus cache: another model means other ids.
        self.fingerprint = hashlib.sha256(proto).hexdigest()
        ids = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
        if ids != (PAD_ID, EOS_ID, BOS_ID, UNK_ID):
            raise UserError(f"{path or 'tokenizer'}: special ids {ids} != (0, 1, 2, 3)")

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

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Targets are cut as sources are: one model for both sides."""
        return self.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS; pad and BOS are ignored."""
        return self._sp.decode(visible(ids))

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def files(self) -> dict[str, bytes]:
        """What an exported translator stores to tokenize as this does: {name: contents}."""
        return {TOKENIZER_FILENAME: self.proto}


class MarianTokenizer:
    """An OPUS-MT model's tokenizer, with `Tokenizer`'s interface: source.spm cuts sources
    and target.spm targets into pieces, the joint vocabulary numbers them (`pieces`, in
    our id order: backends/marian.py `read_pieces`), target.spm joins output pieces into text."""

    def __init__(
        self, source: bytes, target: bytes, pieces: list[str], path: str = "", num_threads: int = -1
    ):
        self._source = spm.SentencePieceProcessor(model_proto=source, num_threads=num_threads)
        self._target = spm.SentencePieceProcessor(model_proto=target, num_threads=num_threads)
        self.pieces, self.path = pieces, path
        self._protos = source, target
        self._ids = {p: i for i, p in reversed(list(enumerate(pieces)))}
        self.fingerprint = hashlib.sha256(b"\0".join(self.files().values())).hexdigest()

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def _number(self, pieces: list[list[str]]) -> list[list[int]]:
        """Pieces -> ids (a piece outside the vocabulary is <unk>)."""
        return [[self._ids.get(p, UNK_ID) for p in row] for row in pieces]

    def encode(self, text: str) -> list[int]:
        """Token ids of a source `text`, without EOS."""
        return self._number([self._source.encode(text, out_type=str)])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._number(self._source.encode(list(texts), out_type=str))

    def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._number(self._target.encode(list(texts), out_type=str))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to the first EOS; pad and BOS are ignored."""
        return self._target.decode_pieces([self.pieces[i] for i in visible(ids)])

    def id_to_piece(self, i: int) -> str:
        return self.pieces[int(i)]

    def files(self) -> dict[str, bytes]:
        """What an exported translator stores to tokenize as this does: {name: contents}."""
        vocab = json.dumps(self.pieces, ensure_ascii=False).encode("utf-8")
        return {SOURCE_SPM: self._protos[0], TARGET_SPM: self._protos[1], MARIAN_VOCAB: vocab}


def from_files(
    files: dict[str, bytes], path: str = "", num_threads: int = -1
) -> Tokenizer | MarianTokenizer:
    """The tokenizer whose `files()` these are."""
    if MARIAN_VOCAB in files:
        pieces = json.loads(files[MARIAN_VOCAB].decode("utf-8"))
        return MarianTokenizer(files[SOURCE_SPM], files[TARGET_SPM], pieces, path, num_threads)
    return Tokenizer(files[TOKENIZER_FILENAME], path=path, num_threads=num_threads)


def read_sentencepiece_models(directory: str) -> tuple[bytes, bytes]:
    """OPUS-MT's source.spm and target.spm in `directory` (UserError if one is missing)."""
    models = []
    for name in (SOURCE_SPM, TARGET_SPM):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise UserError(f"{directory}: no {name} (OPUS-MT's SentencePiece models)")
        with open(path, "rb") as f:
            models.append(f.read())
    return models[0], models[1]


def tokenizer_names(directory: str) -> tuple[str, ...]:
    """The names of the tokenizer files `load_tokenizer` reads in `directory`."""
    if os.path.isfile(os.path.join(directory, MARIAN_VOCAB)):
        return SOURCE_SPM, TARGET_SPM, MARIAN_VOCAB
    return (TOKENIZER_FILENAME,)


def has_tokenizer(directory: str) -> bool:
    """Whether `directory` holds a tokenizer's files (ours, or an OPUS-MT one's)."""
    return os.path.isfile(os.path.join(directory, tokenizer_names(directory)[-1]))


def load_tokenizer(directory: str) -> Tokenizer | MarianTokenizer:
    """The tokenizer a workdir or an exported translator holds: an OPUS-MT one (source.spm,
    target.spm, MARIAN_VOCAB) or ours (tokenizer.model)."""
    path = os.path.join(directory, MARIAN_VOCAB)
    if not os.path.isfile(path):
        return Tokenizer.load(os.path.join(directory, TOKENIZER_FILENAME))
    with open(path, "rb") as f:
        vocab = f.read()
    source, target = read_sentencepiece_models(directory)
    files = {SOURCE_SPM: source, TARGET_SPM: target, MARIAN_VOCAB: vocab}
    return from_files(files, path=directory)


# Pairs read from the corpus at a time while streaming the tokenizer's sample.
_SAMPLE_READ = 4096


def iter_training_text(corpus: Any, sample_size: int, seed: int) -> Iterator[str]:
    """A seeded sample of about `sample_size` sentences, both sides of each pair.

    Streamed in corpus order: SentencePiece keeps its own copy, so holding the
    sample in Python as well would double the memory of tokenizer training.
    """
    n = len(corpus)
    num_pairs = min(n, max(1, sample_size // 2))
    idx = np.sort(np.random.default_rng(seed).choice(n, size=num_pairs, replace=False))
    for lo in range(0, len(idx), _SAMPLE_READ):
        for src, tgt in read_pairs(corpus, idx[lo : lo + _SAMPLE_READ]):
            yield from (t for t in (src, tgt) if t)


def sample_training_text(corpus: Any, sample_size: int, seed: int) -> list[str]:
    """`iter_training_text` as a list."""
    return list(iter_training_text(corpus, sample_size, seed))


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    model_type: str = "unigram",
) -> bytes:
    """Trains a SentencePiece model on `texts` and returns its serialized proto.

    Single-threaded so that the result depends only on the input (SentencePiece
    merges per-thread statistics in a scheduling-dependent order).
    """
    min_vocab = _NUM_BYTE_PIECES + 4 + 1
    if vocab_size < min_vocab:
        raise UserError(f"vocab_size must be at least {min_vocab}, got {vocab_size}")
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


def get_tokenizer(config: Any, workdir: str, corpus: Any) -> Tokenizer | MarianTokenizer:
    """Loads the workdir's tokenizer (`load_tokenizer`: tokenizer.model, or an OPUS-MT
    model's files that a fine-tune wrote), or trains one from `corpus` and saves it
    as `workdir/tokenizer.model`.

    Training is deterministic: the sample depends on `config.seed` only.
    """
    path = os.path.join(workdir, TOKENIZER_FILENAME)
    if has_tokenizer(workdir):
        tok = load_tokenizer(workdir)
        if tok.vocab_size > config.vocab_size:  # its ids would not fit the embedding
            raise UserError(
                f"{tok.path} has a vocabulary of {tok.vocab_size}, but config.vocab_size "
                f"is {config.vocab_size}: use a fresh workdir or set "
                f"--config.vocab_size={tok.vocab_size}"
            )
        if tok.vocab_size < config.vocab_size:
            _log.info(
                f"{tok.path} has {tok.vocab_size} pieces, config.vocab_size "
                f"{config.vocab_size}: ids >= {tok.vocab_size} are never produced"
            )
        return tok
    t0 = time.time()
    count = [0]

    def counted(texts: Iterable[str]) -> Iterator[str]:
        for t in texts:
            count[0] += 1
            yield t

    texts = iter_training_text(corpus, config.tokenizer_sample_size, config.seed)
    try:
        proto = train_tokenizer(counted(texts), config.vocab_size, config.tokenizer_type)
    except RuntimeError as e:  # SentencePiece: "Vocabulary size is smaller than required_chars"
        need = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
        if not need:
            raise
        raise UserError(
            f"config.vocab_size={config.vocab_size} is too small for this corpus: its "
            f"characters, the {_NUM_BYTE_PIECES} byte pieces and the special ids need at least "
            f"{need.group(1)} pieces; set --config.vocab_size={need.group(1)} or more"
        ) from None
    tok = Tokenizer(proto, path=path)
    if tok.vocab_size < config.vocab_size:
        # hard_vocab_limit=False: SentencePiece stopped at the most pieces this text has.
        _log.warning(
            f"the tokenizer's training text ({count[0]} sentences) supports only "
            f"{tok.vocab_size} pieces, fewer than config.vocab_size={config.vocab_size}: "
            f"training on with {tok.vocab_size}; the model keeps {config.vocab_size} output "
            f"rows and never produces ids >= {tok.vocab_size}"
        )
    atomic_write_bytes(path, proto)
    _log.info(
        f"trained {config.tokenizer_type} tokenizer ({tok.vocab_size} pieces) on "
        f"{count[0]} sentences in {time.time() - t0:.1f}s -> {path}"
    )
    return tok

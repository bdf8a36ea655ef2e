"""Parallel corpora: the embedded Ding dictionary, TFDS translation sets, TSV files.

`load_split(config, split)` returns a corpus with random access (`len(c)`,
`c[i] -> (source, target)`) and a `fingerprint()` that keys the tokenized
cache (data/cache.py): a `ParallelCorpus` in memory (Ding), a `TfdsCorpus`
(ArrayRecord) or a `TsvCorpus` (read by byte offset from the file).
The dataset kind comes from `config.dataset` (train) or `config.eval_dataset`
(dev/test, '' = the dev/test split carved out of `config.dataset`):

    ding        German<->English from /usr/share/trans/de-en (Debian `trans-de-en`)
    tfds:NAME   any TFDS translation set, read through `tfds.data_source`
    tsv:PATH    one `source<TAB>target` pair a line
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from attention_jax.data import tsv
from attention_jax.data.files import atomic_write_bytes, cache_dir
from attention_jax.data.tsv import TsvCorpus
from attention_jax.runtime.errors import UserError

DING_PATH = "/usr/share/trans/de-en"
# Bump when the parser changes: the prepared-corpus cache is keyed on it.
DING_PARSER_VERSION = 1
# Dev and test are drawn from the full sentences only, this many pairs each.
DING_EVAL_SIZE = 1000
# A TSV file where more than this fraction of lines is malformed is an error.
TSV_MAX_MALFORMED = 0.5
SPLITS = ("train", "dev", "test")
# Fixed seed for held-out splits: they must not move when the training seed does.
_SPLIT_SEED = tsv.SPLIT_SEED

_log = logging.getLogger(__name__)


# --- Corpus containers ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelCorpus:
    """In-memory parallel text: `corpus[i] -> (source, target)`."""

    sources: Sequence[str]
    targets: Sequence[str]
    name: str = ""

    def __post_init__(self):
        if len(self.sources) != len(self.targets):
            raise ValueError("sources and targets differ in length")

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> tuple[str, str]:
        return self.sources[i], self.targets[i]

    def subset(self, indices: Sequence[int], name: str = "") -> ParallelCorpus:
        return ParallelCorpus(
            [self.sources[i] for i in indices],
            [self.targets[i] for i in indices],
            name or self.name,
        )

    def fingerprint(self) -> dict[str, Any]:
        """A hash of the text itself (in memory, so small: quick for Ding's 85k pairs)."""
        h = hashlib.sha256()
        for s, t in zip(self.sources, self.targets, strict=True):
            h.update(f"{len(s)}:{s}{len(t)}:{t}".encode())
        return {"kind": "memory", "pairs": len(self), "sha256": h.hexdigest()}


class TfdsCorpus:
    """Random-access view of a TFDS `data_source` (ArrayRecord) split.

    Elements are dicts of language -> bytes; we decode on access so that the
    corpus is never materialized (WMT has millions of pairs).
    """

    def __init__(
        self,
        source: Any,
        source_lang: str,
        target_lang: str,
        name: str = "",
        reopen: tuple[str, str, str | None] | None = None,
    ):
        self._source = source
        self._src, self._tgt = source_lang, target_lang
        self.name = name
        # (tfds name, split, data_dir): how a worker process opens the same source.
        self._reopen = reopen

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, i: int) -> tuple[str, str]:
        ex = self._source[int(i)]
        return _to_str(ex[self._src]), _to_str(ex[self._tgt])

    def __reduce__(self):
        if self._reopen is None:
            return object.__reduce__(self)
        return (_reopen_tfds, (*self._reopen, self._src, self._tgt, self.name))

    def fingerprint(self) -> dict[str, Any]:
        """The dataset's name, version, direction and files (names, sizes, mtimes)."""
        info = getattr(self._source, "dataset_info", None)
        listing: list[Any] = []
        data_dir = getattr(info, "data_dir", None)
        if data_dir and os.path.isdir(data_dir):
            for f in sorted(os.listdir(data_dir)):
                st = os.stat(os.path.join(data_dir, f))
                listing.append([f, st.st_size, st.st_mtime_ns])
        return {
            "kind": "tfds",
            "name": self.name,
            "version": str(getattr(info, "version", "")),
            "langs": [self._src, self._tgt],
            "pairs": len(self),
            "files": listing,
        }


def read_pairs(corpus: Any, positions: np.ndarray) -> list[tuple[str, str]]:
    """corpus[i] for each position (sorted positions: a TSV file reads them in spans).

    The pages of a TSV's mapped line index that the read mapped into this process
    are unmapped again: a cache build reads the index from end to end and the
    tokenizer's sample all over it, and each process doing so would otherwise end
    up holding all of it (16 bytes a pair, in every process's RSS).
    """
    if not hasattr(corpus, "pairs"):
        return [corpus[int(i)] for i in positions]
    pairs = corpus.pairs(positions)
    release = getattr(corpus, "release_pages", None)
    if release is not None:
        release()
    return pairs


def _reopen_tfds(name, split, data_dir, source_lang, target_lang, corpus_name) -> TfdsCorpus:
    import tensorflow_datasets as tfds

    source = tfds.data_source(name, split=split, data_dir=data_dir)
    return TfdsCorpus(source, source_lang, target_lang, corpus_name, (name, split, data_dir))


def _to_str(x: Any) -> str:
    if isinstance(x, bytes):
        return x.decode("utf-8")
    if isinstance(x, np.ndarray):  # scalar string tensors come back as 0-d arrays
        return _to_str(x.item())
    return str(x)


# --- Ding dictionary ----------------------------------------------------------

# Annotations: {m} {pl} {vt} (grammar), [med.] [ugs.] (domain/register),
# /MI/ (abbreviations), <Aalmolch> (alternative spellings / search keys).
_ANNOTATION = re.compile(r"\{[^}]*\}|\[[^\]]*\]|/[A-Z][A-Za-z0-9.]*/|<[^>]*>")
_SPACES = re.compile(r"\s+")
# A full sentence starts with a capital letter (or an opening quote) and ends
# with sentence punctuation, possibly followed by a closing quote.
_SENTENCE = re.compile(r"^[\"'„“‚‘(]?[A-ZÄÖÜ0-9].*[.!?…][\"'“”’)]?$")


def clean_ding_text(text: str) -> str:
    """Removes Ding annotations and normalizes whitespace."""
    text = _ANNOTATION.sub(" ", text)
    text = _SPACES.sub(" ", text).strip()
    # Annotations before punctuation leave "word ." behind.
    return re.sub(r" ([.,!?;:])", r"\1", text)


def is_sentence(text: str) -> bool:
    return bool(_SENTENCE.match(text)) and len(text.split()) >= 2


def parse_ding_line(line: str) -> list[tuple[str, str, bool]]:
    """Parses one `de :: en` line into (german, english, is_sentence) pairs.

    Sub-entries separated by `|` are aligned one to one; a line whose two
    sides have a different number of sub-entries is dropped. Within a
    sub-entry `;` separates synonyms, which are not aligned across the two
    sides, so only sub-entries with exactly one alternative on each side are
    kept. Pairs are kept when they are full sentences on both sides or
    phrases of at least two words on both sides (single words teach a
    translation model little and dominate the dictionary).
    """
    line = line.strip()
    if not line or line.startswith("#") or line.count("::") != 1:
        return []
    de, en = line.split("::")
    de_subs, en_subs = de.split("|"), en.split("|")
    if len(de_subs) != len(en_subs):
        return []
    pairs = []
    for d, e in zip(de_subs, en_subs, strict=True):
        d_alts = [a for a in (clean_ding_text(x) for x in d.split(";")) if a]
        e_alts = [a for a in (clean_ding_text(x) for x in e.split(";")) if a]
        if len(d_alts) != 1 or len(e_alts) != 1:
            continue
        d_text, e_text = d_alts[0], e_alts[0]
        if is_sentence(d_text) and is_sentence(e_text):
            pairs.append((d_text, e_text, True))
        elif len(d_text.split()) >= 2 and len(e_text.split()) >= 2:
            pairs.append((d_text, e_text, False))
    return pairs


def parse_ding(lines: Sequence[str] | Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Parses Ding lines into (sentence pairs, phrase pairs), deduplicated, in file order."""
    sentences: dict[tuple[str, str], None] = {}
    phrases: dict[tuple[str, str], None] = {}
    for line in lines:
        for de, en, sent in parse_ding_line(line):
            (sentences if sent else phrases)[(de, en)] = None
    return list(sentences), list(phrases)


def split_ding(
    sentences: Sequence[tuple[str, str]],
    phrases: Sequence[tuple[str, str]],
    eval_size: int = DING_EVAL_SIZE,
) -> dict[str, list[tuple[str, str]]]:
    """Deterministic train/dev/test split; dev and test are full sentences only.

    Any training pair that shares its German or its English side with a dev
    or test pair is removed, so held-out sentences are never seen in training.
    """
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(sentences))
    eval_size = min(eval_size, len(sentences) // 4)
    dev = [sentences[i] for i in order[:eval_size]]
    test = [sentences[i] for i in order[eval_size : 2 * eval_size]]
    held_out = {s for pair in dev + test for s in pair}
    rest = [sentences[i] for i in sorted(order[2 * eval_size :])] + list(phrases)
    train = [p for p in rest if p[0] not in held_out and p[1] not in held_out]
    return {"train": train, "dev": dev, "test": test}


def ding_path(config: Any) -> str:
    """The dictionary file: `config.ding_path` if set, `$ATTENTION_JAX_DING`, or the package's."""
    return config.ding_path or os.environ.get("ATTENTION_JAX_DING") or DING_PATH


def prepare_ding(path: str = DING_PATH) -> dict[str, list[tuple[str, str]]]:
    """Parses and splits the Ding file, cached on disk (keyed on size, mtime, parser)."""
    if not os.path.isfile(path):
        raise UserError(
            f"The default corpus 'ding' needs the Ding dictionary at {path}, which is "
            "missing. Install it with `sudo apt-get install trans-de-en` (`make train` "
            "does this when it can), or train on other data with "
            "--config.dataset=tsv:FILE.tsv or --config.dataset=tfds:NAME."
        )
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{DING_PARSER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache_file = os.path.join(cache_dir(), f"ding-v{DING_PARSER_VERSION}-{digest}.json")
    if os.path.isfile(cache_file):
        try:
            with open(cache_file, encoding="utf-8") as f:
                return {k: [tuple(p) for p in v] for k, v in json.load(f).items()}
        except (OSError, ValueError):
            _log.warning(f"ignoring unreadable cache {cache_file}")
    _log.info(f"parsing {path} (once; cached in {cache_file})")
    with open(path, encoding="utf-8", errors="replace") as f:
        sentences, phrases = parse_ding(f)
    splits = split_ding(sentences, phrases)
    _log.info(
        f"ding: {len(sentences)} sentence pairs, {len(phrases)} phrase pairs; "
        + ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    )
    atomic_write_bytes(cache_file, json.dumps(splits, ensure_ascii=False).encode("utf-8"))
    return splits


# --- TSV ---------------------------------------------------------------------


def read_tsv(path: str) -> tuple[TsvCorpus, int]:
    """The valid `source<TAB>target` lines of `path`; returns (corpus, malformed lines).

    Malformed lines (no tab or several, an empty side, bytes that are not
    UTF-8) are skipped; if they are the majority, the file is probably not
    what the user meant and we raise `UserError`. The lines are indexed once
    (cached by path, size and mtime) and read from disk on access, so a
    corpus of any size costs no memory (data/tsv.py).
    """
    index = tsv.line_index(path)
    total, bad = index.num_lines, index.num_malformed
    if total == 0:
        raise UserError(f"TSV file {path} has no lines")
    if bad:
        _log.warning(f"{path}: skipped {bad} malformed line(s) of {total}")
    if bad > TSV_MAX_MALFORMED * total:
        raise UserError(
            f"{path}: {bad} of {total} lines are malformed (expected one "
            "`source<TAB>target` pair per line in UTF-8)"
        )
    return TsvCorpus(index, name=f"tsv:{path}"), bad


# --- TFDS --------------------------------------------------------------------

_TFDS_SPLITS = {"train": "train", "dev": "validation", "test": "test"}


def load_tfds(name: str, split: str, config: Any) -> TfdsCorpus:
    """A TFDS translation split via `tfds.data_source` (no TensorFlow at run time)."""
    import tensorflow_datasets as tfds  # imported lazily: it is slow to import

    data_dir = config.tfds_data_dir or None
    tfds_split = _TFDS_SPLITS.get(split, split)
    try:
        source = tfds.data_source(name, split=tfds_split, data_dir=data_dir)
    except Exception as e:  # TFDS raises many kinds; all mean "not available"
        raise UserError(
            f"Cannot open TFDS dataset {name!r} split {tfds_split!r}: {e}. TFDS datasets "
            "must be prepared once (needs internet, and `pip install .[tf]` for some), "
            f"e.g. `tfds build {name} --file_format=array_record`."
        ) from e
    src, tgt = config.source_lang, config.target_lang
    if len(source):
        keys = set(source[0])
        if src not in keys or tgt not in keys:
            raise UserError(
                f"TFDS dataset {name!r} has languages {sorted(keys)}, not "
                f"source_lang={src!r} / target_lang={tgt!r}"
            )
    return TfdsCorpus(
        source, src, tgt, name=f"tfds:{name}/{tfds_split}", reopen=(name, tfds_split, data_dir)
    )


# --- Entry point ---------------------------------------------------------------


def _load(spec: str, split: str, config: Any, whole_file: bool) -> Any:
    if spec == "ding":
        src, tgt = config.source_lang, config.target_lang
        if {src, tgt} != {"de", "en"}:
            raise UserError(f"'ding' is German-English; got {src}->{tgt}")
        pairs = prepare_ding(ding_path(config))[split]
        de = [p[0] for p in pairs]
        en = [p[1] for p in pairs]
        sources, targets = (de, en) if src == "de" else (en, de)
        return ParallelCorpus(sources, targets, name=f"ding/{split}")
    if spec.startswith("tfds:"):
        return load_tfds(spec[len("tfds:") :], split, config)
    if spec.startswith("tsv:"):
        corpus, _ = read_tsv(os.path.expanduser(spec[len("tsv:") :]))
        if whole_file:
            return corpus
        # The held-out lines were drawn with `tsv.held_out_lines` when the file was indexed.
        held_out = corpus.index.held_out
        name = f"{corpus.name}/{split}"
        if split == "train":
            return TsvCorpus(corpus.index, skip=np.concatenate(list(held_out.values())), name=name)
        return TsvCorpus(corpus.index, take=held_out[split], name=name)
    raise UserError(f"Unknown dataset {spec!r}: expected 'ding', 'tfds:NAME' or 'tsv:PATH'")


def load_split(config: Any, split: str) -> ParallelCorpus | TfdsCorpus | TsvCorpus:
    """The 'train', 'dev' or 'test' split of the configured corpus.

    'train' reads `config.dataset`. 'dev'/'test' read `config.eval_dataset`
    when it is set (a TSV eval file is used whole), else the held-out split of
    `config.dataset` (for a TSV file: ~5% each, at most 1000 pairs, removed
    from its training split).
    """
    if split not in SPLITS:
        raise UserError(f"split must be one of {SPLITS}, got {split!r}")
    eval_spec = config.eval_dataset
    if split != "train" and eval_spec:
        return _load(eval_spec, split, config, whole_file=True)
    spec = config.dataset
    # A TSV training set keeps its held-out pairs only when an eval set exists.
    whole = spec.startswith("tsv:") and split == "train" and bool(eval_spec)
    return _load(spec, split, config, whole_file=whole)

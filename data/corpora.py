"""Parallel corpora: the embedded Ding dictionary, TFDS translation sets, TSV files.

`load_split(config, split)` returns a `ParallelCorpus`: random access
(`len(c)`, `c[i] -> (source, target)`), so a `grain.MapDataset` can wrap it.
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
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

DING_PATH = "/usr/share/trans/de-en"
# Bump when the parser changes: the prepared-corpus cache is keyed on it.
DING_PARSER_VERSION = 1
# Dev and test are drawn from the full sentences only, this many pairs each.
DING_EVAL_SIZE = 1000
# A TSV file where more than this fraction of lines is malformed is an error.
TSV_MAX_MALFORMED = 0.5
# Held-out pairs carved out of a TSV file when no eval set is given.
TSV_EVAL_SIZE = 1000
SPLITS = ("train", "dev", "test")
# Fixed seed for held-out splits: they must not move when the training seed does.
_SPLIT_SEED = 20170612


class DataError(ValueError):
    """A user error in the data configuration (missing file, bad format, ...)."""


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


class TfdsCorpus:
    """Random-access view of a TFDS `data_source` (ArrayRecord) split.

    Elements are dicts of language -> bytes; we decode on access so that the
    corpus is never materialized (WMT has millions of pairs).
    """

    def __init__(self, source: Any, source_lang: str, target_lang: str, name: str = ""):
        self._source = source
        self._src, self._tgt = source_lang, target_lang
        self.name = name

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, i: int) -> tuple[str, str]:
        ex = self._source[int(i)]
        return _to_str(ex[self._src]), _to_str(ex[self._tgt])


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


def cache_dir() -> str:
    """`$ATTENTION_JAX_CACHE`, else `$XDG_CACHE_HOME/attention-jax`, else ~/.cache/..."""
    if os.environ.get("ATTENTION_JAX_CACHE"):
        return os.environ["ATTENTION_JAX_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attention-jax")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Writes to a temporary file in the same directory, then renames."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _log(msg: str) -> None:
    print(f"[data] {msg}", file=sys.stderr, flush=True)


def ding_path(config: Any = None) -> str:
    """The dictionary file: `config.ding_path` if set, `$ATTENTION_JAX_DING`, or the package's."""
    path = config.get("ding_path", "") if config is not None and hasattr(config, "get") else ""
    return path or os.environ.get("ATTENTION_JAX_DING") or DING_PATH


def prepare_ding(path: str = DING_PATH) -> dict[str, list[tuple[str, str]]]:
    """Parses and splits the Ding file, cached on disk (keyed on size, mtime, parser)."""
    if not os.path.isfile(path):
        raise DataError(
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
            _log(f"ignoring unreadable cache {cache_file}")
    _log(f"parsing {path} (once; cached in {cache_file})")
    with open(path, encoding="utf-8", errors="replace") as f:
        sentences, phrases = parse_ding(f)
    splits = split_ding(sentences, phrases)
    _log(
        f"ding: {len(sentences)} sentence pairs, {len(phrases)} phrase pairs; "
        + ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    )
    atomic_write_bytes(cache_file, json.dumps(splits, ensure_ascii=False).encode("utf-8"))
    return splits


# --- TSV ---------------------------------------------------------------------


def read_tsv(path: str) -> tuple[ParallelCorpus, int]:
    """Reads `source<TAB>target` lines; returns (corpus, number of malformed lines).

    Malformed lines (no tab, an empty side, bytes that are not UTF-8) are
    skipped; if they are the majority, the file is probably not what the user
    meant and we raise `DataError`. Extra tabs go to the target side's
    rejection too: a line must have exactly one tab.
    """
    if not os.path.isfile(path):
        raise DataError(f"TSV file not found: {path}")
    sources, targets, bad, total = [], [], 0, 0
    with open(path, "rb") as f:
        for raw in f:
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue  # blank lines (e.g. a trailing newline) are not data
            total += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                bad += 1
                continue
            parts = line.split("\t")
            if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
                bad += 1
                continue
            sources.append(parts[0].strip())
            targets.append(parts[1].strip())
    if total == 0:
        raise DataError(f"TSV file {path} has no lines")
    if bad:
        _log(f"{path}: skipped {bad} malformed line(s) of {total}")
    if bad > TSV_MAX_MALFORMED * total:
        raise DataError(
            f"{path}: {bad} of {total} lines are malformed (expected one "
            "`source<TAB>target` pair per line in UTF-8)"
        )
    return ParallelCorpus(sources, targets, name=f"tsv:{path}"), bad


def split_tsv(n: int, eval_size: int = TSV_EVAL_SIZE) -> dict[str, np.ndarray]:
    """Deterministic train/dev/test indices for a TSV file without an eval set."""
    k = min(eval_size, n // 20)  # at most 5% per held-out split
    order = np.random.default_rng(_SPLIT_SEED).permutation(n)
    return {
        "dev": np.sort(order[:k]),
        "test": np.sort(order[k : 2 * k]),
        "train": np.sort(order[2 * k :]),
    }


# --- TFDS --------------------------------------------------------------------

_TFDS_SPLITS = {"train": "train", "dev": "validation", "test": "test"}


def load_tfds(name: str, split: str, config: Any) -> TfdsCorpus:
    """A TFDS translation split via `tfds.data_source` (no TensorFlow at run time)."""
    import tensorflow_datasets as tfds  # imported lazily: it is slow to import

    data_dir = config.get("tfds_data_dir", "") or None
    tfds_split = _TFDS_SPLITS.get(split, split)
    try:
        source = tfds.data_source(name, split=tfds_split, data_dir=data_dir)
    except Exception as e:  # TFDS raises many kinds; all mean "not available"
        raise DataError(
            f"Cannot open TFDS dataset {name!r} split {tfds_split!r}: {e}. TFDS datasets "
            "must be prepared once (needs internet, and `pip install .[tf]` for some), "
            f"e.g. `tfds build {name} --file_format=array_record`."
        ) from e
    src, tgt = config.source_lang, config.target_lang
    if len(source):
        keys = set(source[0])
        if src not in keys or tgt not in keys:
            raise DataError(
                f"TFDS dataset {name!r} has languages {sorted(keys)}, not "
                f"source_lang={src!r} / target_lang={tgt!r}"
            )
    return TfdsCorpus(source, src, tgt, name=f"tfds:{name}/{tfds_split}")


# --- Entry point ---------------------------------------------------------------


def _load(spec: str, split: str, config: Any, whole_file: bool) -> Any:
    if spec == "ding":
        src, tgt = config.source_lang, config.target_lang
        if {src, tgt} != {"de", "en"}:
            raise DataError(f"'ding' is German-English; got {src}->{tgt}")
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
        idx = split_tsv(len(corpus))[split]
        return corpus.subset(idx, name=f"{corpus.name}/{split}")
    raise DataError(f"Unknown dataset {spec!r}: expected 'ding', 'tfds:NAME' or 'tsv:PATH'")


def load_split(config: Any, split: str) -> ParallelCorpus | TfdsCorpus:
    """The 'train', 'dev' or 'test' split of the configured corpus.

    'train' reads `config.dataset`. 'dev'/'test' read `config.eval_dataset`
    when it is set (a TSV eval file is used whole), else the held-out split of
    `config.dataset` (for a TSV file: ~5% each, at most 1000 pairs, removed
    from its training split).
    """
    if split not in SPLITS:
        raise DataError(f"split must be one of {SPLITS}, got {split!r}")
    eval_spec = config.get("eval_dataset", "") if hasattr(config, "get") else ""
    if split != "train" and eval_spec:
        return _load(eval_spec, split, config, whole_file=True)
    spec = config.dataset
    # A TSV training set keeps its held-out pairs only when an eval set exists.
    whole = spec.startswith("tsv:") and split == "train" and bool(eval_spec)
    return _load(spec, split, config, whole_file=whole)

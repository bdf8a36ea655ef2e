"""TSV corpora read by byte offset: the vectorized line index against the earlier
in-memory reader, pinned held-out splits, the on-disk index cache, cheap pickling."""

import os
import pickle
import random

import numpy as np
import pytest
from ml_collections import ConfigDict

from attention_jax.configs import default
from attention_jax.data import load_split, tsv
from attention_jax.data.corpora import read_tsv


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_JAX_CACHE", str(tmp_path / "cache"))


def reference_read(data: bytes) -> tuple[list[tuple[str, str]], int]:
    """The reader this module replaced (data/corpora.py before the cache), verbatim:
    (valid pairs, non-blank lines)."""
    pairs, total = [], 0
    for raw in data.splitlines(keepends=True) if b"\r" not in data else _lines(data):
        raw = raw.rstrip(b"\r\n")
        if not raw.strip():
            continue
        total += 1
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            continue
        pairs.append((parts[0].strip(), parts[1].strip()))
    return pairs, total


def _lines(data: bytes) -> list[bytes]:
    """Lines as `for raw in open(path, 'rb')` yields them: split after b'\\n' only."""
    out = data.split(b"\n")
    return [x + b"\n" for x in out[:-1]] + ([out[-1]] if out[-1] else [])


# Pieces of nasty lines: tabs, CRs, ASCII and Unicode whitespace (\x1c-\x1f and U+0085
# are whitespace to str.strip() but not to bytes.strip()), invalid UTF-8, emoji.
PIECES = [
    b"a",
    b"Zz",
    b" ",
    b"\t",
    b"\r",
    b"\x0b",
    b"\x1c",
    b"\x1f",
    "é".encode(),
    "\u00a0".encode(),
    "\u3000".encode(),
    "\u0085".encode(),
    "😀".encode(),
    b"\xff",
    b"\xc3",
    b"\n",
]


def random_block(rng: random.Random) -> bytes:
    data = b"".join(rng.choice(PIECES) for _ in range(rng.randint(0, 60)))
    return data + (b"\n" if rng.random() < 0.5 else b"")


def test_scan_block_matches_the_reference_reader():
    rng = random.Random(0)
    for _ in range(2000):
        data = random_block(rng)
        starts, ends, nonblank = tsv.scan_block(data)
        want, total = reference_read(data)
        got = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            src, tgt = data[s:e].decode("utf-8").split("\t")
            got.append((src.strip(), tgt.strip()))
        assert (got, nonblank) == (want, total), data


def test_file_index_across_block_boundaries(tmp_path, monkeypatch):
    """A file read in blocks shorter than its lines indexes like one read whole."""
    rng = random.Random(1)
    blocks = [random_block(rng) + f"\ngood {i}\tpair {i}\n".encode() for i in range(300)]
    data = b"".join(blocks) + b"last\tline without break"
    path = tmp_path / "nasty.tsv"
    path.write_bytes(data)
    monkeypatch.setattr(tsv, "_BLOCK_BYTES", 7)
    index = tsv.line_index(str(path))  # read_tsv would refuse a mostly malformed file
    corpus, bad = tsv.TsvCorpus(index), index.num_malformed
    want, total = reference_read(data)
    assert len(want) > 300
    assert [corpus[i] for i in range(len(corpus))] == want
    assert corpus.pairs(np.arange(len(corpus))) == want
    assert bad == total - len(want)


def write_pinned(path) -> str:
    """230 lines: 200 pairs 's{i}\\tt{i}', 21 malformed, 9 blank."""
    lines = []
    for i in range(230):
        if i % 11 == 5:
            lines.append(f"broken line {i}")
        elif i % 23 == 7:
            lines.append("")
        else:
            lines.append(f"s{i}\tt{i}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def config(**kw) -> ConfigDict:
    c = default.get_config()
    c.update(kw)
    return c


def test_held_out_pairs_are_the_ones_of_the_in_memory_reader(tmp_path):
    """Pinned: these are the dev/test pairs the earlier reader carved out of this file."""
    path = write_pinned(tmp_path / "pin.tsv")
    parts = {s: load_split(config(dataset=f"tsv:{path}"), s) for s in ("train", "dev", "test")}
    dev = ["s32", "s52", "s57", "s61", "s63", "s96", "s111", "s142", "s171", "s224"]
    test = ["s9", "s14", "s19", "s39", "s40", "s86", "s105", "s116", "s147", "s200"]
    assert [parts["dev"][i][0] for i in range(len(parts["dev"]))] == dev
    assert [parts["test"][i] for i in range(len(parts["test"]))] == [(s, "t" + s[1:]) for s in test]
    train = [parts["train"][i][0] for i in range(len(parts["train"]))]
    everything = [f"s{i}" for i in range(230) if i % 11 != 5 and i % 23 != 7]
    assert train == [s for s in everything if s not in dev + test]  # in file order
    assert parts["train"].pairs(np.array([3, 0, 179])) == [
        parts["train"][3],
        parts["train"][0],
        parts["train"][179],
    ]


def test_skip_maps_positions_to_the_kept_lines():
    index = type("Index", (), {"num_valid": 50, "path": "", "fingerprint": {}})()
    skip = np.array([0, 3, 4, 17, 49])
    corpus = tsv.TsvCorpus(index, skip=skip)
    kept = np.setdiff1d(np.arange(50), skip)
    assert len(corpus) == len(kept)
    np.testing.assert_array_equal(corpus.lines(np.arange(len(kept))), kept)


def test_index_is_cached_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(tsv, "CACHE_MIN_BYTES", 0)  # small files are indexed in memory
    path = write_pinned(tmp_path / "pin.tsv")
    first, _ = read_tsv(path)
    scans = []
    real_scan = tsv._scan_file
    monkeypatch.setattr(tsv, "_scan_file", lambda *a: scans.append(a) or real_scan(*a))
    again, _ = read_tsv(path)  # mapped from the cache: no scan
    assert scans == [] and again.index.directory == first.index.directory
    with open(path, "a") as f:
        f.write("new\tpair\n")
    os.utime(path, ns=(1, 1))
    changed, _ = read_tsv(path)
    assert len(scans) == 1 and len(changed) == len(first) + 1
    assert changed[len(changed) - 1] == ("new", "pair")
    # The stale index of the old file was removed, not left to pile up.
    assert not os.path.exists(first.index.directory)


def test_corpus_pickles_without_its_arrays(tmp_path, monkeypatch):
    """Worker processes get a cached index's location, not its offsets."""
    monkeypatch.setattr(tsv, "CACHE_MIN_BYTES", 0)
    path = tmp_path / "big.tsv"
    path.write_text("".join(f"s{i}\tt{i}\n" for i in range(20000)), encoding="utf-8")
    corpus = load_split(config(dataset=f"tsv:{path}"), "train")
    blob = pickle.dumps(corpus)
    # ~16 KB: the 1000 + 1000 skipped line numbers, not 20000 offsets (>= 160 KB)
    assert len(blob) < 40_000, len(blob)
    copy = pickle.loads(blob)
    assert [copy[i] for i in (0, 5, len(copy) - 1)] == [corpus[i] for i in (0, 5, len(corpus) - 1)]


def test_small_files_are_indexed_in_memory(tmp_path):
    """Below CACHE_MIN_BYTES nothing is written to the user's cache, and the index pickles."""
    path = write_pinned(tmp_path / "pin.tsv")
    corpus, bad = read_tsv(path)
    assert bad == 21 and corpus.index.directory is None
    assert not (tmp_path / "cache").exists()
    copy = pickle.loads(pickle.dumps(corpus))
    assert [copy[i] for i in range(len(copy))] == [corpus[i] for i in range(len(corpus))]


@pytest.mark.parametrize("n", [0, 19, 20, 1000, 54_321, 3_000_000])
def test_held_out_lines_are_the_first_of_the_seeded_permutation(n):
    """Shuffled in int32 to halve the index build's memory: the lines of the int64
    permutation all the same (its draws depend on n alone)."""
    from attention_jax.data.tsv import SPLIT_SEED, held_out_lines

    k = min(1000, n // 20)
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    held = held_out_lines(n)
    np.testing.assert_array_equal(held["dev"], np.sort(order[:k]))
    np.testing.assert_array_equal(held["test"], np.sort(order[k : 2 * k]))
    assert held["dev"].dtype == held["test"].dtype == np.int64

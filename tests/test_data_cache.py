"""The tokenized-corpus cache: batches equal the uncached ones, the key (rebuilt exactly
when the corpus file, tokenizer, max_length or long_pairs change), SIGKILL mid-build,
two processes building disjoint shards at once, parallel workers, exact resume."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from attention_jax.configs import default
from attention_jax.data import TrainIterator, cache, files, get_tokenizer, load_split
from attention_jax.data.cache import ShardSpec, tokenized_shard
from attention_jax.data.corpora import ParallelCorpus, TfdsCorpus
from attention_jax.data.tokenized import FIELDS
from tests.conftest import write_reversal_tsv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_JAX_CACHE", str(tmp_path / "user-cache"))


def config(tsv: str = "", **kw):
    c = default.get_config()
    c.update(
        dict(
            dataset=f"tsv:{tsv}",
            vocab_size=300,
            tokenizer_sample_size=2000,
            max_length=16,
            batch_tokens=256,
            packing=False,
        )
    )
    c.update(kw)
    return c


@pytest.fixture(scope="module")
def corpus_tsv(tmp_path_factory):
    return write_reversal_tsv(
        tmp_path_factory.mktemp("data") / "pairs.tsv", num_pairs=3000, max_words=9, seed=0
    )


@pytest.fixture(scope="module")
def tokenizer(corpus_tsv, tmp_path_factory):
    c = config(corpus_tsv)
    return get_tokenizer(c, str(tmp_path_factory.mktemp("wd")), load_split(c, "train"))


def same_arrays(a, b):
    for f in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), f)
    assert a.num_dropped == b.num_dropped


def count_builds(monkeypatch) -> list:
    builds = []
    real = cache._build
    monkeypatch.setattr(cache, "_build", lambda *a: builds.append(a[2]) or real(*a))
    return builds


@pytest.mark.parametrize("packing", [False, True])
def test_batches_from_the_cache_equal_batches_without_it(corpus_tsv, tokenizer, tmp_path, packing):
    c = config(corpus_tsv, packing=packing, max_length=12)  # some pairs dropped
    corpus = load_split(c, "train")
    cached = TrainIterator(c, tokenizer, corpus, cache_dir=str(tmp_path / "cache"))
    mapped = TrainIterator(c, tokenizer, corpus, cache_dir=str(tmp_path / "cache"))
    plain = TrainIterator(c, tokenizer, corpus)
    assert isinstance(mapped._tc.src_flat, np.memmap) and mapped._tc.src_flat.dtype == np.uint16
    assert cached.num_dropped == plain.num_dropped > 0
    same_arrays(mapped._tc, plain._tc)
    for _ in range(plain.batches_per_epoch + 3):  # across an epoch boundary
        want, got1, got2 = next(plain), next(cached), next(mapped)
        assert want.keys() == got1.keys() == got2.keys()
        for k in want:
            assert got1[k].dtype == np.int32
            np.testing.assert_array_equal(got1[k], want[k])
            np.testing.assert_array_equal(got2[k], want[k])


def test_cache_is_rebuilt_exactly_when_its_inputs_change(
    corpus_tsv, tokenizer, tmp_path, monkeypatch
):
    builds = count_builds(monkeypatch)
    path = str(tmp_path / "pairs.tsv")
    with open(corpus_tsv) as f, open(path, "w") as g:
        g.write(f.read())
    root = str(tmp_path / "cache")

    def shard(c, tok=tokenizer):
        spec = ShardSpec(0, 1, c.max_length, c.long_pairs)
        return tokenized_shard(load_split(c, "train"), tok, spec, cache_dir=root)

    base = shard(config(path))
    shard(config(path))
    assert len(builds) == 1  # same inputs: mapped, not rebuilt
    shard(config(path, max_length=12))
    shard(config(path, long_pairs="truncate"))
    assert len(builds) == 3
    other_tok = get_tokenizer(
        config(path, seed=1), str(tmp_path / "wd"), load_split(config(path), "train")
    )
    assert other_tok.fingerprint != tokenizer.fingerprint
    shard(config(path), other_tok)
    assert len(builds) == 4
    shard(config(path), tokenizer)  # back to the first: still there
    assert len(builds) == 4
    with open(path, "a") as f:  # the corpus file changes
        f.write("aaa bbb\tbbb aaa\n")
    os.utime(path, ns=(1, 1))
    changed = shard(config(path))
    assert len(builds) == 5 and len(changed) > 0
    # Every shard directory has a manifest naming its key; no temporary directory is left.
    entries = os.listdir(root)
    assert len(entries) == 5 and not [e for e in entries if e.startswith(".")]
    assert all(files.read_manifest(os.path.join(root, e))["key"]["version"] for e in entries)
    assert len(base) > 0


def test_ding_and_tfds_corpora_are_cached_too(tokenizer, tmp_path, monkeypatch):
    builds = count_builds(monkeypatch)
    root = str(tmp_path / "cache")
    spec = ShardSpec(0, 1, 16, "drop")
    pairs = [(f"abc def {i}", f"def abc {i}") for i in range(50)]
    ding = ParallelCorpus([p[0] for p in pairs], [p[1] for p in pairs], name="ding/train")
    a = tokenized_shard(ding, tokenizer, spec, cache_dir=root)
    b = tokenized_shard(ding, tokenizer, spec, cache_dir=root)
    edited = ParallelCorpus([*ding.sources[:-1], "changed"], ding.targets, name="ding/train")
    tokenized_shard(edited, tokenizer, spec, cache_dir=root)
    assert len(builds) == 2
    same_arrays(a, b)

    class Source:  # a tfds.data_source stand-in (ArrayRecord: random access to dicts)
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return {"de": f"abc {i}".encode(), "en": f"def {i}".encode()}

    tfds = TfdsCorpus(Source(), "en", "de", name="tfds:x/train")
    c = tokenized_shard(tfds, tokenizer, spec, cache_dir=root)
    tokenized_shard(tfds, tokenizer, spec, cache_dir=root)
    assert len(builds) == 3
    same_arrays(c, tokenized_shard(tfds, tokenizer, spec, cache_dir=None))


_KILLED_BUILD = textwrap.dedent(
    """
    import sys, time
    from attention_jax.data import cache, load_split, tokenized
    from attention_jax.data.tokenizer import Tokenizer
    from attention_jax.configs import default

    tsv, tok_path, root = sys.argv[1:4]
    c = default.get_config()
    c.dataset, c.max_length = "tsv:" + tsv, 16
    cache.CHUNK_PAIRS = 64  # many small chunks, each slowed down: a long build to kill
    encode = tokenized.encode_chunk
    cache.encode_chunk = lambda *a, **k: (time.sleep(0.1), encode(*a, **k))[1]
    cache.tokenized_shard(load_split(c, "train"), Tokenizer.load(tok_path),
                          cache.ShardSpec(0, 1, 16, "drop"), cache_dir=root, workers=1)
    print("finished")
    """
)


def test_a_build_killed_midway_leaves_nothing_a_later_run_trusts(
    corpus_tsv, tokenizer, tmp_path, monkeypatch
):
    root = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BUILD, corpus_tsv, tokenizer.path, str(root)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once some token ids are on disk
        temps = [d for d in (os.listdir(root) if root.exists() else []) if ".tmp-" in d]
        if temps and os.path.getsize(root / temps[0] / "src.bin") > 0:
            break
        assert child.poll() is None, child.communicate()
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.communicate()
    entries = os.listdir(root)
    assert len(entries) == 1 and ".tmp-" in entries[0]  # only the private build directory

    c = config(corpus_tsv)
    spec = ShardSpec(0, 1, 16, "drop")
    corpus = load_split(c, "train")
    builds = count_builds(monkeypatch)
    want = tokenized_shard(corpus, tokenizer, spec, cache_dir=None)
    same_arrays(tokenized_shard(corpus, tokenizer, spec, cache_dir=str(root)), want)
    assert len(builds) == 1  # rebuilt, not resumed from the killed build's files
    (final,) = os.listdir(root)  # the dead process's directory is gone
    assert ".tmp-" not in final

    # A published shard damaged later (here: truncated) is moved aside and rebuilt.
    # (Nothing maps it any more: truncating a mapped file would crash its reader.)
    with open(root / final / "tgt.bin", "r+b") as f:
        f.truncate(10)
    same_arrays(tokenized_shard(corpus, tokenizer, spec, cache_dir=str(root)), want)
    assert len(builds) == 2
    assert sorted(".damaged-" in e for e in os.listdir(root)) == [False, True]


def test_stale_temporaries_of_other_hosts_are_removed_after_an_hour(tmp_path):
    final = str(tmp_path / "shard")
    young, old = (tmp_path / f".shard.tmp-otherhost-{p}-abcd" for p in (1, 2))
    for d in (young, old):
        d.mkdir()
        (d / "src.bin").write_bytes(b"12")
    os.utime(old / "src.bin", (time.time() - 7200,) * 2)
    files.remove_stale_temps(final)
    assert young.exists() and not old.exists()


_SHARD_BUILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from attention_jax.data import cache, load_split
    from attention_jax.data.tokenizer import Tokenizer
    from attention_jax.configs import default

    tsv, tok_path, root, index = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = default.get_config()
    c.dataset = "tsv:" + tsv
    tc = cache.tokenized_shard(load_split(c, "train"), Tokenizer.load(tok_path),
                               cache.ShardSpec(index, 2, 16, "truncate"), cache_dir=root)
    print(json.dumps(np.asarray(tc.index).tolist()))
    """
)


def test_atomic_write_replaces_a_file_whole_or_not_at_all(tmp_path):
    """The one helper behind config.json, metrics.jsonl, decode.py's output and exports."""
    path = str(tmp_path / "sub" / "out.txt")
    with files.atomic_write(path, "w") as f:
        f.write("first\n")
    with pytest.raises(RuntimeError), files.atomic_write(path, "w") as f:
        f.write("half of a second")
        raise RuntimeError("killed midway")
    assert (tmp_path / "sub" / "out.txt").read_text() == "first\n"  # the old file, whole
    assert os.listdir(tmp_path / "sub") == ["out.txt"]  # no temporary left behind
    probe = tmp_path / "probe"
    probe.write_text("")  # the permissions `open` gives, not mkstemp's owner-only ones
    assert os.stat(path).st_mode & 0o777 == os.stat(probe).st_mode & 0o777


def test_two_processes_build_their_own_shards_into_one_directory(corpus_tsv, tokenizer, tmp_path):
    root = str(tmp_path / "shared")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARD_BUILD, corpus_tsv, tokenizer.path, root, str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    got = [json.loads(o[0]) for o in outs]
    n = len(load_split(config(corpus_tsv), "train"))
    assert got[0] == list(range(0, n, 2)) and got[1] == list(range(1, n, 2))  # disjoint, all
    assert sorted(os.listdir(root)) == sorted(
        e for e in os.listdir(root) if e.endswith(("s00000of00002", "s00001of00002"))
    )
    corpus = load_split(config(corpus_tsv), "train")
    for i in (0, 1):
        spec = ShardSpec(i, 2, 16, "truncate")
        same_arrays(
            tokenized_shard(corpus, tokenizer, spec, cache_dir=root),
            tokenized_shard(corpus, tokenizer, spec, cache_dir=None),
        )


def test_worker_processes_give_the_same_arrays(corpus_tsv, tokenizer, monkeypatch, caplog):
    corpus = load_split(config(corpus_tsv), "train")
    spec = ShardSpec(0, 1, 16, "drop")
    alone = tokenized_shard(corpus, tokenizer, spec, cache_dir=None, workers=1)
    monkeypatch.setattr(cache, "PARALLEL_MIN_PAIRS", 0)
    monkeypatch.setattr(cache, "CHUNK_PAIRS", 200)
    monkeypatch.setattr(cache, "_LOG_EVERY_S", 0.0)  # a progress line after every chunk
    with caplog.at_level("INFO", logger="data"):
        pooled = tokenized_shard(corpus, tokenizer, spec, cache_dir=None, workers=2)
    same_arrays(pooled, alone)
    assert any("pairs/s" in r.getMessage() for r in caplog.records)


def test_resume_from_a_mapped_cache_is_exact(corpus_tsv, tokenizer, tmp_path):
    c = config(corpus_tsv)
    corpus = load_split(c, "train")
    root = str(tmp_path / "cache")
    it = TrainIterator(c, tokenizer, corpus, cache_dir=root)
    for _ in range(it.batches_per_epoch - 2):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(5)]
    resumed = TrainIterator(c, tokenizer, corpus, cache_dir=root)
    resumed.set_state(state)
    for w in want:
        got = next(resumed)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])


class BigVocab:
    """A tokenizer whose ids do not fit uint16."""

    vocab_size, fingerprint = 70_000, "big-vocab"

    def encode_batch(self, texts):
        return [[69_999, 4 + len(t)] for t in texts]

    encode_target_batch = encode_batch  # one model for both sides


def test_ids_are_uint16_when_they_fit_else_int32(tmp_path):
    corpus = ParallelCorpus(["a b", "c"], ["d", "e f"], name="mem")
    spec = ShardSpec(0, 1, 8, "drop")
    tc = tokenized_shard(corpus, BigVocab(), spec, cache_dir=str(tmp_path))
    assert tc.src_flat.dtype == np.int32 and tc.src_flat.tolist() == [69_999, 7, 69_999, 5]
    BigVocab.vocab_size = 65_536  # claims to fit, but emits 69_999: a clear error
    try:
        with pytest.raises(files.UserError, match="out of range"):
            tokenized_shard(corpus, BigVocab(), spec, cache_dir=None)
    finally:
        BigVocab.vocab_size = 70_000


def _rss_file_mb() -> float | None:
    """This process's resident pages of mapped files (Linux), MB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) / 1024 for x in f if x.startswith("RssFile:"))
    except (OSError, StopIteration):
        return None


def test_release_pages_unmaps_what_reading_mapped_and_keeps_the_data(tmp_path):
    from attention_jax.data.tokenized import TokenizedCorpus, release_pages

    if _rss_file_mb() is None:
        pytest.skip("no /proc/self/status here")
    n = 16 << 20  # 64 MB of int32
    path = str(tmp_path / "flat.bin")
    np.arange(n, dtype=np.int32).tofile(path)
    flat = np.memmap(path, np.int32, mode="r", shape=(n,))
    meta = np.zeros(4, np.int64)
    tc = TokenizedCorpus(flat, meta, meta.astype(np.int16), flat[8:], meta, meta, meta)
    before = _rss_file_mb()
    assert int(flat[::1024].sum()) == sum(range(0, n, 1024))  # maps every page in
    mapped = _rss_file_mb()
    assert mapped - before > 32  # about 64 MB came in (0 if nothing was mapped)
    release_pages(tc)
    assert mapped - _rss_file_mb() > 32  # the shard's pages left this process ...
    assert int(flat[12345]) == 12345 and int(tc.tgt_flat[0]) == 8  # ... not the file
    release_pages(TokenizedCorpus(*(np.zeros(2, np.int64) for _ in range(7))))  # in memory: no-op


def test_reading_a_tsv_unmaps_its_line_index_again(tmp_path):
    """A cache build reads a TSV's mapped line index from end to end, in every worker:
    read_pairs leaves none of the index's pages in the process, and reads right."""
    from attention_jax.data import tsv
    from attention_jax.data.corpora import read_pairs

    if _rss_file_mb() is None:
        pytest.skip("no /proc/self/status here")
    n = 1 << 20  # 16 MB of line offsets
    path = tmp_path / "big.tsv"
    path.write_text(
        "".join(f"ein satz mit der nummer {i}\tsentence number {i}\n" for i in range(n))
    )
    assert path.stat().st_size > tsv.CACHE_MIN_BYTES  # so its index is mapped, not read
    corpus = tsv.TsvCorpus(tsv.line_index(str(path), root=str(tmp_path / "index")))
    chunks = [np.arange(lo, min(lo + 8192, n)) for lo in range(0, n, 8192)]
    before = _rss_file_mb()
    for chunk in chunks:
        corpus.pairs(chunk)
    assert _rss_file_mb() - before > 8  # plain reads keep the index's ~16 MB mapped
    corpus.release_pages()
    assert _rss_file_mb() - before < 2
    for chunk in chunks:
        read_pairs(corpus, chunk)
    assert _rss_file_mb() - before < 2
    picked = read_pairs(corpus, np.array([0, 654_321, n - 1]))
    assert picked == [
        (f"ein satz mit der nummer {i}", f"sentence number {i}") for i in (0, 654_321, n - 1)
    ]


def test_a_cache_build_unmaps_the_line_index_after_every_chunk(corpus_tsv, tokenizer, monkeypatch):
    class Counting:  # a file-backed corpus that counts its release_pages calls
        def __init__(self, inner):
            self.inner, self.released = inner, 0

        def __len__(self):
            return len(self.inner)

        def pairs(self, positions):
            return self.inner.pairs(positions)

        def release_pages(self):
            self.released += 1

    corpus = load_split(config(corpus_tsv), "train")
    spec = ShardSpec(0, 1, 16, "drop")
    monkeypatch.setattr(cache, "CHUNK_PAIRS", 200)
    counting = Counting(corpus)
    same_arrays(
        tokenized_shard(counting, tokenizer, spec, cache_dir=None, workers=1),
        tokenized_shard(corpus, tokenizer, spec, cache_dir=None, workers=1),
    )
    assert counting.released == -(-len(corpus) // 200)  # once per chunk

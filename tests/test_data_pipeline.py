"""Batching: coverage per epoch, token budget, packing, resume, sharding, eval order."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ml_collections import ConfigDict

from data import BOS_ID, EOS_ID, eval_batches, to_global_batch, train_iterator
from data.corpora import ParallelCorpus


class WordTokenizer:
    """Deterministic stand-in for SentencePiece: one id per word (>= 4)."""

    vocab_size = 1000

    def encode(self, text):
        return [4 + int(w) for w in text.split()]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]


TOK = WordTokenizer()


def make_corpus(n=300, seed=0, max_words=40):
    """Pair i's words encode i, so batches can be mapped back to examples."""
    rng = np.random.default_rng(seed)
    src, tgt = [], []
    for i in range(n):
        ls, lt = rng.integers(1, max_words, size=2)
        src.append(" ".join([str(i)] + [str(rng.integers(0, 900)) for _ in range(ls - 1)]))
        tgt.append(" ".join([str(i)] + [str(rng.integers(0, 900)) for _ in range(lt - 1)]))
    return ParallelCorpus(src, tgt)


def config(**kw):
    c = ConfigDict(
        dict(
            max_length=32,
            long_pairs="drop",
            batch_tokens=512,
            length_buckets=(),
            packing=False,
            shuffle_seed=0,
            seed=0,
            data_workers=0,
        )
    )
    c.update(kw)
    return c


def pair_ids(batch, r, seg=None):
    """(source ids, target ids) of row r (or of one packed segment), EOS stripped."""
    src, tgt = batch["src"][r], batch["tgt_out"][r]
    if seg is not None:
        src = src[batch["src_segments"][r] == seg]
        tgt = tgt[batch["tgt_segments"][r] == seg]
    src, tgt = src[src != 0], tgt[tgt != 0]
    assert src[-1] == EOS_ID and tgt[-1] == EOS_ID
    return src[:-1].tolist(), tgt[:-1].tolist()


def examples_in(batch):
    """Corpus index of each real pair in the batch (first source word)."""
    out = []
    for r in range(batch["src"].shape[0]):
        segs = [None]
        if "src_segments" in batch:
            segs = [s for s in np.unique(batch["src_segments"][r]) if s]
        for s in segs:
            if s is None and not batch["src"][r].any():
                continue  # filler row
            out.append(pair_ids(batch, r, s)[0][0] - 4)
    return out


def expected_kept(corpus, max_length):
    return {
        i
        for i in range(len(corpus))
        if len(corpus[i][0].split()) < max_length and len(corpus[i][1].split()) < max_length
    }


@pytest.mark.parametrize("packing", [False, True])
def test_every_pair_once_per_epoch_and_budget(packing):
    corpus = make_corpus()
    c = config(packing=packing)
    it = train_iterator(c, TOK, corpus, batch_multiple=4)
    kept = expected_kept(corpus, c.max_length)
    shapes = set()
    for _epoch in range(2):
        seen = []
        for _ in range(it.batches_per_epoch):
            b = next(it)
            S, T = b["src"].shape[1], b["tgt_out"].shape[1]
            B = b["src"].shape[0]
            assert B % 4 == 0
            assert c.batch_tokens >= B * S and c.batch_tokens >= B * T
            assert all(v.dtype == np.int32 and v.shape[0] == B for v in b.values())
            shapes.add(b["src"].shape)
            for i in examples_in(b):
                # The row holds exactly pair i's ids (words -> ids), EOS/BOS in place.
                seen.append(i)
            seen_pairs = examples_in(b)
            for r in range(B):
                if not packing and b["src"][r].any():
                    i = seen_pairs.pop(0)
                    s, t = pair_ids(b, r)
                    assert s == TOK.encode(corpus[i][0]) and t == TOK.encode(corpus[i][1])
                    assert b["tgt_in"][r][0] == BOS_ID
                    n = len(t)
                    np.testing.assert_array_equal(b["tgt_in"][r][1 : n + 1], t)
        assert sorted(seen) == sorted(kept)
    # Bucketed shapes come from the fixed set (8, 16, 32); packing uses one shape.
    assert shapes <= set(it.shapes)
    assert {s[1] for s in it.shapes} == ({32} if packing else {8, 16, 32})
    assert it.stats()["num_dropped"] == len(corpus) - len(kept)


def test_epochs_are_reshuffled():
    it = train_iterator(config(), TOK, make_corpus())
    n = it.batches_per_epoch
    first = [examples_in(next(it)) for _ in range(n)]
    second = [examples_in(next(it)) for _ in range(n)]
    assert first != second
    other = train_iterator(config(shuffle_seed=1), TOK, make_corpus())
    assert [examples_in(next(other)) for _ in range(n)] != first


def test_truncate_keeps_long_pairs():
    corpus = make_corpus(max_words=60)
    it = train_iterator(config(long_pairs="truncate"), TOK, corpus)
    seen = [i for _ in range(it.batches_per_epoch) for i in examples_in(next(it))]
    assert sorted(seen) == list(range(len(corpus)))


def test_padding_fraction_reported_and_bounded():
    for packing, bound in ((False, 0.6), (True, 0.25)):
        it = train_iterator(config(packing=packing), TOK, make_corpus(600))
        real = slots = 0
        for _ in range(it.batches_per_epoch):
            b = next(it)
            real += np.count_nonzero(b["src"]) + np.count_nonzero(b["tgt_out"])
            slots += b["src"].size + b["tgt_out"].size
        frac = it.stats()["padding_fraction"]
        assert frac == pytest.approx(1 - real / slots)
        assert 0 < frac < bound


def test_packed_segments_and_positions():
    corpus = make_corpus()
    it = train_iterator(config(packing=True), TOK, corpus)
    b = next(it)
    B = b["src"].shape[0]
    for r in range(B):
        for side, ids_key in (("src", "src"), ("tgt", "tgt_out")):
            seg, pos = b[f"{side}_segments"][r], b[f"{side}_positions"][r]
            ids = b[ids_key][r]
            np.testing.assert_array_equal(seg == 0, ids == 0)  # padding only where seg 0
            segs = [s for s in np.unique(seg) if s]
            assert segs == list(range(1, len(segs) + 1))
            for s in segs:
                where = np.flatnonzero(seg == s)
                assert (np.diff(where) == 1).all()  # contiguous
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                if side == "tgt":
                    tgt_in = b["tgt_in"][r][where]
                    assert tgt_in[0] == BOS_ID  # restarts at each packed pair
                    np.testing.assert_array_equal(tgt_in[1:], ids[where][:-1])
        for s in [s for s in np.unique(b["src_segments"][r]) if s]:
            src, tgt = pair_ids(b, r, s)
            i = src[0] - 4
            assert src == TOK.encode(corpus[i][0]) and tgt == TOK.encode(corpus[i][1])


@pytest.mark.parametrize("packing", [False, True])
def test_state_round_trip(packing):
    c = config(packing=packing)
    corpus = make_corpus()
    it = train_iterator(c, TOK, corpus)
    # Stop just before an epoch boundary so that resuming crosses it.
    for _ in range(it.batches_per_epoch - 2):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(5)]
    fresh = train_iterator(c, TOK, corpus)
    next(fresh)
    fresh.set_state(state)
    for want in expected:
        got = next(fresh)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    assert fresh.get_state() == it.get_state()
    assert it.stats()["epoch"] == 1


def test_process_shards_disjoint_and_cover():
    corpus = make_corpus(301)
    c = config(long_pairs="truncate")
    seen = []
    for p in range(3):
        it = train_iterator(c, TOK, corpus, process_index=p, process_count=3)
        assert it.budget == c.batch_tokens // 3
        mine = [i for _ in range(it.batches_per_epoch) for i in examples_in(next(it))]
        assert len(mine) == len(set(mine))
        assert all(i % 3 == p for i in mine)  # reads only its own shard
        seen += mine
    assert sorted(seen) == list(range(len(corpus)))


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_batches_every_example_once_in_recoverable_order(process_count):
    corpus = make_corpus(205, max_words=60)  # some longer than max_length: truncated
    c = config()
    found = {}
    for p in range(process_count):
        for batch, index in eval_batches(
            c, TOK, corpus, batch_multiple=2, process_index=p, process_count=process_count
        ):
            assert batch["src"].shape[0] % 2 == 0 and len(index) == batch["src"].shape[0]
            for r, i in enumerate(index):
                if i < 0:
                    assert not batch["src"][r].any()
                    continue
                assert i not in found
                src, tgt = pair_ids(batch, r)
                want_s, want_t = TOK.encode(corpus[i][0]), TOK.encode(corpus[i][1])
                assert src == want_s[: c.max_length - 1] and tgt == want_t[: c.max_length - 1]
                found[i] = r
    assert sorted(found) == list(range(len(corpus)))


def test_to_global_batch_single_device():
    import jax

    mesh = jax.make_mesh((1, 1), ("data", "fsdp"))
    batch = next(train_iterator(config(), TOK, make_corpus()))
    out = to_global_batch(batch, mesh)
    for k in batch:
        np.testing.assert_array_equal(np.asarray(out[k]), batch[k])


_EIGHT_DEVICES = """
import numpy as np, jax
from data import to_global_batch
mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
batch = {"src": np.arange(16 * 8, dtype=np.int32).reshape(16, 8)}
out = to_global_batch(batch, mesh)["src"]
assert out.shape == (16, 8), out.shape
assert len(out.sharding.device_set) == 8
assert {s.data.shape for s in out.addressable_shards} == {(2, 8)}
np.testing.assert_array_equal(np.asarray(out), batch["src"])
print("ok")
"""


def test_to_global_batch_on_eight_fake_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", _EIGHT_DEVICES], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_budget_too_small_is_a_clear_error():
    from data import DataError

    with pytest.raises(DataError, match="batch_tokens"):
        train_iterator(config(batch_tokens=64), TOK, make_corpus(), batch_multiple=4)

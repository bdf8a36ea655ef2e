"""Batching: coverage per epoch, token budget, packing, resume, sharding, eval order."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attention_jax import BOS_ID, EOS_ID
from attention_jax.data import TrainIterator, eval_batches
from attention_jax.data.corpora import ParallelCorpus
from attention_jax.training.mesh import shard_batch
from tests.batching import TOK, config


def make_corpus(n=300, seed=0, max_words=40):
    """Pair i's words encode i, so batches can be mapped back to examples."""
    rng = np.random.default_rng(seed)
    src, tgt = [], []
    for i in range(n):
        ls, lt = rng.integers(1, max_words, size=2)
        src.append(" ".join([str(i)] + [str(rng.integers(0, 900)) for _ in range(ls - 1)]))
        tgt.append(" ".join([str(i)] + [str(rng.integers(0, 900)) for _ in range(lt - 1)]))
    return ParallelCorpus(src, tgt)


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
    it = TrainIterator(c, TOK, corpus, batch_multiple=4)
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
    # Every batch has one of the iterator's fixed shapes: packing one, buckets at most
    # num_length_buckets, the widest holding the longest kept pair (+ EOS) exactly.
    assert shapes <= set(it.shapes)
    widths = [s[1] for s in it.shapes]
    if packing:
        assert widths == [32]
    else:
        longest = max(max(len(corpus[i][0].split()), len(corpus[i][1].split())) for i in kept)
        assert widths == sorted(set(widths)) and widths[-1] == longest + 1
        assert len(widths) <= c.num_length_buckets
    assert it.stats()["num_dropped"] == len(corpus) - len(kept)


def test_epochs_are_reshuffled():
    it = TrainIterator(config(), TOK, make_corpus())
    n = it.batches_per_epoch
    first = [examples_in(next(it)) for _ in range(n)]
    second = [examples_in(next(it)) for _ in range(n)]
    assert first != second
    other = TrainIterator(config(shuffle_seed=1), TOK, make_corpus())
    assert [examples_in(next(other)) for _ in range(n)] != first


def test_truncate_keeps_long_pairs():
    corpus = make_corpus(max_words=60)
    it = TrainIterator(config(long_pairs="truncate"), TOK, corpus)
    seen = [i for _ in range(it.batches_per_epoch) for i in examples_in(next(it))]
    assert sorted(seen) == list(range(len(corpus)))


def test_padding_fraction_reported_and_bounded():
    # The seeded corpus and plan are deterministic: pin what each layout pads.
    for packing, expected in ((False, 0.337), (True, 0.2455)):
        it = TrainIterator(config(packing=packing), TOK, make_corpus(600))
        real = slots = 0
        for _ in range(it.batches_per_epoch):
            b = next(it)
            real += np.count_nonzero(b["src"]) + np.count_nonzero(b["tgt_out"])
            slots += b["src"].size + b["tgt_out"].size
        frac = it.stats()["padding_fraction"]
        assert frac == pytest.approx(1 - real / slots)
        assert 0 < frac == pytest.approx(expected, abs=0.01)


def test_packed_segments_and_positions():
    corpus = make_corpus()
    it = TrainIterator(config(packing=True), TOK, corpus)
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
    it = TrainIterator(c, TOK, corpus)
    # Stop just before an epoch boundary so that resuming crosses it.
    for _ in range(it.batches_per_epoch - 2):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(5)]
    fresh = TrainIterator(c, TOK, corpus)
    next(fresh)
    fresh.set_state(state)
    for want in expected:
        got = next(fresh)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    assert fresh.get_state() == it.get_state()
    assert it.stats()["epoch"] == 1


def test_shards_disjoint_and_cover():
    corpus = make_corpus(301)
    c = config(long_pairs="truncate")
    seen = []
    for p in range(3):
        it = TrainIterator(c, TOK, corpus, shard=p, num_shards=3)
        assert it.budget == c.batch_tokens // 3
        mine = [i for _ in range(it.batches_per_epoch) for i in examples_in(next(it))]
        assert len(mine) == len(set(mine))
        assert all(i % 3 == p for i in mine)  # reads only its own shard
        seen += mine
    assert sorted(seen) == list(range(len(corpus)))


@pytest.mark.parametrize("num_shards", [1, 2])
def test_eval_batches_every_example_once_in_recoverable_order(num_shards):
    corpus = make_corpus(205, max_words=60)  # some longer than max_length: truncated
    c = config()
    found = {}
    for p in range(num_shards):
        for batch, index in eval_batches(
            c, TOK, corpus, batch_multiple=2, shard=p, num_shards=num_shards
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


def test_eval_batches_of_a_few_pairs_are_small_and_agree_across_shards():
    """A bucket's last dev batch has the rows its pairs need (a power of two, a multiple
    of batch_multiple), not a token budget of padding; shards agree on each batch's shape
    (the fullest last batch among those with the most batches)."""
    corpus = make_corpus(9, max_words=30)
    c = config(batch_tokens=4096)
    shapes = [b["src"].shape for b, _ in eval_batches(c, TOK, corpus, batch_multiple=2)]
    assert sum(r for r, _ in shapes) <= 2 * 9 and all(r % 2 == 0 for r, _ in shapes)
    assert max(r for r, _ in shapes) < 4096 // 32
    corpus = make_corpus(300, max_words=40)
    c = config(batch_tokens=1024)
    offers = []  # what each of 3 shards offers to agree on; then the element-wise max
    for p in range(3):
        list(
            eval_batches(
                c, TOK, corpus, shard=p, num_shards=3, agree=lambda x: offers.append(x) or x
            )
        )
    agreed = np.max(offers, axis=0)
    runs, seen = [], []
    for p in range(3):
        out = list(eval_batches(c, TOK, corpus, shard=p, num_shards=3, agree=lambda x: agreed))
        runs.append([b["src"].shape for b, _ in out])
        seen += [int(i) for _, index in out for i in index if i >= 0]
    assert runs[0] == runs[1] == runs[2]
    full = {w: 1024 // 3 // w for _, w in runs[0]}
    assert any(r < full[w] for r, w in runs[0])  # some last batches are cut
    assert sorted(seen) == list(range(300))


def test_shard_batch_single_device():
    import jax

    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
    batch = next(TrainIterator(config(), TOK, make_corpus()))
    out = shard_batch(batch, mesh)
    for k in batch:
        np.testing.assert_array_equal(np.asarray(out[k]), batch[k])


_EIGHT_DEVICES = """
import numpy as np, jax
from attention_jax.training.mesh import shard_batch
from tests.batching import TOK, config
mesh = jax.make_mesh((4, 2, 1), ("data", "fsdp", "tensor"))
batch = {"src": np.arange(16 * 8, dtype=np.int32).reshape(16, 8)}
out = shard_batch(batch, mesh)["src"]
assert out.shape == (16, 8), out.shape
assert len(out.sharding.device_set) == 8
assert {s.data.shape for s in out.addressable_shards} == {(2, 8)}
np.testing.assert_array_equal(np.asarray(out), batch["src"])
print("ok")
"""


def test_shard_batch_on_eight_fake_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", _EIGHT_DEVICES], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


def test_budget_too_small_is_a_clear_error():
    from attention_jax.runtime.errors import UserError

    with pytest.raises(UserError, match="batch_tokens"):
        TrainIterator(config(batch_tokens=64), TOK, make_corpus(), batch_multiple=4)


@pytest.mark.parametrize(("limit_gb", "rss_gb", "releases"), [(0, 9, 0), (1, 0.5, 0), (1, 2, 2)])
def test_the_iterator_unmaps_the_shards_pages_over_the_limit(
    monkeypatch, limit_gb, rss_gb, releases
):
    from attention_jax.data import pipeline

    released = []
    monkeypatch.setattr(pipeline, "RELEASE_EVERY", 3)
    monkeypatch.setattr(pipeline, "mapped_rss", lambda: int(rss_gb * 2**30))
    monkeypatch.setattr(pipeline, "release_pages", lambda tc: released.append(tc))
    it = TrainIterator(config(mapped_cache_gb=limit_gb), TOK, make_corpus())
    for _ in range(7):
        next(it)
    assert len(released) == releases and all(tc is it._tc for tc in released)

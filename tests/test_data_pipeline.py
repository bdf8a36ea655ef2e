"""Batching: coverage per epoch, token budget, packing, resume, sharding, eval order."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import default
from data import TrainIterator, eval_batches
from data.corpora import ParallelCorpus
from model import BOS_ID, EOS_ID
from training.mesh import shard_batch


class WordTokenizer:
    """Deterministic stand-in for SentencePiece: one id per word (>= 4)."""

    vocab_size = 1000

    def encode(self, text):
        return [4 + int(w) for w in text.split()]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    encode_target_batch = encode_batch  # one model for both sides


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
    c = default.get_config()
    c.update(dict(max_length=32, long_pairs="drop", batch_tokens=512, packing=False))
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
    for packing, bound in ((False, 0.6), (True, 0.25)):
        it = TrainIterator(config(packing=packing), TOK, make_corpus(600))
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
from training.mesh import shard_batch
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
    from common.errors import UserError

    with pytest.raises(UserError, match="batch_tokens"):
        TrainIterator(config(batch_tokens=64), TOK, make_corpus(), batch_multiple=4)


# --- Buckets and plans at scale -------------------------------------------------------------


def test_default_buckets_are_fine_and_few():
    from data.plans import length_buckets

    for max_length, count in ((64, 13), (256, 25)):
        b = length_buckets(max_length).tolist()
        assert len(b) == count and b[-1] == max_length and b == sorted(set(b))
        assert b[:11] == list(range(8, 49, 4))
        # From 24 tokens on, each width is at most 1/6 above the one before.
        wide = [x for x in b if x >= 24]
        assert all(y - x <= x / 6 for x, y in itertools.pairwise(wide))
    assert length_buckets(64, (16, 100)).tolist() == [16, 64]


def _slots(lengths, widths, rows):
    """Slots an epoch's bucketed batches use: the independent count fit_buckets minimizes."""
    w = np.asarray(widths)
    n = np.bincount(np.searchsorted(w, lengths), minlength=len(w))
    total = 0
    for k, width in enumerate(w.tolist()):
        r = rows(width)
        total += -(-int(n[k]) // r) * r * width
    return total


def test_fitted_buckets_are_optimal_against_exhaustive_search():
    from data.plans import fit_buckets

    rng = np.random.default_rng(0)
    for _ in range(300):
        top = int(rng.integers(2, 12))
        lengths = rng.integers(1, top + 1, int(rng.integers(1, 40)))
        budget, count = int(rng.integers(top, 4 * top)), int(rng.integers(1, 6))
        rows = lambda w, budget=budget: budget // w
        histogram = np.bincount(lengths, minlength=top + 1)
        widths = fit_buckets(histogram, np.array([1] + [rows(w) for w in range(1, top + 1)]), count)
        longest = int(lengths.max())
        assert len(widths) <= count and widths[-1] == longest
        assert widths.tolist() == sorted(set(widths.tolist()))
        best = min(
            _slots(lengths, [*c, longest], rows)
            for r in range(count)
            for c in itertools.combinations(range(1, longest), r)
        )
        assert _slots(lengths, widths, rows) == best


def test_fitted_buckets_beat_the_rule_and_need_fewer_shapes_on_small_corpora():
    """Fitted widths never pad more than any rule with as many shapes; a small corpus, whose
    partly filled last batches would cost more than finer widths save, gets fewer."""
    from data.pipeline import TrainIterator
    from data.plans import length_buckets

    tc = wmt_like_corpus(20_000, 64)
    for n, budget in ((20_000, 1024), (300, 1024)):
        sub = tc if n == len(tc) else wmt_like_corpus(n, 64, seed=1)
        fitted = TrainIterator(
            config(max_length=64, batch_tokens=budget, num_length_buckets=13),
            None,
            None,
            tokenized=sub,
        )
        rule = TrainIterator(
            config(max_length=64, batch_tokens=budget, length_buckets=tuple(length_buckets(64))),
            None,
            None,
            tokenized=sub,
        )
        assert len(rule.shapes) == 13
        assert fitted.planned_padding_fraction <= rule.planned_padding_fraction
    assert len(fitted.shapes) < 13  # the 300-pair corpus


def wmt_like_corpus(n: int, max_length: int, seed: int = 0):
    """Token lengths like WMT pairs (log-normal source, median 25; target ~1.1x), random ids."""
    from data.tokenized import TokenizedCorpus

    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(np.log(25), 0.6, n), 1, max_length - 1).astype(np.int16)
    tgt = np.clip(np.round(src * rng.normal(1.1, 0.15, n)), 1, max_length - 1).astype(np.int16)
    flat = lambda lens: (
        rng.integers(4, 1000, int(lens.sum())).astype(np.uint16),
        np.concatenate([[0], np.cumsum(lens[:-1], dtype=np.int64)]),
    )
    (sf, ss), (tf, ts) = flat(src), flat(tgt)
    return TokenizedCorpus(sf, ss, src, tf, ts, tgt, np.arange(n, dtype=np.int64))


def test_bucketed_padding_on_wmt_like_lengths():
    """Fitted buckets pad a WMT-like corpus <= 10% with tiny's 13 shapes (powers of two: 28%)."""
    from data.pipeline import TrainIterator

    tc = wmt_like_corpus(200_000, 64)
    c = config(max_length=64, batch_tokens=1024, num_length_buckets=13)
    it = TrainIterator(c, None, None, tokenized=tc)
    assert it.planned_padding_fraction <= 0.10 and len(it.shapes) == 13
    real = slots = 0
    for _ in range(200):
        b = next(it)
        real += np.count_nonzero(b["src"]) + np.count_nonzero(b["tgt_out"])
        slots += b["src"].size + b["tgt_out"].size
    assert 1 - real / slots == pytest.approx(it.planned_padding_fraction, abs=0.03)
    old = TrainIterator(
        config(max_length=64, batch_tokens=1024, length_buckets=(8, 16, 32)),
        None,
        None,
        tokenized=tc,
    )
    assert old.planned_padding_fraction > 0.25


def reference_first_fit(order, src_len, tgt_len, length, window=16):
    """The packer as it was before plans became compact arrays: lists of rows."""
    packed, used = [], []
    for i in order.tolist():
        ls, lt = int(src_len[i]), int(tgt_len[i])
        for r in range(max(0, len(packed) - window), len(packed)):
            us, ut = used[r]
            if us + ls <= length and ut + lt <= length:
                packed[r].append(i)
                used[r] = (us + ls, ut + lt)
                break
        else:
            packed.append([i])
            used.append((ls, lt))
    return packed


def test_packed_plan_equals_the_reference_first_fit(monkeypatch):
    from data import packing

    rng = np.random.default_rng(0)
    src_len = rng.integers(1, 33, 5000)
    tgt_len = rng.integers(1, 33, 5000)
    monkeypatch.setattr(packing, "_PACK_CHUNK", 777)  # the packer's state crosses chunks
    plan = packing.plan_packed(src_len, tgt_len, 32, 8, np.random.default_rng(5))
    order = packing.shuffled(5000, np.random.default_rng(5))
    rows = reference_first_fit(order, src_len, tgt_len, 32)
    assert [r for j in range(len(plan)) for r in plan[j]] == rows
    assert len(plan) == -(-len(rows) // 8)


def test_one_process_reading_two_shards_fits_one_set_of_widths():
    """config.data_shards=2 on one process: both shards batch with the widths fitted to
    their summed lengths (alone they would fit different ones), so every step has one of
    those widths and the 1- and 2-process runs plan the same shapes."""
    from training.input import ShardedInput

    # Even pairs (shard 0) short, odd pairs (shard 1) long.
    words = lambda i, n: " ".join([str(i)] + ["7"] * (n - 1))
    lengths = [3 + i % 5 if i % 2 == 0 else 20 + i % 9 for i in range(400)]
    corpus = ParallelCorpus(
        [words(i, n) for i, n in enumerate(lengths)], [words(i, n) for i, n in enumerate(lengths)]
    )
    c = config(max_length=32, batch_tokens=512, data_shards=2, num_length_buckets=6)
    inputs = ShardedInput(c, TOK, corpus, global_multiple=2)
    shared = [[s[1] for s in it.shapes] for it in inputs.iterators]
    assert shared[0] == shared[1] and len(shared[0]) <= 6
    # ... and on the batches per bucket, so their epochs (and batch orders) line up.
    a, b = inputs.iterators
    assert a.batches_per_epoch == b.batches_per_epoch
    assert (a.bucket_batch_counts() != b.bucket_batch_counts()).any()
    alone = [
        [s[1] for s in TrainIterator(c, TOK, corpus, shard=s, num_shards=2).shapes] for s in (0, 1)
    ]
    assert alone[0] != alone[1] and max(alone[0]) < min(alone[1])
    for _ in range(20):
        assert next(inputs)["src"].shape[1] in shared[0]


def test_carry_over_leaves_one_partial_batch_and_never_narrows_a_pair():
    """Leftover pairs of a bucket move to wider buckets: every pair still appears once, in a
    bucket at least as wide as its own, and only the widest bucket has a partial batch."""
    from data.plans import bucket_of, plan_bucketed

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 33, 5000)
    widths = np.array([8, 12, 16, 24, 32])
    rows = [64, 42, 32, 21, 16]
    own = bucket_of(widths, lengths)
    plan = plan_bucketed(None, own, rows, np.random.default_rng(0), carry_over=True)
    seen = np.concatenate([m for _, m in plan])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    partial = [k for k, m in plan if len(m) < rows[k]]
    assert partial in ([], [len(widths) - 1])
    for k, m in plan:
        assert (widths[k] >= lengths[m]).all()
    # Without carry-over every bucket may end in a partial batch; with it there are fewer slots.
    plain = plan_bucketed(None, own, rows, np.random.default_rng(0))
    slots = lambda p: sum(rows[k] * widths[k] for k, _ in p)
    assert slots(plan) < slots(plain)


@pytest.mark.parametrize(("limit_gb", "rss_gb", "releases"), [(0, 9, 0), (1, 0.5, 0), (1, 2, 2)])
def test_the_iterator_unmaps_the_shards_pages_over_the_limit(
    monkeypatch, limit_gb, rss_gb, releases
):
    from data import pipeline

    released = []
    monkeypatch.setattr(pipeline, "RELEASE_EVERY", 3)
    monkeypatch.setattr(pipeline, "mapped_rss", lambda: int(rss_gb * 2**30))
    monkeypatch.setattr(pipeline, "release_pages", lambda tc: released.append(tc))
    it = TrainIterator(config(mapped_cache_gb=limit_gb), TOK, make_corpus())
    for _ in range(7):
        next(it)
    assert len(released) == releases and all(tc is it._tc for tc in released)


def _packed_reference(tc, rows, num_rows, length):
    """One pair at a time: ids (cut to length - 1), EOS / BOS, segments 1.., positions."""
    keys = ["src", "tgt_in", "tgt_out", "src_segments", "tgt_segments"]
    out = {k: np.zeros((num_rows, length), np.int32) for k in [*keys, "src_positions",
                                                               "tgt_positions"]}  # fmt: skip
    for r, members in enumerate(rows):
        ps = pt = 0
        for seg, i in enumerate(members, start=1):
            s = list(tc.src_flat[tc.src_start[i] :][: min(tc.src_len[i], length - 1)])
            t = list(tc.tgt_flat[tc.tgt_start[i] :][: min(tc.tgt_len[i], length - 1)])
            for k, v in (("src", [*s, EOS_ID]), ("tgt_in", [BOS_ID, *t])):
                out[k][r, (ps if k == "src" else pt) :][: len(v)] = v
            out["tgt_out"][r, pt : pt + len(t) + 1] = [*t, EOS_ID]
            for side, at, n in (("src", ps, len(s) + 1), ("tgt", pt, len(t) + 1)):
                out[f"{side}_segments"][r, at : at + n] = seg
                out[f"{side}_positions"][r, at : at + n] = range(n)
            ps, pt = ps + len(s) + 1, pt + len(t) + 1
    return out


@pytest.mark.parametrize("length", [4, 16, 64])
def test_packed_batch_equals_one_pair_at_a_time(length):
    """assemble_packed's index arithmetic against a loop over pairs: long pairs cut to
    length - 1 ids, empty sides, empty rows (at the start, middle and end)."""
    from types import SimpleNamespace

    from data.batches import assemble_packed

    rng = np.random.default_rng(length)
    n = 300
    src_len, tgt_len = rng.integers(0, length // 3 + 1, (2, n))
    src_len[::7], tgt_len[3::7] = 2 * length, 2 * length  # cut to length - 1 ids
    starts = lambda x: np.concatenate([[0], np.cumsum(x)[:-1]])
    tc = SimpleNamespace(
        src_flat=rng.integers(4, 99, src_len.sum()).astype(np.int32),
        tgt_flat=rng.integers(4, 99, tgt_len.sum()).astype(np.int32),
        src_start=starts(src_len), tgt_start=starts(tgt_len), src_len=src_len, tgt_len=tgt_len,
    )  # fmt: skip
    order, rows, k = rng.permutation(n), [[]], 0
    for _ in range(9):
        row, ps, pt = [], 0, 0
        while k < n:
            i = int(order[k])
            ls, lt = min(src_len[i], length - 1) + 1, min(tgt_len[i], length - 1) + 1
            if ps + ls > length or pt + lt > length:
                break
            row, ps, pt, k = [*row, i], ps + ls, pt + lt, k + 1
        rows.append(row)
    rows.insert(5, [])
    got = assemble_packed(tc, rows, len(rows) + 1, length)  # and a last, empty row
    want = _packed_reference(tc, rows, len(rows) + 1, length)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert sum(map(len, rows)) > 9  # pairs were packed together


def test_packed_batch_of_empty_sides_at_the_ends_of_the_cache():
    """Pairs whose side has no ids, first and last in the cache (start 0 and start =
    the flat array's length), and a cache whose target side holds no ids at all."""
    from types import SimpleNamespace

    from data.batches import assemble_packed

    src_len, tgt_len = np.array([0, 3, 2, 0]), np.array([0, 0, 0, 0])
    tc = SimpleNamespace(
        src_flat=np.arange(10, 15, dtype=np.int32), tgt_flat=np.zeros(0, np.int32),
        src_start=np.array([0, 0, 3, 5]), tgt_start=np.zeros(4, np.int64),
        src_len=src_len, tgt_len=tgt_len,
    )  # fmt: skip
    rows = [[0, 3], [1, 2], []]
    got = assemble_packed(tc, rows, 3, 8)
    want = _packed_reference(tc, rows, 3, 8)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    np.testing.assert_array_equal(got["src"][1, :7], [10, 11, 12, EOS_ID, 13, 14, EOS_ID])

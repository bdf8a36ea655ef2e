"""Length buckets and batch plans at scale (fitted widths against exhaustive search, WMT-like
padding, first-fit packing, carry-over, two shards on one process) and packed batches
against a one-pair-at-a-time reference."""

import itertools

import numpy as np
import pytest

from attention_jax import BOS_ID, EOS_ID
from attention_jax.data import TrainIterator
from attention_jax.data.corpora import ParallelCorpus
from tests.batching import TOK, config


def test_default_buckets_are_fine_and_few():
    from attention_jax.data.plans import length_buckets

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
    from attention_jax.data.plans import fit_buckets

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
    from attention_jax.data.pipeline import TrainIterator
    from attention_jax.data.plans import length_buckets

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
    from attention_jax.data.tokenized import TokenizedCorpus

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
    """Fitted buckets pad a WMT-like corpus 9.6% with tiny's 13 shapes, no more than the
    rule's 13 widths (9.9%); powers of two pad 28%."""
    from attention_jax.data.pipeline import TrainIterator
    from attention_jax.data.plans import length_buckets

    tc = wmt_like_corpus(200_000, 64)
    c = config(max_length=64, batch_tokens=1024, num_length_buckets=13)
    it = TrainIterator(c, None, None, tokenized=tc)
    rule = TrainIterator(
        config(max_length=64, batch_tokens=1024, length_buckets=tuple(length_buckets(64))),
        None,
        None,
        tokenized=tc,
    )
    assert len(it.shapes) == 13 and len(rule.shapes) == 13
    assert it.planned_padding_fraction <= rule.planned_padding_fraction
    # The seeded corpus is deterministic: pin what the fitted widths pad.
    assert it.planned_padding_fraction == pytest.approx(0.0958, abs=0.005)
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
    assert old.planned_padding_fraction > 2 * it.planned_padding_fraction


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
    from attention_jax.data import packing

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
    from attention_jax.training.input import ShardedInput

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
    from attention_jax.data.plans import bucket_of, plan_bucketed

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

    from attention_jax.data.batches import assemble_packed

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

    from attention_jax.data.batches import assemble_packed

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

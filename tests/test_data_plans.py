"""Epoch plans: the streamed planners equal the planners before them (copied below as the
references)."""

import numpy as np
import pytest

from data import packing, plans

# --- The planners as they were before plans were streamed (commit f79a519) --------------


def old_first_fit(src_len, tgt_len, length, state, window=16):
    used_s, used_t, ids, num_rows = state
    out = [0] * len(src_len)
    for k, (ls, lt) in enumerate(zip(src_len, tgt_len, strict=True)):
        for w in range(len(ids)):
            if used_s[w] + ls <= length and used_t[w] + lt <= length:
                used_s[w] += ls
                used_t[w] += lt
                out[k] = ids[w]
                break
        else:
            used_s.append(ls)
            used_t.append(lt)
            ids.append(num_rows)
            out[k] = num_rows
            num_rows += 1
            if len(ids) > window:
                del used_s[0], used_t[0], ids[0]
    state[3] = num_rows
    return out


def old_plan_packed(src_len, tgt_len, length, rows, rng, chunk=1 << 20):
    """(members, row_start, num_batches): first fit over the whole epoch, then one argsort."""
    order = np.arange(len(src_len), dtype=np.int32)
    rng.shuffle(order)
    row_of = np.empty(len(order), np.int32)
    state = [[], [], [], 0]
    for lo in range(0, len(order), chunk):
        idx = order[lo : lo + chunk]
        row_of[lo : lo + len(idx)] = old_first_fit(
            src_len[idx].tolist(), tgt_len[idx].tolist(), length, state
        )
    num_rows = state[3]
    members = order[np.argsort(row_of, kind="stable")]
    row_start = np.zeros(num_rows + 1, np.int64)
    np.cumsum(np.bincount(row_of, minlength=num_rows), out=row_start[1:])
    return members, row_start, -(-num_rows // rows)


def old_plan_bucketed(lengths, bucket_of, rows, rng, carry_over=False, min_counts=None):
    """(bucket, start, stop, members) in one function."""
    n, num_buckets = len(bucket_of), len(rows)
    rows_k = np.asarray(rows, np.int64)
    batched = np.bincount(bucket_of, minlength=num_buckets).astype(np.int64)
    if carry_over:
        carried = 0
        for k in range(num_buckets - 1):
            total = carried + batched[k]
            batched[k], carried = total // rows_k[k] * rows_k[k], total % rows_k[k]
        batched[-1] += carried
    sizes, counts = batched, -(-batched // rows_k)
    members = np.empty(n, np.int32)
    carried, pos = members[:0], 0
    for k in range(num_buckets):
        m = np.concatenate([carried, np.flatnonzero(bucket_of == k).astype(members.dtype)])
        if rng is not None:
            rng.shuffle(m)
        else:
            m = m[np.argsort(lengths[m], kind="stable")]
        members[pos : pos + sizes[k]] = m[: sizes[k]]
        carried, pos = m[sizes[k] :], pos + sizes[k]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if min_counts is not None:
        counts = np.maximum(counts, min_counts)
    bucket = np.repeat(np.arange(len(rows_k)), counts)
    j = np.arange(len(bucket)) - np.repeat(np.cumsum(counts) - counts, counts)
    start = offsets[bucket] + np.minimum(j * rows_k[bucket], sizes[bucket])
    stop = offsets[bucket] + np.minimum((j + 1) * rows_k[bucket], sizes[bucket])
    return bucket, start, stop, members


def random_lengths(n, length, seed):
    """Lengths with EOS in [1, length], many short and some exactly `length` (full rows)."""
    rng = np.random.default_rng(seed)
    src = np.minimum(rng.geometric(0.08, n), length)
    tgt = np.clip(src + rng.integers(-3, 4, n), 1, length)
    return src.astype(np.int16), tgt.astype(np.int16)


@pytest.mark.parametrize("chunk", [1, 5, 16, 17, 777, 1 << 20])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_plan_equals_the_plan_before_streaming(monkeypatch, chunk, seed):
    """Rows come out chunk by chunk once closed: the same members, rows and batches as the
    whole-epoch first fit and argsort, whichever chunk boundaries (the open rows and their
    pairs cross them)."""
    src, tgt = random_lengths(3000, 32, seed)
    monkeypatch.setattr(packing, "_PACK_CHUNK", chunk)
    plan = packing.plan_packed(src, tgt, 32, 8, np.random.default_rng(seed + 5))
    members, row_start, num_batches = old_plan_packed(
        src, tgt, 32, 8, np.random.default_rng(seed + 5), chunk=max(chunk, 100)
    )
    np.testing.assert_array_equal(plan.members, members)
    assert plan.members.dtype == members.dtype == np.int32
    np.testing.assert_array_equal(plan.row_start, row_start)
    assert len(plan) == num_batches


@pytest.mark.parametrize("carry_over", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_bucketed_plan_equals_the_plan_before_streaming(carry_over, shuffle):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 64, 5000)
    widths = plans.length_buckets(64, (8, 16, 24, 40))
    own = plans.bucket_of(widths, lengths)
    rows = [64, 32, 21, 12, 8]
    min_counts = np.array([0, 50, 0, 0, 30])
    for mc in (None, min_counts):
        new = plans.plan_bucketed(
            lengths, own, rows, np.random.default_rng(9) if shuffle else None, carry_over, mc
        )
        old = old_plan_bucketed(
            lengths, own, rows, np.random.default_rng(9) if shuffle else None, carry_over, mc
        )
        for a, b in zip((new.bucket, new.start, new.stop, new.members), old, strict=True):
            np.testing.assert_array_equal(a, b)

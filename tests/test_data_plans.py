"""Epoch plans: the streamed planners equal the planners before them (copied below as the
references), stored plans equal in-memory ones and are mapped back at a restart, earlier
epochs are deleted, damage and an unwritable store fall back, the next epoch is prepared
ahead, and a restarted iterator plans only the epoch it resumes in."""

import dataclasses
import logging
import os

import numpy as np
import pytest

from attention_jax.configs import default
from attention_jax.data import TrainIterator, files, packing, plan_cache, plans
from attention_jax.data.corpora import ParallelCorpus
from attention_jax.data.plan_cache import EpochPlans, PlanSpec
from attention_jax.data.tokenized import TokenizedCorpus

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


# --- The store ---------------------------------------------------------------------------------


def lengths_shard(n, length, seed, directory=None):
    """A TokenizedCorpus with only lengths that mean anything (the plans read nothing else)."""
    src, tgt = random_lengths(n, length, seed)
    src, tgt = src - 1, tgt - 1  # stored without EOS
    zeros = np.zeros(0, np.uint16)
    starts = np.zeros(n, np.int64)
    return TokenizedCorpus(
        zeros, starts, src, zeros, starts, tgt, np.arange(n), directory=directory
    )


def spec(packed, length=32):
    if packed:
        return PlanSpec(True, 0, 0, length, (8,), (length,))
    return PlanSpec(False, 0, 0, length, (64, 32, 16, 8), (8, 16, 24, length))


def same_plan(a, b):
    if isinstance(a, packing.PackedPlan):
        np.testing.assert_array_equal(a.members, b.members)
        np.testing.assert_array_equal(a.row_start, b.row_start)
        assert len(a) == len(b) and a.rows_per_batch == b.rows_per_batch
    else:
        np.testing.assert_array_equal(a, b)


def plan_dirs(root):
    return sorted(e for e in os.listdir(os.path.join(root, "plans")) if not e.startswith("."))


@pytest.mark.parametrize("packed", [True, False])
def test_stored_plans_equal_in_memory_ones_and_are_mapped_back(tmp_path, packed, monkeypatch):
    monkeypatch.setattr(packing, "_PACK_CHUNK", 333)  # stored in several pieces
    stored = EpochPlans(lengths_shard(4000, 32, 0, str(tmp_path)), spec(packed))
    memory = EpochPlans(lengths_shard(4000, 32, 0), spec(packed))
    for epoch in range(3):
        plan = stored.get(epoch)
        assert stored.last_source.startswith("planned and stored")
        same_plan(plan, memory.get(epoch))
        assert memory.last_source.startswith("planned in memory")
    # Earlier epochs are deleted when a later one is used.
    assert plan_dirs(tmp_path) == [f"{stored.family}-e000002"]
    restarted = EpochPlans(lengths_shard(4000, 32, 0, str(tmp_path)), spec(packed))
    plan = restarted.get(2)
    assert restarted.last_source.startswith("mapped from")
    members = plan.members if packed else plan
    assert isinstance(members, np.memmap)
    same_plan(plan, memory.get(2))
    # Another seed is another family: its own plans, the first family's left alone.
    reseeded = dataclasses.replace(spec(packed), seed=1)
    other = EpochPlans(lengths_shard(4000, 32, 0, str(tmp_path)), reseeded)
    other.get(2)
    assert len(plan_dirs(tmp_path)) == 2 and other.family != stored.family


def test_a_damaged_or_foreign_stored_plan_is_made_again(tmp_path, caplog):
    tc = lengths_shard(3000, 32, 1, str(tmp_path))
    first = EpochPlans(tc, spec(True))
    mapped = first.get(0)
    # In memory: truncating a mapped file under its map would end the process (SIGBUS).
    expected = packing.PackedPlan(
        np.array(mapped.members), np.array(mapped.row_start), 8, mapped.num_batches
    )
    del mapped
    path = os.path.join(tmp_path, "plans", plan_dirs(tmp_path)[0])
    with open(os.path.join(path, "members.bin"), "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        again = EpochPlans(tc, spec(True))
        plan = again.get(0)
    assert "damaged" in caplog.text and again.last_source.startswith("planned and stored")
    same_plan(plan, expected)
    # A manifest for another key (edited by hand): not used, made again in place.
    manifest = files.read_manifest(path)
    manifest["key"]["seed"] = 7
    files.write_manifest(path, manifest)
    third = EpochPlans(tc, spec(True))
    same_plan(third.get(0), expected)
    assert third.last_source.startswith("planned and stored")


def test_a_failed_or_killed_build_leaves_nothing_that_is_read(tmp_path, monkeypatch):
    tc = lengths_shard(3000, 32, 2, str(tmp_path))
    real = plan_cache._write_bucketed

    def dies(*args):
        real(*args)
        raise KeyboardInterrupt  # after the files, before the manifest

    monkeypatch.setattr(plan_cache, "_write_bucketed", dies)
    with pytest.raises(KeyboardInterrupt):
        EpochPlans(tc, spec(False)).get(0)
    assert os.listdir(os.path.join(tmp_path, "plans")) == []
    monkeypatch.setattr(plan_cache, "_write_bucketed", real)
    # A SIGKILLed build's temporary directory (a dead pid) is deleted by the next build.
    plans_dir = EpochPlans(tc, spec(False))
    dead = files.temp_dir(plans_dir._path(0))
    os.rename(dead, dead.replace(f"-{os.getpid()}-", "-999999999-"))
    plan = plans_dir.get(0)
    assert os.listdir(os.path.join(tmp_path, "plans")) == [f"{plans_dir.family}-e000000"]
    same_plan(plan, EpochPlans(lengths_shard(3000, 32, 2), spec(False)).get(0))


def test_an_unwritable_store_plans_in_memory(tmp_path, caplog):
    with open(tmp_path / "plans", "w") as f:  # where the directory would go: not writable
        f.write("")
    tc = lengths_shard(2000, 32, 3, str(tmp_path))
    store = EpochPlans(tc, spec(True))
    with caplog.at_level(logging.WARNING):
        plan = store.get(0)
    assert "cannot store the epoch plan" in caplog.text
    assert store.last_source.startswith("planned in memory")
    same_plan(plan, EpochPlans(lengths_shard(2000, 32, 3), spec(True)).get(0))


@pytest.mark.parametrize("packed", [True, False])
def test_the_next_epoch_is_prepared_ahead(tmp_path, packed):
    store = EpochPlans(lengths_shard(3000, 32, 4, str(tmp_path)), spec(packed))
    store.get(0)
    store.prefetch(1)
    store.prefetch(1)  # once
    plan = store.get(1)
    assert store.last_source.startswith("prepared ahead")
    same_plan(plan, EpochPlans(lengths_shard(3000, 32, 4), spec(packed)).get(1))
    assert plan_dirs(tmp_path) == [f"{store.family}-e000001"]


# --- The iterator ------------------------------------------------------------------------------


class WordTokenizer:
    """One id per word; a fingerprint, so that the shard is cached (and plans stored)."""

    vocab_size = 1000
    fingerprint = "words-v1"
    proto = None

    def encode_batch(self, texts):
        return [[4 + int(w) for w in t.split()] for t in texts]

    encode_target_batch = encode_batch  # one model for both sides


def corpus(n=600, seed=0):
    rng = np.random.default_rng(seed)
    words = lambda i: " ".join([str(i)] + ["7"] * int(rng.integers(0, 20)))
    return ParallelCorpus([words(i) for i in range(n)], [words(i) for i in range(n)])


@pytest.mark.parametrize("packed", [True, False])
def test_a_restart_maps_the_saved_epochs_plan_and_plans_no_other(tmp_path, packed, monkeypatch):
    c = default.get_config()
    c.update(dict(max_length=32, batch_tokens=256, packing=packed, num_length_buckets=4))
    data, tok, cache = corpus(), WordTokenizer(), str(tmp_path / "cache")
    run = TrainIterator(c, tok, data, cache_dir=cache)
    n = run.batches_per_epoch
    for _ in range(2 * n + 3):  # into epoch 2, past epoch boundaries (prepared ahead)
        next(run)
    assert run._plans.last_source.startswith("prepared ahead")
    state = run.get_state()
    expected = [next(run) for _ in range(n)]  # on into epoch 3
    made = []
    real = EpochPlans._plan
    monkeypatch.setattr(EpochPlans, "_plan", lambda self, e: made.append(e) or real(self, e))
    again = TrainIterator(c, tok, data, cache_dir=cache)
    again.set_state(state)
    got = [next(again) for _ in range(n)]
    assert made[0] == 2 and 0 not in made and 1 not in made
    assert again._plans.last_source.startswith("prepared ahead")  # epoch 3, made ahead
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    plain = TrainIterator(c, tok, data)  # no cache: planned in memory, the same batches
    plain.set_state(state)
    for b in expected[:5]:
        np.testing.assert_array_equal(next(plain)["src"], b["src"])


@pytest.mark.parametrize("packed", [True, False])
def test_making_a_stored_plan_holds_a_few_bytes_per_pair(tmp_path, packed, monkeypatch):
    """The plan goes to its file as it is made: the permutation (4 bytes per pair), the
    lengths to pack (4) or the buckets (1), and chunk-sized temporaries, never the plan
    or an int64 array over all pairs (numpy reports its arrays to tracemalloc)."""
    import tracemalloc

    monkeypatch.setattr(packing, "_PACK_CHUNK", 1 << 14)
    widths = (64,) if packed else (8, 16, 24, 32, 40, 48, 56, 64)
    rows = tuple(1024 // w for w in widths)

    def peak(n):
        directory = tmp_path / str(n)
        directory.mkdir()
        tc = lengths_shard(n, 64, 0, str(directory))
        tracemalloc.start()
        try:
            EpochPlans(tc, PlanSpec(packed, 0, 0, 64, rows, widths)).get(0)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # The chunk-sized temporaries cost the same at any n, so the bytes each extra pair
    # adds are what is held over all pairs: 8 packed, 9 bucketed (deterministic). One
    # more int32 array over all pairs would add 4; before, the permutation, each pair's
    # row (int32), their argsort (int64) and the plan (4 + 4 + 8 + 4 + 8 per row) held
    # ~25 bytes per pair for a packed plan in memory.
    n = 100_000
    small, large = peak(n), peak(4 * n)
    per_pair = (large - small) / (3 * n)
    assert per_pair <= 9.5, (small, large, per_pair)

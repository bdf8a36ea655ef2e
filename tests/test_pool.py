"""search/pool.py: sources that take over finished ones' slots get the results of a batch
searched whole (search/decoding.py, itself checked against a textbook beam search)."""

import concurrent.futures
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import Ensemble
from attention_jax.search import decoding, pool
from attention_jax.search.constraints import Controls
from attention_jax.search.scoring import FILLER
from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import LiveSearch
from tests.conftest import search_rule
from tests.models import make, ragged_src

LENGTHS = [5, 3, 7, 2, 6, 4, 7, 1, 5, 3]  # ten sources of width 7


@pytest.fixture(scope="module")
def model():
    return make()  # a sharp output distribution: no near-ties


def with_fillers(src, count):
    """src [N, S] with `count` filler rows after it (finished before any step)."""
    filler = jnp.zeros((count, src.shape[1]), jnp.int32).at[:, : len(FILLER)].set(FILLER)
    return jnp.concatenate([src, filler])


def whole_and_pooled(model, src, slots, rule, alpha=0.6, controls=None, max_decode_len=None):
    length, extra = decoding.decode_shape(model, src, max_decode_len)
    controls = Controls.none(src.shape[0]) if controls is None else controls
    args = dict(alpha=alpha, rule=rule, length=length, extra=extra, controls=controls)
    whole = decoding.search_batch(model, src, counted=True, **args)
    pooled = pool.pool_search(model, src, slots=slots, **args)
    return whole, pooled, length


@pytest.mark.parametrize("stop", ["bound", "heuristic", "count"])
def test_pooled_searches_equal_the_whole_batchs(model, stop):
    src = with_fillers(ragged_src(3, LENGTHS), 2)
    rule = search_rule(3, stop=stop, length_penalty="average" if stop == "count" else "gnmt")
    whole, pooled, length = whole_and_pooled(model, src, 3, rule)
    tokens, scores, met, steps, took = pooled
    np.testing.assert_array_equal(tokens[:10], whole[0][:10])  # a filler's results are no one's
    np.testing.assert_allclose(scores[:10], whole[1][:10], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(met[:10], whole[2][:10])
    assert np.all(np.isneginf(np.asarray(scores[10:])))
    # Each source took the steps it takes in the whole batch (a filler none), and the
    # slots turned over: more steps than the room, so the ring wrapped.
    np.testing.assert_array_equal(took, np.where(np.arange(12) < 10, whole[4], 0))
    assert int(steps) > length
    # Three slots of the queue's ten real sources: the steps run are about those needed,
    # not the slowest source's for each of three batches.
    assert 3 * int(steps) <= np.sum(took) + 3 * max(took)


def test_prefixes_and_phrases_follow_their_source_into_its_slot(model):
    src = ragged_src(4, LENGTHS[:6])
    prefixes = [[5, 6], [], [7], [], [8, 9], []]
    phrases = [[[4]], [], [[10, 11]], [[6]], [], [[9]]]
    controls = Controls.fitted(prefixes, phrases, rows=6)
    whole, pooled, _ = whole_and_pooled(model, src, 2, search_rule(3), controls=controls)
    np.testing.assert_array_equal(pooled[0], whole[0])
    np.testing.assert_allclose(pooled[1], whole[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pooled[2], whole[2])
    for b, prefix in enumerate(prefixes):
        assert list(np.asarray(pooled[0][b, 0, : len(prefix)])) == prefix


def test_an_ensembles_slots_take_over_each_members_cache():
    ensemble = Ensemble([make(0), make(1)])
    src = with_fillers(ragged_src(6, LENGTHS[:7]), 1)
    whole, pooled, _ = whole_and_pooled(ensemble, src, 2, search_rule(2))
    np.testing.assert_array_equal(pooled[0][:7], whole[0][:7])
    np.testing.assert_allclose(pooled[1][:7], whole[1][:7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("members", [1, 2])
def test_an_output_layer_made_once_is_the_one_every_search_reads(model, members):
    searched = model if members == 1 else Ensemble([make(0), make(1)])
    src = with_fillers(ragged_src(3, LENGTHS[:5]), 1)
    length, extra = decoding.decode_shape(searched, src, None)
    args = dict(alpha=0.6, rule=search_rule(2), slots=2, length=length, extra=extra)
    output = pool.decode_output(searched)
    tied = [m.tgt_embed.embedding[...] for m in getattr(searched, "members", [searched])]
    for made, embedding in zip(jax.tree.leaves(output), tied, strict=True):
        np.testing.assert_array_equal(made, np.asarray(embedding).T)  # [V, D] -> [D, V]
    inside = pool.pool_search(searched, src, **args)
    given = pool.pool_search(searched, src, output=output, **args)
    for a, b in zip(inside, given, strict=True):
        np.testing.assert_array_equal(a, b)
    # ... and the search reads it: another output layer gives other scores
    other = pool.pool_search(searched, src, output=jax.tree.map(lambda x: -x, output), **args)
    assert not np.allclose(other[1][:5], inside[1][:5])


@pytest.mark.parametrize("members", [1, 2])
def test_a_program_prepared_from_shapes_gets_the_output_layers_shape_traced(
    model, members, monkeypatch
):
    """Prepared beside running searches, it calls no jitted function on the model's
    concrete arrays inside a trace (threads doing so at once can crash jaxlib)."""
    searched = model if members == 1 else Ensemble([make(0), make(1)])
    want = jax.tree.map(lambda x: (x.shape, x.dtype), pool.decode_output(searched))

    def refuse(*_, **__):
        raise AssertionError("the output layer was made, not traced")

    monkeypatch.setattr(pool, "_decode_output", refuse)
    got = pool.decode_output_shape(searched)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == want
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(got))
    prepared = []  # what LiveSearch.pooled hands a program prepared from shapes
    search = LiveSearch(searched, SearchSettings(beam_size=2))
    src = jax.ShapeDtypeStruct((4, 7), jnp.int32)
    search.pooled(src, 2, call=lambda fn, graphdef, args, static: prepared.append(args))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), prepared[0][-1]) == want


def test_the_streams_asking_at_once_share_one_output_layer(model, monkeypatch):
    made = []

    def slow_decode_output(parts):
        made.append(parts)
        time.sleep(0.05)  # the other streams ask meanwhile
        return object()

    monkeypatch.setattr(pool, "decode_output", slow_decode_output)
    search = LiveSearch(model, SearchSettings(beam_size=2))
    start = threading.Barrier(4)

    def ask():
        start.wait()
        return search.output

    with concurrent.futures.ThreadPoolExecutor(4) as streams:
        outputs = list(streams.map(lambda _: ask(), range(4)))
    assert len(made) == 1 and all(o is outputs[0] for o in outputs)


@pytest.mark.slow  # ~25 s: 150 rounds, each compiling the output layer afresh
def test_programs_prepared_while_a_stream_makes_the_output_layer_never_crash(model):
    """Threads preparing pooled programs from shapes while a stream makes the output
    layer, each round on emptied jit caches, as at a job's start. Traces that called the
    jitted output layer on the model's concrete arrays crashed jaxlib within a few dozen
    rounds (a segfault comparing the calls' static arguments)."""
    src = jax.ShapeDtypeStruct((4, 7), jnp.int32)
    tied = np.asarray(model.tgt_embed.embedding[...]).T  # [V, D] -> [D, V]
    handed = []

    def prepare():
        for _ in range(3):
            search = LiveSearch(model, SearchSettings(beam_size=2))
            search.pooled(src, 2, call=lambda fn, graphdef, args, static: handed.append(args))

    for _ in range(150):
        jax.clear_caches()
        search = LiveSearch(model, SearchSettings(beam_size=2))
        with concurrent.futures.ThreadPoolExecutor(5) as threads:
            preparing = [threads.submit(prepare) for _ in range(4)]
            made = threads.submit(getattr, search, "output")
        for f in preparing:
            f.result()  # raises what a thread raised
        np.testing.assert_array_equal(made.result(), tied)
    assert len(handed) == 150 * 4 * 3
    assert all(isinstance(args[-1], jax.ShapeDtypeStruct) for args in handed)


def test_more_slots_than_real_sources_leaves_the_rest_empty(model):
    src = with_fillers(ragged_src(5, [4, 6]), 3)  # two real sources, three slots
    whole, pooled, _ = whole_and_pooled(model, src, 3, search_rule(2), max_decode_len=9)
    np.testing.assert_array_equal(pooled[0][:2], whole[0][:2])
    assert np.all(np.isneginf(np.asarray(pooled[1][2:])))
    assert list(np.asarray(pooled[4][2:])) == [0, 0, 0]


def test_more_slots_than_sources_is_refused(model):
    with pytest.raises(ValueError, match="slots must be in"):
        pool.pool_search(model, ragged_src(0, [3]), alpha=0.6, rule=search_rule(2), slots=2,
                         length=9, extra=None)  # fmt: skip

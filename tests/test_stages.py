"""Staged beam search (model/beam.py, search/stages.py) against the search in one program.

A source's results must not depend on the stage or batch it finishes in, nor on
stopping it as soon as the hypotheses asked for are final.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import EOS_ID, beam, carry, decoding
from search import stages
from search.settings import SearchSettings
from search.translate import search_fn, translate_ids
from tests.test_decoding import make, ragged_src


@pytest.fixture(scope="module")
def model():
    # Wider vocabulary and a longer reach than test_decoding's, so that sources need
    # several stages and some stop early.
    return make(seed=3, vocab_size=40, max_len=96)


def sources_of(lengths, seed=0, vocab=40):
    rng = np.random.default_rng(seed)
    return [[*rng.integers(4, vocab, size=n - 1).tolist(), EOS_ID] for n in lengths]


def test_two_level_top_k_equals_lax_top_k_with_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(-6, 3, size=(5, 3000)).astype(np.float32)  # many exact ties
    x[:, rng.integers(0, 3000, 400)] = -np.inf
    x[0] = -np.inf  # every entry tied
    x[1, :2000] = -np.inf  # the best ones late in the row
    for k in (1, 8, 16):
        want = jax.lax.top_k(jnp.asarray(x), k)
        got = beam.top_k(jnp.asarray(x), k, chunk=64)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_stage_rooms_grow_to_every_sources_limit():
    assert stages.stage_rooms(8, 256) == [24, 48, 58]
    assert stages.stage_rooms(16, 64) == [32, 64]
    assert stages.stage_rooms(64, 64) == [64]


@pytest.mark.parametrize(
    ("beam_size", "n_best", "min_rows", "batch_tokens", "stop"),
    [
        (4, 1, 8, 64, "bound"),
        # 25-40 s each on 2 cores: one case of each beam size, rows and rule in make
        # test, the others in make test-slow.
        pytest.param(3, 3, 8, 64, "bound", marks=pytest.mark.slow),
        pytest.param(1, 1, 8, 64, "bound", marks=pytest.mark.slow),
        pytest.param(4, 1, 1, 512, "bound", marks=pytest.mark.slow),
        pytest.param(3, 3, 1, 512, "bound", marks=pytest.mark.slow),
        (1, 1, 1, 96, "bound"),
        # (Beam 1 is greedy search whatever the rule: SearchSettings.rule.)
        (3, 3, 8, 64, "heuristic"),
        pytest.param(4, 1, 1, 512, "heuristic", marks=pytest.mark.slow),
    ],
)
def test_staged_translation_equals_one_program(
    model, monkeypatch, beam_size, n_best, min_rows, batch_tokens, stop
):
    shrunk, carried = [], []  # batches that went on in fewer rows; with more room
    real_finish, real_carried = stages._Stages.finish, stages._Stages.carried_batches

    def finish(self, job):
        more = real_finish(self, job)
        if more is not None:
            shrunk.append((job[4], more[4]))  # rows before, after
        return more

    def carried_batches(self, *args):
        for launch in real_carried(self, *args):
            carried.append(launch)
            yield launch

    monkeypatch.setattr(stages._Stages, "finish", finish)
    monkeypatch.setattr(stages._Stages, "carried_batches", carried_batches)
    # Shrink whenever half the sources are finished, however few steps that saves.
    monkeypatch.setattr(stages, "MIN_SAVED_ROW_STEPS", {"new": 1, "known": 1})
    sources = sources_of(np.random.default_rng(1).integers(1, 13, 24))
    staged = translate_ids(
        model,
        sources,
        SearchSettings(
            beam_size=beam_size,
            n_best=n_best,
            batch_tokens=batch_tokens,
            min_rows=min_rows,
            stop=stop,
        ),
    )
    # Some sources went on with more room (stages); with batches that can shrink, some
    # went on in fewer rows as soon as half of their batch was finished.
    assert carried
    assert all(after < before for before, after in shrunk)
    assert bool(shrunk) == (min_rows == 1)
    whole = search_fn(model, SearchSettings(beam_size=beam_size, n_best=n_best, stop=stop))
    src = np.zeros((len(sources), 12), np.int32)  # all in one batch, one stage
    for i, ids in enumerate(sources):
        src[i, : len(ids)] = ids
    all_tokens, all_scores = (np.asarray(x) for x in whole(jnp.asarray(src)))
    for i, (tokens, scores) in enumerate(zip(all_tokens, all_scores, strict=True)):
        want = [
            (t[: t.tolist().index(EOS_ID)].tolist(), s) for t, s in zip(tokens, scores, strict=True)
        ]
        want = [w for w in want if np.isfinite(w[1])]
        got = staged[i]
        assert [h.tokens for h in got] == [t for t, _ in want], i
        np.testing.assert_allclose([h.score for h in got], [s for _, s in want], atol=1e-5)


class _Beam4:
    beam_size = 4


def test_a_batch_shrinks_only_when_the_steps_it_saves_pay_for_the_program(monkeypatch):
    monkeypatch.setattr(stages, "MIN_SAVED_ROW_STEPS", {"new": 8192, "known": 512})
    monkeypatch.setattr(stages, "_SHAPES_RUN", set())
    s = stages._Stages(_Beam4(), [], [], 256, None, None, min_rows=8)
    # 256 rows -> 128: 512 beam rows freed; a new program needs 16 saved steps of a room
    # of 48, so the batch may stop before step 32 (keep: half of its sources).
    assert s.early(256, 16, 48) == (128, 48 - 16)
    assert s.early(256, 16, 16) == (0, 0)  # too small a room to pay for it
    s.batches = {16: 4}  # four batches of the width share the new program's cost
    assert s.early(256, 16, 48) == (128, 48 - 4)
    stages._SHAPES_RUN.add((s.key, 128, 16, 48))  # the smaller program has run
    assert s.early(256, 16, 48) == (128, 48 - 1)
    assert s.early(8, 16, 48) == (0, 0)  # min_rows: no smaller batch
    sharded = stages._Stages(_Beam4(), [], [], 256, None, None, min_rows=1)
    sharded.multiple = 8
    assert sharded.early(8, 16, 48) == (0, 0)  # half the rows would not split over 8 devices


def test_stopping_once_the_best_is_final_keeps_the_best(model):
    src = ragged_src(4, [7, 3, 9, 5, 12, 2], vocab=40)
    length, extra = min(src.shape[1] + 50, 96), 50
    out = {}
    for n_best in (1, 4):
        rule = beam.Rule(4, n_best)
        state, done = beam.start(
            model, src, alpha=0.6, rule=rule, capacity=length, length=length, extra=extra
        )
        assert bool(jnp.all(done))
        out[n_best] = (beam.results(state), int(state.step))
    (tokens1, scores1), steps1 = out[1]
    (tokens4, scores4), steps4 = out[4]
    np.testing.assert_array_equal(tokens1[:, 0], tokens4[:, 0])
    np.testing.assert_array_equal(scores1[:, 0], scores4[:, 0])
    assert steps1 <= steps4


def test_first_rule_is_greedy_search(model):
    src = ragged_src(5, [6, 2, 9, 4], vocab=40)
    greedy, logp = decoding.greedy_search(model, src, return_logprob=True)
    length = min(src.shape[1] + 50, 96)
    rule = beam.Rule(1, stop="first")
    state, _ = beam.start(model, src, alpha=0.0, rule=rule, capacity=16, length=length, extra=50)
    while not bool(jnp.all(beam.done(state, jnp.float32(0.0), rule) | (state.step >= length))):
        room = min(2 * state.live_seqs.shape[2], length)
        state, _ = beam.resume(model, state, alpha=0.0, rule=rule, capacity=room)
    tokens, scores = beam.results(state)
    width = tokens.shape[2]
    np.testing.assert_array_equal(tokens[:, 0], np.asarray(greedy)[:, :width])
    np.testing.assert_allclose(scores[:, 0], logp, atol=1e-5)


def test_sources_taken_and_joined_keep_their_state(model):
    src = ragged_src(6, [5, 3, 7, 4], vocab=40)
    rule = beam.Rule(2)
    state, _ = beam.start(model, src, alpha=0.6, rule=rule, capacity=3, length=57, extra=50)
    host = jax.tree.map(np.asarray, state)
    a = carry.take_sources(host, np.array([2, 0]))
    b = carry.take_sources(host, np.array([3]))
    joined = carry.join_sources([a, b], width=12, rows=8)
    assert joined.live_seqs.shape == (8, 2, 3) and joined.cache.src_valid.shape == (8, 12)
    for new, old in enumerate([2, 0, 3]):
        np.testing.assert_array_equal(joined.live_seqs[new], host.live_seqs[old])
        np.testing.assert_array_equal(joined.fin_scores[new], host.fin_scores[old])
        for layer in range(2):
            got = joined.cache.self_kv[layer].k[2 * new : 2 * new + 2]
            np.testing.assert_array_equal(got, host.cache.self_kv[layer].k[2 * old : 2 * old + 2])
            cross = joined.cache.cross_kv[layer].v[new]
            np.testing.assert_array_equal(cross[:, :7], host.cache.cross_kv[layer].v[old])
            assert not cross[:, 7:].any()
    # Filler sources are done and hold nothing.
    assert np.all(np.isneginf(joined.live_logp[3:])) and not joined.cache.src_valid[3:].any()
    assert bool(jnp.all(beam.done(jax.tree.map(jnp.asarray, joined), jnp.float32(0.6), rule)[3:]))
    with pytest.raises(ValueError, match="different steps"):
        carry.join_sources([a, a._replace(step=np.int32(9))], width=12, rows=8)


def test_the_search_rule_is_greedy_for_beam_one():
    assert SearchSettings(beam_size=1).rule().stop == "first"
    assert SearchSettings(beam_size=4, n_best=2).rule().n_best == 2
    with pytest.raises(ValueError, match="n_best must be in"):
        beam.Rule(2, n_best=3)
    with pytest.raises(ValueError, match="n_best must be in"):
        SearchSettings(beam_size=2, n_best=3)


@pytest.mark.slow  # exports 8 widths' programs: ~45 s on 2 cores
def test_an_exported_translator_shrinks_batches_as_the_live_model(model, tmp_path, monkeypatch):
    from inference.export import ExportedTranslator, export_translator

    monkeypatch.setattr(stages, "MIN_SAVED_ROW_STEPS", {"new": 1, "known": 1})
    shrunk = []
    real_finish = stages._Stages.finish

    def finish(self, job):
        more = real_finish(self, job)
        shrunk.append(more is not None)
        return more

    monkeypatch.setattr(stages._Stages, "finish", finish)
    settings = SearchSettings(beam_size=4, alpha=0.6, n_best=2)
    export_translator(model, {"tokenizer.model": b"unused"}, str(tmp_path), settings)
    sources = sources_of(np.random.default_rng(2).integers(1, 13, 30))
    exported = ExportedTranslator.load(str(tmp_path), batch_tokens=512).translate(sources)
    assert any(shrunk)  # some batch went on in fewer rows through the exported programs
    live = translate_ids(model, sources, SearchSettings(beam_size=4, n_best=2, batch_tokens=512))
    for got, want in zip(exported, live, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        np.testing.assert_allclose([h.score for h in got], [h.score for h in want], atol=1e-5)

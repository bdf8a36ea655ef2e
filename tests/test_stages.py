"""Beam search of batches (search/beam.py, search/stages.py) against the search in one
padded batch with room for every token at once.

A source's results must not depend on the batch it is in, the rooms its search
grows through, the filler rows beside it, or on stopping it as soon as the
hypotheses asked for are final; and a job's programs must depend on its settings
and source widths alone, not on how its sources are cut into calls. A batch whose
rows shrink as its sources finish (search/rows.py) finds what the whole batch finds,
and counts the steps each source needed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import EOS_ID
from attention_jax.search import beam, decoding, rows, scoring, stages
from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import LiveSearch, translate_ids
from tests.conftest import search_rule
from tests.models import make, ragged_src, sources_of


@pytest.fixture(scope="module")
def model():
    # Wider vocabulary and a longer reach than test_decoding's, so that sources need
    # several rooms and some stop early.
    return make(seed=3, vocab_size=40, max_len=96)


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
        small = jnp.asarray(x[:, :300])  # one level: k passes over the row
        for got, want in zip(scoring.passes_top_k(small, k), jax.lax.top_k(small, k), strict=True):
            np.testing.assert_array_equal(got, want)


def test_stage_rooms_grow_to_every_sources_limit():
    assert stages.stage_rooms(8, 256) == [24, 48, 58]
    assert stages.stage_rooms(16, 64) == [32, 64]
    assert stages.stage_rooms(64, 64) == [64]


def one_batch(model, sources, settings):
    """Every source in one padded batch, with room for all its tokens from the start:
    per source, its (tokens, score) hypotheses."""
    src = np.zeros((len(sources), 12), np.int32)
    for i, ids in enumerate(sources):
        src[i, : len(ids)] = ids
    length = min(12 + 50, model.config.max_len)
    rule = settings.rule()
    args = dict(alpha=settings.alpha, rule=rule, length=length, extra=50, rooms=(length,))
    all_tokens, all_scores = (np.asarray(x) for x in decoding.search_batch(model, src, **args))
    out = []
    for tokens, scores in zip(all_tokens, all_scores, strict=True):
        hyps = [
            (t[: t.tolist().index(EOS_ID)].tolist(), s) for t, s in zip(tokens, scores, strict=True)
        ]
        out.append([h for h in hyps if np.isfinite(h[1])])
    return out


@pytest.mark.parametrize(
    ("beam_size", "n_best", "min_rows", "batch_tokens", "stop"),
    [
        # one case of each beam size, rows and rule in make test, the others in
        # make test-slow.
        pytest.param(4, 1, 8, 64, "bound", marks=pytest.mark.slow),
        pytest.param(3, 3, 8, 64, "bound", marks=pytest.mark.slow),
        pytest.param(1, 1, 8, 64, "bound", marks=pytest.mark.slow),
        pytest.param(4, 1, 1, 512, "bound", marks=pytest.mark.slow),
        (1, 1, 1, 96, "bound"),
        # (Beam 1 is greedy search whatever the rule: SearchSettings.rule.)
        (3, 3, 8, 64, "heuristic"),
        pytest.param(4, 1, 1, 512, "heuristic", marks=pytest.mark.slow),
    ],
)
def test_batched_translation_equals_one_batch(
    model, beam_size, n_best, min_rows, batch_tokens, stop
):
    settings = SearchSettings(
        beam_size=beam_size, n_best=n_best, batch_tokens=batch_tokens, min_rows=min_rows, stop=stop
    )
    sources = sources_of(np.random.default_rng(1).integers(1, 13, 24))
    batched = translate_ids(model, sources, settings)
    for i, want in enumerate(one_batch(model, sources, settings)):
        assert [h.tokens for h in batched[i]] == [t for t, _ in want], i
        np.testing.assert_allclose([h.score for h in batched[i]], [s for _, s in want], atol=1e-5)


_SEEN = set()


class _Recording(LiveSearch):
    """A LiveSearch that notes every program it runs: its kind, and the rows and room of
    the search it takes (a whole search: the batch's rows and width)."""

    def start(self, src, room, controls, until):
        _SEEN.add(("start", src.shape[0], room))
        return super().start(src, room, controls, until)

    def whole_counted(self, src, rooms, controls=None):  # run_stages' whole search
        _SEEN.add(("whole", *src.shape))
        return super().whole_counted(src, rooms, controls)

    def pooled(self, src, slots, controls=None, call=None):  # prepared or run
        _SEEN.add(("pool", *src.shape, slots))
        return super().pooled(src, slots, controls, call)

    def grow(self, state, room):
        _SEEN.add(("grow", *state.live_seqs.shape[::2]))
        return super().grow(state, room)

    def select(self, state, keep):
        _SEEN.add(("select", *state.live_seqs.shape[::2]))
        return super().select(state, keep)

    def advance(self, state, until):
        _SEEN.add(("advance", *state.live_seqs.shape[::2]))
        return super().advance(state, until)


# A job's programs at --batch_tokens=128 (max_len 96): full batches of 16 sources at
# width 8, a small input's of 8 (widths 8 and 16).
# Pooled (a CPU's): a batch's one program, its slots as many sources as hold 64 tokens.
POOLED = {("pool", 16, 8, 8), ("pool", 8, 8, 8), ("pool", 8, 16, 4)}
# Batched (a GPU's): width 8's rooms are 24, 48, 58; its 16 rows shrink to 4 in the last
# room; the small batches are searched whole.
SHRINKING = {("start", 16, 24), ("grow", 16, 24), ("select", 16, 58)}
SHRINKING |= {("advance", r, 58) for r in (16, 4)}  # as tests/test_programs.py prepares
BATCHED_STARTS = {("start", 16, 24), ("whole", 8, 8), ("whole", 8, 16)}


@pytest.mark.parametrize("how", ["pooled", "batched"])
def test_a_jobs_programs_do_not_depend_on_how_its_sources_are_cut(model, how, request):
    if how == "batched":
        request.getfixturevalue("segmented")
    settings = SearchSettings(beam_size=2, batch_tokens=128)
    sources = sources_of(np.random.default_rng(4).integers(2, 16, 40), seed=4)
    starts = POOLED if how == "pooled" else BATCHED_STARTS
    allowed = POOLED if how == "pooled" else SHRINKING | BATCHED_STARTS
    results = {}
    for cut, count in ((40, 40), (9, 40), (1, 10)):  # one at a time: the first 10
        search = _Recording(model, settings)
        _SEEN.clear()
        found = []
        for lo in range(0, count, cut):
            part = sources[lo : lo + cut]
            found += stages.run_stages(search, part, max_len=96, batch_tokens=128)
        assert allowed >= _SEEN, (cut, _SEEN - allowed)
        assert _SEEN & starts, cut  # the recording saw the batches
        results[cut] = found
    for cut in (9, 1):  # the same hypotheses; a batch of another shape rounds its sums
        for got, want in zip(results[cut], results[40][: len(results[cut])], strict=True):
            assert [h.tokens for h in got] == [h.tokens for h in want]
            np.testing.assert_allclose([h.score for h in got], [h.score for h in want], rtol=1e-5)


def test_stopping_once_the_best_is_final_keeps_the_best(model):
    src = ragged_src(4, [7, 3, 9, 5, 12, 2], vocab=40)
    length, extra = min(src.shape[1] + 50, 96), 50
    out = {}
    for n_best in (1, 4):
        rule = search_rule(4, n_best)
        out[n_best] = decoding.search_batch(
            model, src, alpha=0.6, rule=rule, length=length, extra=extra
        )
    (tokens1, scores1), (tokens4, scores4) = out[1], out[4]
    assert tokens1.shape[1] == 1 and tokens4.shape[1] == 4
    np.testing.assert_array_equal(tokens1[:, 0], tokens4[:, 0])
    np.testing.assert_array_equal(scores1[:, 0], scores4[:, 0])


def test_first_rule_is_greedy_search_in_growing_rooms(model):
    src = ragged_src(5, [6, 2, 9, 4], vocab=40)
    greedy, logp = decoding.translate_greedy(model, src, return_logprob=True)
    length = min(src.shape[1] + 50, 96)
    rule = search_rule(1, stop="count")
    rooms = (16, 32, length)
    tokens, scores = decoding.search_batch(
        model, src, alpha=0.0, rule=rule, length=length, extra=50, rooms=rooms
    )
    np.testing.assert_array_equal(tokens[:, 0], np.asarray(greedy)[:, :length])
    np.testing.assert_allclose(scores[:, 0], logp, atol=1e-5)


def test_rooms_must_grow_to_the_length(model):
    src = ragged_src(5, [6, 2], vocab=40)
    for rooms in [(16, 16, 40), (32, 16, 40), (16, 32)]:
        with pytest.raises(ValueError, match="rooms must increase"):
            decoding.search_batch(
                model, src, alpha=0.6, rule=search_rule(2), length=40, extra=50, rooms=rooms
            )


def test_the_search_rule_is_greedy_for_beam_one():
    assert SearchSettings(beam_size=1).rule().stop == "count"
    assert SearchSettings(beam_size=4, n_best=2).rule().n_best == 2
    with pytest.raises(ValueError, match="n_best must be in"):
        search_rule(2, n_best=3)
    with pytest.raises(ValueError, match="n_best must be in"):
        SearchSettings(beam_size=2, n_best=3)


@pytest.mark.slow  # exports 8 widths' programs: ~30 s on 2 cores
def test_an_exported_translator_translates_as_the_live_model(model, tmp_path):
    from attention_jax.backends.stablehlo import ExportedTranslator, export_translator

    settings = SearchSettings(beam_size=4, alpha=0.6, n_best=2)
    export_translator(model, {"tokenizer.model": b"unused"}, str(tmp_path), settings)
    sources = sources_of(np.random.default_rng(2).integers(1, 13, 30))
    exported = ExportedTranslator.load(str(tmp_path), batch_tokens=512).translate(sources)
    live = translate_ids(model, sources, SearchSettings(beam_size=4, n_best=2, batch_tokens=512))
    for got, want in zip(exported, live, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        np.testing.assert_allclose([h.score for h in got], [h.score for h in want], atol=1e-5)


# --- rows that shrink as sources finish (search/rows.py) ---


@pytest.mark.parametrize(
    ("count", "want"),
    [
        (4096, [4096, 2048, 1024, 512, 256, 64, 16, 4]),
        (300, [300, 150, 38, 10, 4]),  # halves above 256 rows, rounded up
        (256, [256, 64, 16, 4]),
        (64, [64, 16, 4]),
        (8, [8, 4]),
        (4, [4]),
        (3, [3]),  # never more rows than the batch has
        (24, [24, 6, 4]),
        (17, [17, 5, 4]),  # quarters rounded up
    ],
)
def test_the_ladder_halves_then_quarters_down_to_a_few_rows(count, want):
    assert rows.row_ladder(count) == want


def _search(model, src, settings, **kw):
    """One batch through `shrinking`, on one device."""
    rooms = stages.stage_rooms(src.shape[1], model.config.max_len)
    return rows.shrinking(
        LiveSearch(model, settings), src, rooms, beam_size=settings.beam_size,
        place=lambda x: stages.place(x, None), fetch=stages.fetch, **kw,
    )  # fmt: skip


def test_steps_needed_are_each_sources_own(model):
    # Beam 1 is greedy search: a source's search ends at the step its EOS is emitted,
    # so it needs as many steps as its output has tokens, EOS included.
    settings = SearchSettings(beam_size=1)
    sources = sources_of(np.random.default_rng(5).integers(2, 9, 13), seed=5)
    src = stages.batch_of(sources, range(13), 16, 8)  # 3 filler rows
    tokens, _, met, counts = _search(model, src, settings, sources=13)
    assert met is None
    lengths = [t[0].tolist().index(1) + 1 for t in tokens[:13]]  # EOS_ID = 1
    assert counts.needed == sum(lengths)
    # The rows ran at least what was needed, and fewer than the whole batch's 16 rows
    # for as many steps as its longest output.
    assert counts.needed <= counts.run < 16 * max(lengths)


def test_a_whole_search_counts_the_steps_its_rows_ran_and_its_sources_needed(model, monkeypatch):
    # A batch too small to shrink runs whole; --stats counts its beam-row steps too. With
    # beam 1 (greedy), a source needs a step per output token, EOS included, and all 8
    # rows (5 sources, 3 filler) run until the longest output ends.
    counted = {}
    count = lambda name, n=1: counted.update({name: counted.get(name, 0) + n})
    monkeypatch.setattr(stages.timing, "count", count)
    search = LiveSearch(model, SearchSettings(beam_size=1))
    sources = sources_of(np.random.default_rng(5).integers(2, 9, 5), seed=5)
    found = stages.run_stages(search, sources, max_len=96, batch_tokens=64)
    assert not rows.shrinks(search, 8)
    lengths = [len(h[0].tokens) + 1 for h in found]
    assert counted["beam_row_steps_needed"] == sum(lengths)
    assert counted["beam_row_steps_run"] == 8 * max(lengths)


def test_a_shrinking_search_finds_what_the_whole_batch_finds(model):
    settings = SearchSettings(beam_size=3, n_best=2)
    lengths = np.random.default_rng(6).integers(2, 13, 16)
    sources = sources_of(lengths, seed=6)
    src = stages.batch_of(sources, range(16), 16, 16)
    search = LiveSearch(model, settings)
    rooms = stages.stage_rooms(16, model.config.max_len)
    want_tokens, want_scores = (np.asarray(x) for x in search.whole(src, rooms))
    tokens, scores, _, counts = _search(model, src, settings)
    assert counts.run < 16 * 3 * rooms[-1]  # it shrank (or ended early)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5)

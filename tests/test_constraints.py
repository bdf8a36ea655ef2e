"""Target prefixes and terminology constraints in the beam search (search/constraints.py):
against brute force (the matcher, the allocation), the textbook beam search started
after the prefix, and the promise that every output contains every phrase."""

import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import EOS_ID
from attention_jax.search import constraints, decoding
from attention_jax.search.constraints import Controls
from tests.conftest import search_rule
from tests.models import PENALTIES, as_list, full_logp, make, ragged_src


def contains(seq, phrase) -> bool:
    return any(list(seq[i : i + len(phrase)]) == list(phrase) for i in range(len(seq)))


def test_failure_tables_are_the_longest_borders():
    rng = np.random.default_rng(0)
    for phrase in [[5, 5, 6], [5, 6, 5, 6, 7], [4, 4, 4, 4], *rng.integers(4, 7, (30, 6)).tolist()]:
        fail = constraints.failure_table(np.asarray(phrase))
        for j in range(2, len(phrase)):
            borders = [n for n in range(j) if phrase[:n] == phrase[j - n : j]]  # proper
            assert fail[j] == max(borders), (phrase, j)


def test_progress_tracks_the_longest_partial_match_and_keeps_a_met_phrase():
    rng = np.random.default_rng(1)
    phrases = [[5, 5, 6], [6, 5, 6, 7], [4], [5, 6, 5, 6, 5]]
    table = Controls.of([], [phrases], rows=1, prefix_len=0, max_phrases=4, max_tokens=5)
    for seq in rng.integers(4, 8, (40, 12)):
        progress = jnp.zeros((1, 4), jnp.int32)
        for n, token in enumerate(seq, start=1):
            progress = constraints.advance(progress, jnp.array([token]), table.phrases, table.fail)
            for c, phrase in enumerate(phrases):
                if contains(seq[:n], phrase):
                    want = len(phrase)  # met, for good
                else:  # the longest prefix of the phrase the sequence ends with
                    want = max(m for m in range(len(phrase)) if list(seq[n - m : n]) == phrase[:m])
                assert int(progress[0, c]) == want, (list(seq[:n]), phrase)


def test_allocation_takes_turns_among_banks_fullest_first():
    # 6 candidates in banks 2, 0, 2, 1, 0, 1 with these scores (the last none).
    score = jnp.array([[-1.0, -0.5, -3.0, -2.0, -0.1, -np.inf]])
    bank = jnp.array([[2, 0, 2, 1, 0, 1]])
    place = constraints.allocation_order(score, bank)
    # Turn 1: the best of banks 2, 1, 0 (-1.0, -2.0, -0.1); turn 2: bank 2's next (-3.0),
    # then bank 0's (-0.5); the non-candidate last.
    assert np.argsort(place[0]).tolist() == [0, 3, 4, 2, 1, 5]


def test_candidates_are_the_models_each_phrases_next_token_and_each_beams_best():
    live_logp = jnp.array([[0.0, -1.0]])  # K = 2
    logp = jnp.log(jnp.array([[[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]]))  # [B, K, V=3]
    progress = jnp.array([[[0], [1]]])  # beam 1 has produced the phrase's first token
    phrases = jnp.array([[[2, 1]]])  # [B, Q=1, T=2]
    top = (jnp.array([[np.log(0.6), np.log(0.3), -1.0 + np.log(0.5), -np.inf]]),
           jnp.array([[0, 0, 1, 1]]), jnp.array([[1, 2, 0, 0]]))  # fmt: skip
    score, beam, token = constraints.candidates(top, live_logp, logp, progress, phrases)
    found = zip(beam[0], token[0], score[0], strict=True)
    pairs = [(int(b), int(t)) for b, t, s in found if np.isfinite(s)]
    # the model's three; beam 1's next phrase token (1); beam 0's (2) and both beams'
    # best were listed already: not twice
    assert pairs == [(0, 1), (0, 2), (1, 0), (1, 1)]
    np.testing.assert_allclose(score[0, 4:6], [-np.inf, -1.0 + np.log(0.2)], rtol=1e-6)


@pytest.fixture(scope="module")
def model():
    return make(seed=4)


def test_a_prefix_starts_every_output_and_the_search_ranks_what_follows(model):
    src = ragged_src(2, [5, 4, 6])
    prefixes = [[7, 8], [], [9]]
    tokens, scores = decoding.translate_beams(
        model, src, beam_size=3, max_decode_len=9, prefixes=prefixes
    )
    for b, prefix in enumerate(prefixes):
        got = [as_list(tokens[b, i]) for i in range(3)]
        assert all(h[: len(prefix)] == prefix for h in got)
        if not prefix:  # no prefix: the search as without one
            want, _ = decoding.translate_beams(model, src[b : b + 1], beam_size=3, max_decode_len=9)
            assert got == [as_list(want[0, i]) for i in range(3)]
    # The textbook search, started after the prefix with score 0, ranks the same: the
    # prefix's tokens count in the length only.
    ref = reference_after_prefix(model, src[0], [7, 8], k=3, limit=9)
    assert [as_list(tokens[0, i]) for i in range(3)] == [list(s) for s, _ in ref]
    np.testing.assert_allclose(scores[0], [sc for _, sc in ref], rtol=1e-4, atol=1e-4)


def reference_after_prefix(model, src_row, prefix, k, limit, alpha=0.6):
    """reference_beam's search, whose hypotheses start with `prefix` at log P 0."""
    lp = lambda n: PENALTIES["gnmt"](n, alpha)
    live, finished = [(tuple(prefix), 0.0)], []
    for t in range(len(prefix), limit):
        cands = []
        for seq, score in live:
            logp = full_logp(model, src_row, list(seq))
            toks = [EOS_ID] if t == limit - 1 else range(len(logp))
            cands += [((*seq, tok), score + logp[tok]) for tok in toks]
        cands = sorted(cands, key=lambda c: -c[1])[: 2 * k]
        ending = cands[:1] if t == len(prefix) else cands[:k]  # right after it: the best only
        finished += [(s, v / lp(t + 1)) for s, v in ending if s[-1] == EOS_ID]
        finished = sorted(finished, key=lambda c: -c[1])[:k]
        live = [c for c in cands if c[0][-1] != EOS_ID][:k]
        best_live = max(sc for _, sc in live) / lp(limit) if live else -np.inf
        if not live or (len(finished) == k and finished[-1][1] >= best_live):
            break
    return finished


@pytest.mark.parametrize("beam_size", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_every_output_contains_every_phrase(model, beam_size):
    src = ragged_src(3, [6, 4, 7, 5])
    phrases = [[[9, 10]], [[5], [11, 4, 6]], [], [[8, 8], [7]]]
    tokens, met = search_with(model, src, phrases, beam_size, limit=14)
    for b, wanted in enumerate(phrases):
        best = as_list(tokens[b, 0])
        assert all(contains(best, p) for p in wanted), (best, wanted)
        assert bool(np.all(met[b, 0, : len(wanted)]))
    # Phrases the model would not produce by itself: the search still ends with them.
    free, _ = decoding.translate_beams(model, src, beam_size=beam_size, max_decode_len=14)
    assert any(not contains(as_list(free[b, 0]), p) for b, ps in enumerate(phrases) for p in ps)


def search_with(model, src, phrases, beam_size, limit):
    controls = Controls.of(
        [], phrases, rows=src.shape[0], prefix_len=0, max_phrases=2, max_tokens=3
    )
    rule = search_rule(beam_size, stop="count" if beam_size == 1 else "bound")
    tokens, _, met = decoding.search_batch(
        model, src, alpha=0.6, rule=rule, length=limit, extra=None, controls=controls
    )
    return tokens, np.asarray(met)


def test_a_source_without_phrases_is_searched_as_without_constraints(model):
    src = ragged_src(6, [5, 7])
    free, free_scores = decoding.translate_beams(model, src, beam_size=4, max_decode_len=10)
    tokens, scores = decoding.translate_beams(
        model, src, beam_size=4, max_decode_len=10, constraints=[[[9, 10]], []]
    )
    assert [as_list(t) for t in tokens[1]] == [as_list(t) for t in free[1]]
    np.testing.assert_allclose(scores[1], free_scores[1], rtol=1e-5)
    assert contains(as_list(tokens[0, 0]), [9, 10])


def test_limits_are_clear_errors():
    with pytest.raises(ValueError, match="at most 2 a line"):
        Controls.of([], [[[5], [6], [7]]], rows=1, prefix_len=0, max_phrases=2, max_tokens=3)
    with pytest.raises(ValueError, match="a constraint of 4 tokens: 1 to 3"):
        Controls.of([], [[[5, 6, 7, 8]]], rows=1, prefix_len=0, max_phrases=2, max_tokens=3)
    with pytest.raises(ValueError, match="a constraint of 0 tokens"):
        Controls.of([], [[[]]], rows=1, prefix_len=0, max_phrases=2, max_tokens=3)
    with pytest.raises(ValueError, match="a prefix of 3 tokens: at most 2"):
        Controls.of([[5, 6, 7]], [], rows=1, prefix_len=2, max_phrases=0, max_tokens=0)

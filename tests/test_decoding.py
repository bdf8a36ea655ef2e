"""Search properties on tiny random models: cached == full forward, beam 1 == greedy, etc."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_jax import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Transformer,
)
from attention_jax.backends import stablehlo
from attention_jax.search import beam, decoding, scoring
from tests.conftest import search_rule
from tests.models import PENALTIES, as_list, forward, full_logp, make, ragged_src
from tests.parity import TIE


def never_eos_model(**overrides) -> Transformer:
    """A model whose (tied) EOS embedding is far from every output: it never ends by itself."""
    model = make(**overrides)
    emb = model.src_embed.embedding
    emb[...] = emb[...].at[EOS_ID].set(-10 * jnp.abs(emb[...]).max())
    return model


@pytest.fixture(scope="module")
def model():
    # A sharp output distribution makes EOS likely early and ties impossible.
    return make()


def reference_greedy(model, src_row, limit, min_length=1):
    """Argmax over full forward passes; EOS banned at positions below min_length, forced
    at the limit."""
    out = []
    for t in range(limit):
        logp = full_logp(model, src_row, out)
        if t < min_length:
            logp[EOS_ID] = -np.inf
        tok = EOS_ID if t == limit - 1 else int(np.argmax(logp))
        out.append(tok)
        if tok == EOS_ID:
            break
    return out


def reference_beam(model, src_row, k, alpha, limit, penalty="gnmt", stop="bound", min_length=1):
    """Textbook beam search over full forward passes (same stopping rule, no cache).
    stop="bound": no live beam can win however long it grows (lp of the limit);
    "heuristic": none would win if it ended at the next step (lp of t + 2 tokens);
    "count": K hypotheses have finished (CTranslate2's rule).
    EOS is banned at positions below min_length (but forced at the limit)."""
    lp = lambda n: PENALTIES[penalty](n, alpha)
    live, finished = [((), 0.0)], []
    for t in range(limit):
        cands = []
        for seq, score in live:
            logp = full_logp(model, src_row, list(seq))
            if t < min_length:
                logp[EOS_ID] = -np.inf
            toks = [EOS_ID] if t == limit - 1 else range(len(logp))
            cands += [((*seq, tok), score + logp[tok]) for tok in toks]
        cands.sort(key=lambda c: -c[1])
        cands = cands[: 2 * k]
        finished += [(s, lpv / lp(t + 1)) for s, lpv in cands[:k] if s[-1] == EOS_ID]
        finished = sorted(finished, key=lambda c: -c[1])[:k]
        live = [c for c in cands if c[0][-1] != EOS_ID][:k]
        if not live or (stop == "count" and len(finished) == k):
            break
        best_live = max(sc for _, sc in live) / lp(limit if stop == "bound" else t + 2)
        if len(finished) == k and finished[-1][1] >= best_live:
            break
    return finished


def test_greedy_cached_equals_full_forward(model):
    src = ragged_src(0, [5, 3, 7])
    tokens = decoding.translate_greedy(model, src, max_decode_len=9)
    assert tokens.shape == (3, 9) and tokens.dtype == jnp.int32
    for b in range(3):
        assert as_list(tokens[b]) == reference_greedy(model, src[b], 9)


@pytest.fixture
def large_searches(monkeypatch):
    """Every beam search counts as large (search/decoding.py `LARGE_SEARCH_BYTES`), and the
    CPU steps as a GPU does: two steps per loop iteration, and stages of growing room in
    one program; programs compiled before or after use their own rule."""
    monkeypatch.setattr(decoding, "LARGE_SEARCH_BYTES", 0)
    monkeypatch.setattr(decoding, "TWO_STEP_PLATFORMS", frozenset({"cpu"}))
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize(
    ("penalty", "alpha", "stop"),
    [
        ("gnmt", 0.6, "bound"),
        ("average", 1.0, "heuristic"),
        ("gnmt", 0.6, "count"),
        # ~4 s each: every rule with each penalty in make test-slow
        pytest.param("average", 1.0, "bound", marks=pytest.mark.slow),
        pytest.param("gnmt", 0.6, "heuristic", marks=pytest.mark.slow),
        pytest.param("average", 1.0, "count", marks=pytest.mark.slow),
    ],
)
def test_beam_cached_equals_full_forward(model, penalty, alpha, stop):
    src = ragged_src(1, [4, 6])
    k, limit = 3, 7
    tokens, scores = decoding.translate_beams(
        model,
        src,
        beam_size=k,
        alpha=alpha,
        max_decode_len=limit,
        length_penalty=penalty,
        stop=stop,
    )
    assert tokens.shape == (2, k, limit) and scores.shape == (2, k)
    for b in range(2):
        ref = reference_beam(model, src[b], k, alpha, limit, penalty, stop)
        assert [as_list(tokens[b, i]) for i in range(k)] == [list(s) for s, _ in ref]
        np.testing.assert_allclose(scores[b], [sc for _, sc in ref], rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("large_searches")
@pytest.mark.parametrize("limit", [7, pytest.param(8, marks=pytest.mark.slow)])  # 8: ~13 s
def test_two_steps_per_iteration_equal_the_reference_up_to_an_odd_room(model, limit):
    # A room of 7 ends with a single step after three pairs; one of 8 with pairs only.
    src = ragged_src(1, [4, 6, 2])
    tokens, scores = decoding.translate_beams(model, src, beam_size=3, max_decode_len=limit)
    for b in range(3):
        ref = reference_beam(model, src[b], 3, 0.6, limit)
        assert [as_list(tokens[b, i]) for i in range(3)] == [list(s) for s, _ in ref]
        np.testing.assert_allclose(scores[b], [sc for _, sc in ref], rtol=1e-4, atol=1e-4)


def test_rows_gathered_as_on_a_gpu_equal_the_reference(model, monkeypatch):
    # A CPU copies the cache rows that move one at a time (the other tests); a GPU or TPU
    # gathers every row (search/beam.py ROW_COPY_PLATFORMS).
    monkeypatch.setattr(beam, "ROW_COPY_PLATFORMS", ())
    jax.clear_caches()
    src = ragged_src(3, [6, 3, 5])
    tokens, scores = decoding.translate_beams(model, src, beam_size=3, max_decode_len=7)
    for b in range(3):
        ref = reference_beam(model, src[b], 3, 0.6, 7)
        assert [as_list(tokens[b, i]) for i in range(3)] == [list(s) for s, _ in ref]
        np.testing.assert_allclose(scores[b], [sc for _, sc in ref], rtol=1e-4, atol=1e-4)
    jax.clear_caches()


def test_a_search_traced_for_another_platform_steps_as_it_does_there(model, monkeypatch):
    # Large searches take two steps a loop iteration on a GPU or TPU, one on a CPU; one
    # compiled ahead of time for a GPU (train.py --compile_for) is the GPU's program.
    monkeypatch.setattr(decoding, "LARGE_SEARCH_BYTES", 0)  # every search is large
    unrolls, step_until = [], beam.step_until
    monkeypatch.setattr(beam, "step_until", lambda *a: unrolls.append(a[4]) or step_until(*a))
    search = lambda src: decoding.translate_beams(model, src, beam_size=2, max_decode_len=9)
    jax.eval_shape(search, jax.ShapeDtypeStruct((2, 6), jnp.int32))  # traced, not compiled
    here, unrolls[:] = list(unrolls), []
    with decoding.tracing_for("gpu"):
        jax.eval_shape(search, jax.ShapeDtypeStruct((2, 7), jnp.int32))  # another program
    assert here and set(here) == {1} and set(unrolls) == {2}


def test_an_export_steps_on_each_platform_as_decode_py_does_there(model, monkeypatch):
    # An export made on a CPU for a GPU holds the GPU's loop; one for both holds each
    # platform's (chosen where it is compiled), and its CPU program gives the CPU's results.
    monkeypatch.setattr(decoding, "LARGE_SEARCH_BYTES", 0)  # every search is large
    unrolls, step_until = [], beam.step_until
    monkeypatch.setattr(beam, "step_until", lambda *a: unrolls.append(a[4]) or step_until(*a))
    search = lambda src: decoding.translate_beams(model, src, beam_size=2, max_decode_len=9)

    def exported(width, *platforms):  # a width of its own: JAX keeps a trace per shape
        unrolls.clear()
        (b,) = jax.export.symbolic_shape("b")
        args = (jax.ShapeDtypeStruct((b, width), jnp.int32),)
        blob, _ = stablehlo._serialize(search, args, platforms)
        return set(unrolls), jax.export.deserialize(blob)

    assert exported(5, "cpu")[0] == {1}
    assert exported(6, "cuda")[0] == {2}
    steps, both = exported(7, "cpu", "cuda")
    assert steps == {1, 2}
    src = ragged_src(3, [6, 3, 5], width=7)
    (tokens, scores), (want_tokens, want_scores) = both.call(src), search(src)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    # Another program (a symbolic batch) fuses, and so rounds, otherwise in the last bit.
    np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), rtol=1e-6, atol=0)


@pytest.mark.slow  # ~27 s of compiles
@pytest.mark.usefixtures("large_searches")
def test_a_large_search_grows_its_room_in_stages_as_the_reference():
    model = never_eos_model(max_len=64)  # every hypothesis runs to its limit
    src = ragged_src(7, [5, 3])
    # Stages of 21 tokens, then 30: each ends with a single step after pairs.
    assert scoring.rooms(5, 30) == [21, 30]
    tokens, scores = decoding.translate_beams(model, src, beam_size=2, max_decode_len=30)
    for b in range(2):
        ref = reference_beam(model, src[b], 2, 0.6, 30)
        assert [as_list(tokens[b, i]) for i in range(2)] == [list(s) for s, _ in ref]
        np.testing.assert_allclose(scores[b], [sc for _, sc in ref], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~20 s of compiles
def test_two_steps_per_iteration_give_the_results_of_one(model, monkeypatch):
    src = ragged_src(2, [6, 3, 5, 2])
    length, extra = decoding.decode_shape(model, src, None)
    # An odd room that ends every search, and stages to the whole length.
    cases = [dict(length=5, extra=None, rooms=(5,)), dict(length=length, extra=extra)]

    def search(min_bytes):
        monkeypatch.setattr(decoding, "LARGE_SEARCH_BYTES", min_bytes)
        jax.clear_caches()
        return [
            decoding.search_batch(model, src, alpha=0.6, rule=search_rule(3), **c) for c in cases
        ]

    for one, two in zip(search(1 << 62), search(0), strict=True):  # a step per iteration, two
        (tokens_1, scores_1), (tokens_2, scores_2) = map(np.asarray, one), map(np.asarray, two)
        # The two programs fuse, and so round, differently: scores agree to float32's
        # rounding (1.5e-7 relative seen), hypotheses exactly unless two are a near-tie.
        np.testing.assert_allclose(scores_2, scores_1, rtol=1e-6, atol=0)
        for b in range(len(src)):
            if not np.array_equal(tokens_1[b], tokens_2[b]):
                gaps = np.diff(scores_1[b])
                assert np.min(np.abs(gaps)) < TIE, (b, tokens_1[b], tokens_2[b], scores_1[b])
    jax.clear_caches()


def eos_first_model() -> Transformer:
    """A model whose (tied) EOS embedding is near every output: it wants to end at once."""
    model = make(seed=1)
    emb = model.src_embed.embedding
    emb[...] = emb[...].at[EOS_ID].set(emb[...].mean(axis=0) * 40)
    return model


@pytest.mark.parametrize("min_length", [0, 1, pytest.param(3, marks=pytest.mark.slow)])
def test_min_length_bans_eos_before_it_as_the_reference(min_length):
    model = eos_first_model()
    src = ragged_src(3, [4, 6, 2])
    greedy = decoding.translate_greedy(model, src, max_decode_len=9, min_length=min_length)
    tokens, _ = decoding.translate_beams(
        model, src, beam_size=2, max_decode_len=9, min_length=min_length
    )
    for b in range(3):
        want = reference_greedy(model, src[b], 9, min_length)
        assert as_list(greedy[b]) == want
        assert len(want) > min_length  # tokens before EOS: at least min_length
        ref = reference_beam(model, src[b], 2, 0.6, 9, min_length=min_length)
        assert [as_list(tokens[b, i]) for i in range(2)] == [list(s) for s, _ in ref]
    if min_length == 0:  # this model ends at once where it may
        assert all(as_list(greedy[b]) == [EOS_ID] for b in range(3))


def test_the_length_limit_wins_over_the_minimum_length(model):
    src = ragged_src(2, [4, 3])
    tokens = decoding.translate_greedy(model, src, max_decode_len=2, min_length=5)
    for b in range(2):
        assert as_list(tokens[b])[-1] == EOS_ID and len(as_list(tokens[b])) <= 2


def test_beam_scores_are_length_normalized_log_probs(model):
    src = ragged_src(2, [6, 3, 5])
    alpha = 0.6
    tokens, scores = decoding.translate_beams(model, src, beam_size=4, alpha=alpha)
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6), "best first"
    flat = tokens.reshape(12, -1)  # [B, K, L] -> [B*K, L]
    logp = sequence_logp(model, jnp.repeat(src, 4, axis=0), flat)  # [B*K]
    lengths = []
    for row in np.asarray(flat):
        seq = as_list(row)
        assert seq[-1] == EOS_ID and EOS_ID not in seq[:-1]
        assert np.all(row[len(seq) :] == PAD_ID)
        lengths.append(len(seq))
    expected = np.asarray(logp) / ((5 + np.array(lengths)) / 6) ** alpha
    np.testing.assert_allclose(scores.reshape(12), expected, atol=1e-4)


def test_beam_size_one_equals_greedy():
    for seed in range(3):
        model = make(seed)
        src = ragged_src(seed, [5, 2, 8, 4])
        greedy = decoding.translate_greedy(model, src)
        beam, _ = decoding.translate_beams(model, src, beam_size=1, alpha=0.0)
        np.testing.assert_array_equal(beam[:, 0], greedy)
        np.testing.assert_array_equal(decoding.translate(model, src, beam_size=1), greedy)


def sequence_logp(model, src, tokens):
    """Sum of log P of each row's tokens up to and including EOS: [B, L] -> [B]."""
    tgt_in = jnp.concatenate([jnp.full((src.shape[0], 1), BOS_ID), tokens[:, :-1]], axis=1)
    logp = jax.nn.log_softmax(forward(model, src, tgt_in), axis=-1)  # [B, L, V]
    picked = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]  # [B, L]
    # Positions up to and including the first EOS count.
    after = jnp.cumsum(tokens == EOS_ID, axis=1) - (tokens == EOS_ID)
    return jnp.sum(jnp.where(after == 0, picked, 0.0), axis=1)


@pytest.mark.slow  # ~19 s
def test_beam_alpha0_never_worse_than_greedy():
    for seed in range(4):
        model = make(seed + 10)
        src = ragged_src(seed, [6, 3, 8, 5, 2, 7])
        greedy = decoding.translate_greedy(model, src)
        beam, scores = decoding.translate_beams(model, src, beam_size=4, alpha=0.0)
        greedy_lp = sequence_logp(model, src, greedy)
        beam_lp = sequence_logp(model, src, beam[:, 0])
        np.testing.assert_allclose(beam_lp, scores[:, 0], atol=1e-4)
        assert np.all(np.asarray(beam_lp) >= np.asarray(greedy_lp) - 1e-4)


@pytest.mark.parametrize("penalty", ["gnmt", "average"])
def test_heuristic_stop_is_the_bound_at_alpha_0(penalty):
    # With alpha 0, lp is 1 at every length: "ended at the next step" and "however
    # long it grows" give the same test, so the same results: the same tokens, and the
    # same scores to float32's rounding (two programs, which XLA may fuse otherwise).
    model, src = make(5), ragged_src(4, [6, 3, 8, 5])
    run = lambda stop: decoding.translate_beams(
        model, src, beam_size=3, alpha=0.0, length_penalty=penalty, stop=stop
    )
    (t1, s1), (t2, s2) = run("bound"), run("heuristic")
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_allclose(s1, s2, rtol=1e-6, atol=0)


@functools.partial(jax.jit, static_argnames=("graphdef", "rule", "length", "extra"))
def _search_state(graphdef, params, src, *, rule, length, extra):
    """search/beam.py's state at the end of a search with room for every token."""
    model = nnx.merge(graphdef, params)
    return decoding.search_state(model, src, jnp.float32(0.6), rule, (length,), length, extra)


@pytest.mark.parametrize("n_best", [1, pytest.param(4, marks=pytest.mark.slow)])  # 4: ~8 s
def test_heuristic_stop_is_the_bound_search_cut_short(n_best):
    # Both searches take the same steps until the heuristic stops a source, after which
    # the exact one may only add better hypotheses: never a better best for the
    # heuristic, never more steps (each source searched alone, so its own steps count).
    # EOS's (tied) embedding is zeroed, so its logit is ~0 and hypotheses end early;
    # over these sources the heuristic must save steps.
    saved = 0
    for seed in range(2):
        model, src = make(seed), ragged_src(seed, [6, 3, 8, 5, 2, 7])
        emb = model.src_embed.embedding
        emb[...] = emb[...].at[EOS_ID].set(0.0)
        length, extra = decoding.decode_shape(model, src, None)
        graphdef, params = nnx.split(model)
        for b in range(src.shape[0]):
            exact, cut = (
                _search_state(
                    graphdef, params, src[b : b + 1], length=length, extra=extra,
                    rule=search_rule(4, n_best=n_best, stop=stop),
                )
                for stop in ("bound", "heuristic")
            )  # fmt: skip
            assert int(cut.step) <= int(exact.step)
            saved += int(exact.step) - int(cut.step)
            best_exact, best_cut = beam.results(exact)[1][0, 0], beam.results(cut)[1][0, 0]
            assert np.isfinite(best_cut) and best_cut <= best_exact + 1e-6
    assert saved > 0


@pytest.mark.slow  # ~14 s
def test_searches_work_for_a_model_trained_with_remat(model):
    # The config travels with a checkpoint: remat (a training setting) must not
    # reach the layers inside the search loop, and must not change the results.
    remat = make(remat=True)
    src = ragged_src(9, [5, 3])
    np.testing.assert_array_equal(
        decoding.translate_greedy(remat, src), decoding.translate_greedy(model, src)
    )
    np.testing.assert_array_equal(
        decoding.translate(remat, src, beam_size=2), decoding.translate(model, src, beam_size=2)
    )


def test_default_length_limit_is_source_length_plus_50():
    model = make(max_len=128)
    src = ragged_src(3, [3, 9], width=10)
    tokens = decoding.translate_greedy(model, src)
    assert tokens.shape == (2, 60)  # S + 50 columns
    # A model that never predicts EOS on its own is stopped at n + 50 (EOS included).
    tokens = np.asarray(decoding.translate_greedy(never_eos_model(max_len=128), src))
    lengths = [as_list(r).index(EOS_ID) + 1 for r in tokens]
    assert lengths == [53, 59]
    assert tokens[0, 53:].max() == 0


def test_padding_and_batch_composition_do_not_change_results(model):
    src = ragged_src(4, [5, 3, 6])
    alone = [decoding.translate(model, src[i : i + 1, :6]) for i in range(3)]
    wide = decoding.translate(model, jnp.pad(src, ((0, 1), (0, 4))))  # extra row, wider
    for i in range(3):
        row = as_list(wide[i])
        assert row == as_list(alone[i][0])


def test_sampling_respects_top_k_and_is_reproducible(model):
    src = ragged_src(5, [5, 4, 6, 3])
    key = jax.random.key(1)
    a = decoding.translate_sample(model, src, key, temperature=0.7, top_k=2)
    b = decoding.translate_sample(model, src, key, temperature=0.7, top_k=2)
    np.testing.assert_array_equal(a, b)
    # top_k=1 is greedy whatever the temperature.
    np.testing.assert_array_equal(
        decoding.translate_sample(model, src, key, temperature=3.0, top_k=1),
        decoding.translate_greedy(model, src),
    )
    for row in np.asarray(a):
        seq = as_list(row)
        assert seq[-1] == EOS_ID
        assert np.all(row[len(seq) :] == PAD_ID)


def test_repeated_calls_do_not_retrace(model):
    if not hasattr(decoding._search, "_cache_size"):
        pytest.skip("this jax has no jit _cache_size()")
    src = ragged_src(6, [4, 4])
    decoding.translate(model, src)
    before = decoding._search._cache_size()
    decoding.translate(model, ragged_src(7, [3, 4]))
    decoding.translate(model, ragged_src(8, [4, 2]), alpha=0.3)
    assert decoding._search._cache_size() == before


@pytest.mark.parametrize(
    "kwargs",
    [dict(beam_size=0), dict(alpha=-1.0), dict(max_decode_len=0), dict(max_decode_len=99)],
)
def test_bad_arguments_raise_value_error(model, kwargs):
    with pytest.raises(ValueError):
        decoding.translate_beams(model, ragged_src(0, [3]), **kwargs)


def test_length_penalty_matches_gnmt():
    assert float(scoring.length_penalty(7, 0.6)) == pytest.approx(math.pow(12 / 6, 0.6))
    assert float(scoring.length_penalty(7, 0.0)) == 1.0


def test_average_length_penalty_counts_eos():
    # CTranslate2's: log P / len^alpha, len the tokens with EOS (tests/test_ct2_export.py
    # checks this against CTranslate2's own scores).
    assert float(scoring.length_penalty(7, 0.6, "average")) == pytest.approx(7**0.6)
    assert float(scoring.length_penalty(7, 0.0, "average")) == 1.0
    # EOS alone is one token: its log-probability, for any alpha.
    score = scoring.normalized_score(jnp.array([0.0, -2.0]), jnp.array([1, 1]), 0.6, "average")
    assert np.asarray(score).tolist() == [0.0, -2.0]
    score = scoring.normalized_score(jnp.array([-2.0]), jnp.array([4]), 1.0, "average")
    assert float(score[0]) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="length_penalty must be one of"):
        decoding.translate_beams(make(), ragged_src(0, [3]), length_penalty="wu")
    with pytest.raises(ValueError, match="stop must be"):
        decoding.translate_beams(make(), ragged_src(0, [3]), stop="first")

"""The searches over a decoder of the user's own, given as a step function: checked against
every sequence enumerated, in float64 (vocabulary 5: PAD, EOS, BOS and two words).

The decoder's next-token logits depend on the whole history through its cache (a hash of
the tokens fed so far, one per row), so a beam that carried on another beam's cache, or
a cache not repeated per beam, would score differently from the enumeration.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import BOS_ID, EOS_ID
from attention_jax.search import beam
from attention_jax.search.beam import beam_search, places
from attention_jax.search.sampling import greedy_search, sample

V = 5  # 0 PAD, 1 EOS, 2 BOS, 3 and 4: the words
WORDS = (3, 4)
STATES = 101  # the history hash's range
LENGTH = 4  # output columns: at most 3 words and EOS


def _table(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, (2, STATES, V)).astype(np.float32)


def _next_hash(h, token):
    return (h * 7 + token + 1) % STATES


def decoder(table: np.ndarray):
    """A step function of a decoder whose logits depend on the source and the history:
    logits = table[source, hash(history)]; its cache is {"h": [R], "src": [R]}."""
    t = jnp.asarray(table)

    def step_fn(tokens, cache):
        h = _next_hash(cache["h"], tokens)
        return t[cache["src"], h], {"h": h, "src": cache["src"]}

    return step_fn


def start_cache(sources: int) -> dict:
    return {"h": jnp.zeros((sources,), jnp.int32), "src": jnp.arange(sources, dtype=jnp.int32)}


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (np.log(np.sum(np.exp(x - x.max()))) + x.max())


def enumerate_outputs(table, source, limit, alpha, min_length=1, phrase=None):
    """Every output the search may give source `source` (words, then EOS, at most `limit`
    tokens; EOS not before `min_length` unless at the limit), as (score, tokens, met),
    best first: score = log P / ((5 + len) / 6)^alpha, log P in float64."""
    out = []
    for n in range(limit):  # n words, then EOS
        if n < min_length and n < limit - 1:
            continue
        for words in itertools.product(WORDS, repeat=n):
            seq = [*words, EOS_ID]
            h, logp = 0, 0.0
            for prev, tok in zip([BOS_ID, *seq[:-1]], seq, strict=True):
                h = _next_hash(h, prev)
                logp += log_softmax64(table[source, h])[tok]
            met = phrase is None or any(
                list(words[i : i + len(phrase)]) == phrase for i in range(n)
            )
            if phrase is not None and not met and n < limit - 1:
                continue  # EOS is banned until the phrase is met, except at the limit
            out.append((logp / ((5 + len(seq)) / 6) ** alpha, seq, met))
    # Those that met their phrase first (only the limit ends one that has not).
    return sorted(out, key=lambda x: (not x[2], -x[0]))


def _clear_gaps(ranked, n):
    """The test's own check that its case has no near-tie in the first n (which float32
    could order either way)."""
    scores = [s for s, _, met in ranked[:n] if met]
    gaps = np.diff(scores)
    assert np.all(np.abs(gaps) > 1e-4), "the seed gives a near-tie: pick another"


def _hypotheses(tokens, scores, b):
    out = []
    for row, score in zip(np.asarray(tokens)[b], np.asarray(scores)[b], strict=True):
        if np.isfinite(score):
            seq = [int(t) for t in row]
            out.append((float(score), seq[: seq.index(EOS_ID) + 1]))
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_search_over_a_step_function_finds_every_output_in_order(alpha):
    table = _table(0)
    limits = [4, 3]
    step_fn = decoder(table)
    search = jax.jit(
        lambda cache, limits: beam_search(
            step_fn, cache, length=LENGTH, limits=limits, beam_size=16, alpha=alpha, n_best=16
        )
    )
    tokens, scores = search(start_cache(2), jnp.array(limits, jnp.int32))
    assert tokens.shape == (2, 16, LENGTH) and scores.shape == (2, 16)
    for b, limit in enumerate(limits):
        want = enumerate_outputs(table, b, limit, alpha)
        _clear_gaps(want, len(want))
        got = _hypotheses(tokens, scores, b)
        assert [seq for _, seq in got] == [seq for _, seq, _ in want]  # every one, in order
        np.testing.assert_allclose([s for s, _ in got], [s for s, _, _ in want], rtol=1e-5)


def test_a_constraint_is_met_by_the_best_output_that_contains_it():
    table = _table(1)
    phrase = [4, 3]
    tokens, scores = beam_search(
        decoder(table),
        start_cache(2),
        length=LENGTH,
        beam_size=16,
        n_best=16,
        alpha=0.6,
        constraints=[[phrase], [phrase]],
    )
    for b in range(2):
        want = enumerate_outputs(table, b, LENGTH, 0.6, phrase=phrase)
        meeting = [(s, seq) for s, seq, met in want if met]
        _clear_gaps(want, len(meeting))
        got = _hypotheses(tokens, scores, b)
        assert meeting and [seq for _, seq in got[: len(meeting)]] == [seq for _, seq in meeting]
        np.testing.assert_allclose(
            [s for s, _ in got[: len(meeting)]], [s for s, _ in meeting], rtol=1e-5
        )


def test_greedy_and_sampling_over_a_step_function():
    table = _table(2)
    step_fn = decoder(table)
    tokens, logp = greedy_search(step_fn, start_cache(2), length=LENGTH, return_logprob=True)
    for b in range(2):
        h, prev, want, total = 0, BOS_ID, [], 0.0
        for t in range(LENGTH):
            h = _next_hash(h, prev)
            lp = log_softmax64(table[b, h])
            allowed = lp.copy()
            allowed[[0, 2]] = -np.inf  # PAD and BOS are never emitted
            if t < 1:
                allowed[EOS_ID] = -np.inf  # min_length 1
            if t == LENGTH - 1:
                allowed[:] = -np.inf
                allowed[EOS_ID] = 0  # the limit forces EOS
            prev = int(np.argmax(allowed))
            want.append(prev)
            total += lp[prev]
            if prev == EOS_ID:
                break
        assert [int(x) for x in np.asarray(tokens)[b, : len(want)]] == want
        assert float(logp[b]) == pytest.approx(total, rel=1e-5)
    drawn = sample(step_fn, start_cache(2), jax.random.key(1), length=LENGTH, top_k=1)
    np.testing.assert_array_equal(drawn, tokens)  # top_k 1 is greedy
    many = sample(step_fn, start_cache(2), jax.random.key(1), length=LENGTH, temperature=5.0)
    assert math.prod(many.shape) == 2 * LENGTH and set(np.asarray(many).ravel()) <= {0, 1, 3, 4}


class _CountedCache(dict):
    """The decoder's cache, as a `BeamCache` that counts its reorders."""

    reorders = 0

    def repeat(self, k):
        return _CountedCache({n: jnp.repeat(x, k, axis=0) for n, x in self.items()})

    def reorder(self, rows):
        _CountedCache.reorders += 1
        return _CountedCache({n: jnp.take(x, rows, axis=0) for n, x in self.items()})

    def grow(self, capacity):
        return self

    def select(self, sources, k):
        rows = (sources[:, None] * k + jnp.arange(k)).reshape(-1)
        return _CountedCache({n: jnp.take(x, rows, axis=0) for n, x in self.items()})


jax.tree_util.register_pytree_node(
    _CountedCache,
    lambda c: (tuple(c.values()), tuple(c.keys())),
    lambda keys, values: _CountedCache(zip(keys, values, strict=True)),
)


def test_one_beam_never_reorders_the_cache_and_searches_as_greedy():
    """With one beam a source every beam continues its own row: the step leaves the cache
    as it is (a gather would copy all of it each step), and finds greedy search's output."""
    step_fn = decoder(_table(2))

    def counted(step_fn):
        def step(tokens, cache):
            logits, new = step_fn(tokens, dict(cache))
            return logits, _CountedCache(new)

        return step

    outputs = {}
    for k in (1, 2):
        _CountedCache.reorders = 0  # counted as the loop's step is traced
        outputs[k], _ = beam_search(
            counted(step_fn), _CountedCache(start_cache(2)), length=LENGTH, beam_size=k
        )
        assert (_CountedCache.reorders > 0) == (k > 1)
    greedy = greedy_search(step_fn, start_cache(2), length=LENGTH)
    np.testing.assert_array_equal(np.asarray(outputs[1])[:, 0], np.asarray(greedy))


def places_reference(origin: list[int]) -> list[int]:
    """The row each new beam takes (best first): its parent's if it is the parent's first
    child, else the next row, lowest first, of the beams that left no child."""
    free = iter(r for r in range(len(origin)) if r not in origin)
    return [p if p not in origin[:j] else next(free) for j, p in enumerate(origin)]


def test_new_beams_stay_in_their_parents_rows_and_the_others_take_childless_ones():
    rng = np.random.default_rng(0)
    for k in (2, 3, 4, 5):
        origin = rng.integers(0, k, (200, k))
        held = np.asarray(places(jnp.asarray(origin, jnp.int32)))  # [B, R]: the beam row r holds
        for b in range(len(origin)):
            rows = places_reference(origin[b].tolist())
            assert [rows[j] for j in held[b]] == list(range(k)), (origin[b], held[b])


@pytest.mark.parametrize("platforms", [("cpu",), ()])  # rows copied on a CPU, or gathered
def test_moving_rows_take_their_parents_cache_by_copies_or_by_a_gather(platforms, monkeypatch):
    monkeypatch.setattr(beam, "ROW_COPY_PLATFORMS", platforms)
    rng = np.random.default_rng(1)
    b, k = 6, 4
    origin = rng.integers(0, k, (b, k))
    held = np.asarray(places(jnp.asarray(origin, jnp.int32)))
    by_row = np.take_along_axis(origin, held, 1)  # each row's parent row
    moving = (by_row != np.arange(k)) & (rng.random((b, k)) < 0.8)  # some rows dead
    cache = {"k": rng.normal(size=(b * k, 3, 5)).astype(np.float32), "n": np.arange(b * k)}
    out = beam.move_rows(jax.tree.map(jnp.asarray, cache), jnp.asarray(by_row), moving)
    src = np.where(moving, np.arange(b)[:, None] * k + by_row, np.arange(b * k).reshape(b, k))
    for name, x in cache.items():
        np.testing.assert_array_equal(np.asarray(out[name]), x[src.reshape(-1)])


def test_rows_are_copied_in_a_program_for_a_cpu_and_gathered_in_one_for_a_gpu():
    # Chosen where the program is lowered, not by the backend that traces it: a GPU's
    # program has no loop of row copies, even when a CPU exports it.
    origin = jnp.array([[0, 0, 1, 3]], jnp.int32)  # beam 1, row 0's second child: row 2
    by_row = jnp.take_along_axis(origin, places(origin), 1)
    move = jax.jit(lambda c: beam.move_rows(c, by_row, by_row != jnp.arange(4)))
    cache = {"k": jnp.zeros((4, 3, 5), jnp.float32)}

    def lowered(*platforms):
        return jax.export.export(move, platforms=platforms)(cache).mlir_module()

    ops = lambda text: ("stablehlo.while" in text, "stablehlo.gather" in text)  # copies, gather
    assert ops(lowered("cpu")) == (True, False)
    assert ops(lowered("cuda")) == ops(lowered("tpu")) == (False, True)
    assert ops(lowered("cpu", "cuda")) == (True, True)

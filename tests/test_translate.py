"""search/translate.py: the one batching + search path of decode.py and the evaluation.

Checked against the search functions on one padded batch, against log-probabilities
from full forward passes (scores), and across meshes (8 fake CPU devices).
"""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from attention_jax import EOS_ID
from attention_jax.data.plans import plan_translation
from attention_jax.search import decoding
from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import translate_ids
from tests.models import as_list, full_logp, make

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return make()


def sources_of(lengths, seed=3, vocab=12):
    rng = np.random.default_rng(seed)
    return [[*rng.integers(4, vocab, size=n - 1).tolist(), EOS_ID] for n in lengths]


def test_plan_translation_covers_every_source_with_few_shapes():
    lengths = np.random.default_rng(0).integers(1, 120, size=3000)
    batches = plan_translation(lengths, batch_tokens=4096, max_len=256)
    seen = np.concatenate([idx for idx, _, _ in batches])
    assert sorted(seen.tolist()) == list(range(3000))
    for idx, width, rows in batches:
        assert len(idx) <= rows and rows * width <= 4096
        assert np.all(lengths[idx] <= width)
    assert len({(w, r) for _, w, r in batches}) <= 16  # compiled programs


def test_plan_translation_rows_divide_over_the_batch_devices():
    lengths = np.random.default_rng(1).integers(1, 60, size=500)
    for multiple in (2, 6, 8):
        batches = plan_translation(lengths, batch_tokens=1024, max_len=64, rows_multiple=multiple)
        assert all(rows % multiple == 0 and len(idx) <= rows for idx, _, rows in batches)
        assert sorted(np.concatenate([i for i, _, _ in batches]).tolist()) == list(range(500))


def test_every_batch_of_a_width_is_full_however_the_sources_are_cut():
    lengths = np.random.default_rng(5).integers(1, 64, size=900)
    for multiple in (1, 2, 8):
        full = lambda w: max(1 << (1024 // w).bit_length() - 1, multiple)  # noqa: B023
        for cut in (900, 333, 50, 9):
            for lo in range(0, len(lengths), cut):
                part = lengths[lo : lo + cut]
                batches = plan_translation(
                    part, batch_tokens=1024, max_len=64, rows_multiple=multiple
                )
                for idx, width, rows in batches:
                    assert rows == full(width) and 0 < len(idx) <= rows, (cut, width, rows)
                seen = sorted(np.concatenate([i for i, _, _ in batches]).tolist())
                assert seen == list(range(len(part)))


def test_a_small_input_runs_small_batches():
    for lengths, multiple, rows in (
        ([40], 1, 8),
        ([40, 3, 9], 1, 8),
        ([40], 3, 9),
        ([5] * 8, 1, 8),
    ):
        plan = plan_translation(lengths, batch_tokens=4096, max_len=64, rows_multiple=multiple)
        assert {r for _, _, r in plan} == {rows}
    plan = plan_translation([40], batch_tokens=4096, max_len=64, min_rows=1)
    assert [(len(i), w, r) for i, w, r in plan] == [(1, 64, 1)]
    plan = plan_translation([5] * 9, batch_tokens=4096, max_len=64)  # not small: full
    assert [(len(i), w, r) for i, w, r in plan] == [(9, 8, 512)]


@pytest.mark.slow  # ~20 s; test_stages covers min_rows 1 and 8 in make test
def test_min_rows_does_not_change_the_translations(model):
    sources = sources_of([5, 8, 3, 12, 6, 2, 9], seed=5)
    padded = translate_ids(model, sources, SearchSettings(beam_size=3, n_best=2))
    tight = translate_ids(model, sources, SearchSettings(beam_size=3, n_best=2, min_rows=1))
    assert [[h.tokens for h in hs] for hs in tight] == [[h.tokens for h in hs] for hs in padded]
    for a, b in zip(tight, padded, strict=True):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], rtol=1e-5)


def test_translate_ids_keeps_input_order(model):
    lengths = np.random.default_rng(3).permutation([2, 9, 3, 14, 5, 1, 7, 11, 4, 13])
    sources = sources_of(lengths)
    sources.insert(4, [])  # empty: no model call, no hypotheses
    seen = []
    outs = translate_ids(
        model,
        sources,
        SearchSettings(beam_size=2, batch_tokens=32),
        progress=lambda i, h: seen.append((i, h)),
    )
    assert len(outs) == len(sources) and outs[4] == []
    # progress: each non-empty source once, with the hypotheses it ends with
    done = sorted(i for indices, _ in seen for i in indices)
    assert done == [i for i in range(len(sources)) if i != 4]
    assert all(outs[i] == h for ix, hs in seen for i, h in zip(ix, hs, strict=True))
    # One padded batch in input order (per-row length limits make widths irrelevant).
    nonempty = [s for s in sources if s]
    batch = np.zeros((len(nonempty), 16), np.int32)
    for i, src in enumerate(nonempty):
        batch[i, : len(src)] = src
    reference = decoding.translate(model, jnp.asarray(batch), beam_size=2)
    best = [h[0].tokens for h in outs[:4] + outs[5:]]
    assert best == [as_list(r)[:-1] for r in np.asarray(reference)]


@pytest.mark.slow  # ~28 s; test_decode_cli checks n-best lists
def test_n_best_is_sorted_and_its_first_is_the_1_best(model):
    sources = sources_of([5, 8, 3, 12, 6], seed=4)
    one = translate_ids(model, sources, SearchSettings(beam_size=4, n_best=1))
    four = translate_ids(model, sources, SearchSettings(beam_size=4, n_best=4))
    for a, b in zip(one, four, strict=True):
        assert len(a) == 1 and 1 <= len(b) <= 4
        assert b[0] == a[0]
        scores = [h.score for h in b]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in b}) == len(b)  # distinct hypotheses


@pytest.mark.parametrize(("beam_size", "alpha"), [(1, 0.6), (4, 0.6), (4, 0.0)])
def test_scores_are_length_normalized_log_probabilities(model, beam_size, alpha):
    """score = log P(tokens + EOS) / ((5 + len) / 6)^alpha, from full forward passes."""
    sources = sources_of([6, 9, 4], seed=5)
    hyps = translate_ids(
        model, sources, SearchSettings(beam_size=beam_size, alpha=alpha, n_best=beam_size)
    )
    for src, src_hyps in zip(sources, hyps, strict=True):
        for h in src_hyps:
            out = [*h.tokens, EOS_ID]
            logp = sum(
                full_logp(model, jnp.asarray(src), out[:t])[tok] for t, tok in enumerate(out)
            )
            assert h.score == pytest.approx(logp / ((5 + len(out)) / 6) ** alpha, abs=2e-4)


@pytest.mark.parametrize("beam_size", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3: ~34 s
def test_vocab_limit_is_never_exceeded(model, beam_size):
    sources = sources_of([7, 3, 10, 5, 9, 6], seed=6)
    free = translate_ids(model, sources, SearchSettings(beam_size=beam_size, n_best=beam_size))
    assert any(t >= 8 for hs in free for h in hs for t in h.tokens)  # the limit matters here
    limited = translate_ids(
        model, sources, SearchSettings(beam_size=beam_size, n_best=beam_size), vocab_limit=8
    )
    assert all(t < 8 for hs in limited for h in hs for t in h.tokens)


_MESH = """
import json, sys
import jax, numpy as np
from attention_jax import EOS_ID
from tests.models import make
from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import translate_ids
from attention_jax.training.mesh import batch_sharding
rng = np.random.default_rng(7)
sources = [[*rng.integers(4, 12, size=n - 1).tolist(), EOS_ID] for n in rng.integers(1, 15, 40)]
model = make()
out = {}
for shape in [(1, 1, 1), (4, 2, 1), (2, 2, 2)]:
    auto = (jax.sharding.AxisType.Auto,) * 3  # as training.mesh.make_mesh
    mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=auto)
    settings = SearchSettings(beam_size=3, n_best=2, batch_tokens=64)
    hyps = translate_ids(model, sources, settings, sharding=batch_sharding(mesh))
    out[str(shape)] = [[(h.tokens, h.score) for h in hs] for hs in hyps]
out["none"] = [
    [(h.tokens, h.score) for h in hs]
    for hs in translate_ids(model, sources, SearchSettings(beam_size=3, n_best=2, batch_tokens=64))
]
print(json.dumps(out))
"""


@pytest.mark.slow  # ~75 s: a subprocess with 8 virtual devices
def test_same_translations_on_any_mesh():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [sys.executable, "-c", _MESH], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Tokens must be identical; scores are float32 sums whose order depends on how
    # the mesh splits the work, so they agree to float32 rounding (|score| ~ 10 here,
    # a few ulps ~ 1e-6), checked with a stated tolerance instead of rounding, which
    # fails whenever a last-bit difference straddles a rounding boundary.
    reference = out.pop("none")
    for mesh, hyps in out.items():
        assert [[h[0] for h in hs] for hs in hyps] == [[h[0] for h in hs] for hs in reference], mesh
        scores = [h[1] for hs in hyps for h in hs]
        expected = [h[1] for hs in reference for h in hs]
        assert scores == pytest.approx(expected, rel=1e-5, abs=1e-5), mesh

"""bench/flax_wmt.py's workload mode without Flax's file: decode.py's batches go through
a stand-in search and each answer comes back to its own source, in input order (the plan
sorts sources by length, so a slip would scramble them), cut at the first EOS."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import flax_wmt
from data.plans import plan_translation
from model import EOS_ID, Transformer, TransformerConfig
from tests.conftest import model_fields


def test_best_tokens_stop_before_the_first_eos():
    assert flax_wmt._best_tokens(np.array([7, 8, EOS_ID, 9, EOS_ID])) == [7, 8]
    assert flax_wmt._best_tokens(np.array([7, 8])) == [7, 8]
    assert flax_wmt._best_tokens(np.array([EOS_ID, 5])) == []


def test_each_source_gets_its_own_answer_in_input_order():
    model = Transformer(TransformerConfig(**model_fields()), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    sources = [[*rng.integers(4, 20, n).tolist(), EOS_ID] for n in rng.integers(1, 30, 40)]
    sources[5] = []  # an empty line: no batch, no answer
    calls = []

    def stand_in(graphdef, state, src, *, beam_size, alpha, length, vocab_limit):
        """Answers each row with its source reversed, then EOS and junk after it."""
        calls.append((src.shape, length, beam_size, alpha, vocab_limit))
        rows = np.asarray(src)
        out = np.full((rows.shape[0], length - 1), 3, np.int32)
        for r, row in enumerate(rows):
            ids = [int(t) for t in row if t not in (0, EOS_ID)][::-1]
            out[r, : len(ids) + 1] = [*ids, EOS_ID]
        return jnp.asarray(out)

    lengths = [len(s) for s in sources if s]
    plan = plan_translation(lengths, batch_tokens=64, max_len=model.config.max_len)
    assert len(plan) > 1
    got = flax_wmt._flax_over_plan(
        model, sources, plan, stand_in, beam_size=4, alpha=0.6, vocab_limit=30
    )
    assert got == [s[:-1][::-1] if s else [] for s in sources]
    assert len(calls) == len(plan)
    for (shape, length, *settings), (_, width, rows) in zip(calls, plan, strict=True):
        assert shape == (rows, width)
        assert length == min(width + 50, model.config.max_len)
        assert settings == [4, 0.6, 30]

"""The parity tests' judge (tests/parity.py): identical lines pass, two outputs the model
scores alike are near-ties, and any other difference fails, however few lines it touches."""

import numpy as np
import pytest

from attention_jax import EOS_ID
from attention_jax.search import decoding
from tests.models import make, ragged_src
from tests.parity import NearTies

TWIN = 7  # its (tied) embedding row is made equal to token 6's: the two always tie


@pytest.fixture(scope="module")
def model():
    m = make(seed=2)
    emb = m.src_embed.embedding
    emb[...] = emb[...].at[TWIN].set(emb[...][TWIN - 1])
    return m


def as_list(row):
    row = [int(t) for t in np.asarray(row)]
    return row[: row.index(EOS_ID)]


def test_identical_ties_and_differences(model):
    src = np.asarray(ragged_src(1, [5, 4, 6]))
    sources = [[int(t) for t in row if t] for row in src]
    tokens, _ = decoding.translate_beams(model, src, beam_size=2, max_decode_len=8)
    ours = [[as_list(tokens[b, 0])] for b in range(3)]
    ties = NearTies(model, penalty="gnmt", alpha=0.6)
    assert ties.compare(sources, ours, ours).count("same") == 3

    # A twin swapped in scores exactly alike: a tie; an unlikely token is a difference.
    twin = [[[TWIN if t == TWIN - 1 else TWIN - 1 if t == TWIN else t for t in h] for h in hs]
            for hs in ours]  # fmt: skip
    changed = [any(t in (TWIN - 1, TWIN) for t in hs[0]) for hs in ours]
    result = ties.compare(sources, ours, twin)
    assert [x.verdict for x in result.lines] == ["tie" if c else "same" for c in changed]
    assert result.ok
    worse = [[[*hs[0][:-1], 11]] for hs in ours]  # the last token replaced
    result = ties.compare(sources, ours, worse)
    assert not result.ok and "different" in result.report()
    assert ties.compare(sources, ours, [[], [], []]).count("different") == 3  # n-best sizes


def test_greedy_ties_are_judged_where_the_outputs_part(model):
    src = [4, 9, 5, 3, EOS_ID]
    greedy = as_list(decoding.translate_greedy(model, np.array([src]), max_decode_len=8)[0])
    ties = NearTies(model)
    verdict = lambda a, b: ties.compare([src], [[a]], [[b]], "greedy").lines[0].verdict
    # Parting at a twin is a tie, whatever follows it.
    assert verdict([*greedy[:2], TWIN - 1, 4], [*greedy[:2], TWIN, 9, 9]) == "tie"
    # Parting with the greedy choice for another token is not (the model is far from flat).
    other = next(t for t in range(4, 12) if t not in (greedy[1], TWIN - 1, TWIN))
    assert verdict(greedy, [greedy[0], other]) == "different"
    with pytest.raises(ValueError, match="beam or greedy"):
        ties.compare([src], [[greedy]], [[greedy]], "sample")

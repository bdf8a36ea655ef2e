"""The search test_programs.py runs, in its process and in the processes it starts (a new
process loads the programs kept on disk): one batch of sources, one program."""

from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import translate_ids
from tests.models import sources_of

SOURCES = sources_of([3, 5, 8, 2, 7, 6, 4, 8], seed=4)  # width 8: one program


def search(model):
    """(tokens, score) of the 2 best hypotheses of each of SOURCES (beam 3)."""
    hyps = translate_ids(model, SOURCES, SearchSettings(beam_size=3, n_best=2, batch_tokens=64))
    return [[(h.tokens, h.score) for h in hs] for hs in hyps]

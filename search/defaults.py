"""The search's defaults, declared once: every flag, options object, config and export
imports them from here (a plain module, no JAX: decode.py's flags read it before JAX
loads).

    DEFAULT_BEAM_SIZE, DEFAULT_ALPHA     # the paper's (section 6.1): beam 4, alpha 0.6
    default_batch_tokens()               # 512 on a CPU, 32768 on a GPU or TPU
    CT2_BATCH_TOKENS["cpu"]              # decode.py --ct2's

The paper decodes with beam 4, length penalty alpha 0.6, and at most source length +
50 output tokens.
"""

from __future__ import annotations

DEFAULT_BEAM_SIZE = 4
DEFAULT_ALPHA = 0.6
EXTRA_DECODE_LEN = 50
# How scores are normalized by length: "gnmt" (the default, as the paper's setup) or
# "average" (CTranslate2's and OpenNMT's; search/scoring.py `length_penalty`).
LENGTH_PENALTIES = ("gnmt", "average")
DEFAULT_LENGTH_PENALTY = "gnmt"
# When a source's beam search ends (search/beam.py `Rule`): "bound" (exact),
# "heuristic" or "count" (CTranslate2's and OpenNMT's); what decode.py's --stop offers.
BEAM_STOPS = ("bound", "heuristic", "count")
DEFAULT_STOP = "bound"
# The fewest tokens before EOS (EOS is banned at output positions below it): 1 = no
# empty translation of a non-empty source, as CTranslate2's min_decoding_length and
# fairseq's min_len default to; 0 = EOS may come first.
DEFAULT_MIN_LENGTH = 1
# Terminology constraints (decode.py --constraints): at most this many phrases a line,
# of at most this many tokens each (they size the search's arrays: see search/constraints.py).
DEFAULT_MAX_CONSTRAINTS = 4
DEFAULT_CONSTRAINT_TOKENS = 8

# Padded source tokens per batch, by platform. A CPU's batches stay small: a search
# step's time grows with its rows, and a batch runs until its slowest source is done
# (on the Ding train sources with the tiny model, 512 gave 2,290-2,370 target tokens/s
# against 1,520-1,580 at 4096). An accelerator's are made big enough to keep it busy
# (beam search holds K x as many tokens, each with a key and a value per layer in its
# cache).
BATCH_TOKENS = {"cpu": 512, "gpu": 32768, "cuda": 32768, "rocm": 32768, "tpu": 32768}
# CTranslate2's (decode.py --ct2: its max_batch_size, batch_type "tokens"), by --device.
CT2_BATCH_TOKENS = {"cpu": 4096, "cuda": 32768}


def default_batch_tokens(platform: str | None = None) -> int:
    """BATCH_TOKENS of `platform` (default: JAX's default backend; a CPU's if unlisted)."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return BATCH_TOKENS.get(platform, BATCH_TOKENS["cpu"])

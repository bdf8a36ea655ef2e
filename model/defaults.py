"""The search's defaults, declared once: every flag, options object, config and export
imports them from here (a plain module, no JAX: decode.py's flags read it before JAX
loads).

The paper (section 6.1) decodes with beam 4, length penalty alpha 0.6, and at most
source length + 50 output tokens.
"""

DEFAULT_BEAM_SIZE = 4
DEFAULT_ALPHA = 0.6
EXTRA_DECODE_LEN = 50
# How scores are normalized by length: "gnmt" (the default, as the paper's setup) or
# "average" (CTranslate2's and OpenNMT's; model/scoring.py `length_penalty`).
LENGTH_PENALTIES = ("gnmt", "average")
DEFAULT_LENGTH_PENALTY = "gnmt"
# When a source's beam search ends (model/beam.py `Rule`): "bound" (exact),
# "heuristic" or "count" (CTranslate2's and OpenNMT's); what decode.py's --stop offers.
BEAM_STOPS = ("bound", "heuristic", "count")
DEFAULT_STOP = "bound"
# The fewest tokens before EOS (EOS is banned at output positions below it): 1 = no
# empty translation of a non-empty source, as CTranslate2's min_decoding_length and
# fairseq's min_len default to; 0 = EOS may come first.
DEFAULT_MIN_LENGTH = 1
# Terminology constraints (decode.py --constraints): at most this many phrases a line,
# of at most this many tokens each (they size the search's arrays: see model/constraints.py).
DEFAULT_MAX_CONSTRAINTS = 4
DEFAULT_CONSTRAINT_TOKENS = 8

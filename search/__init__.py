"""The searches, and token ids in, hypotheses out: the layer between the model and its
users, training's evaluation, decode.py's application (inference/) and the library's
Translator.

Over any decoder's step function, step_fn(tokens, cache) -> (logits, cache):
    beam.py        beam search: length penalty, exact stopping, prefixes, constraints,
                   n-best (`beam_search`; `Rule` and `BeamState` for the compiled ones)
    sampling.py    greedy search and ancestral sampling (`greedy_search`, `sample`)
    scoring.py     length penalties, length limits, restricted ids, the two-level top-k
    constraints.py target prefixes and terminology constraints as fixed-size arrays
    settings.py    `SearchSettings`: every search setting declared once (name, type,
                   default, help), from which flags, options, configs and `Rule` derive

The Transformer's, and many sources batched into static shapes:
    decoding.py    the Transformer's step function under those searches, one compiled
                   program per batch shape (`translate`, `translate_beams`, `search_batch`)
    segments.py    its beam search in segments, a program each (start, grow, select, advance)
    translate.py   the Backend interface, the live model's (`LiveTranslator`,
                   `translate_ids`) and the batching every backend shares
    hypothesis.py  `Hypothesis` (ids and score), what every translator returns per source
    likelihood.py  given translations scored: each token's log-probability, teacher-forced
    stages.py      the JAX backends' batch loop: batches of a few shapes, planned ahead
    rows.py        a batch's search in segments, its rows shrinking as its sources finish
    programs.py    the compiled programs a job needs: built ahead in threads, kept on disk
    timing.py      where decode.py's time goes (--stats): phases, programs, device busy
    bleu.py        corpus BLEU and chrF

Imports model/ and data/ only. Nothing is imported here, so that importing one module
loads only what it needs (settings.py is free of JAX: decode.py's flags read it).
"""

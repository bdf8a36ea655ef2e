"""Token ids in, hypotheses out: the layer between the model and its two users,
training's evaluation and decode.py's application (inference/).

    settings.py    `SearchSettings`: beam, alpha, n_best, length penalty, stop, batch
                   tokens: one object from decode.py's flags to the programs
    translate.py   the Translator interface, the live model's (`LiveTranslator`,
                   `translate_ids`) and the batching every backend shares
    hypothesis.py  `Hypothesis` (ids and score), what every translator returns per source
    stages.py      the JAX backends' batch loop: one program per batch shape, planned ahead
    programs.py    the compiled programs a job needs: built ahead in threads, kept on disk
    timing.py      where decode.py's time goes (--stats): phases, programs, device busy
    bleu.py        corpus BLEU and chrF

Imports model/ and data/ only. Nothing is imported here, so that importing one module
loads only what it needs.
"""

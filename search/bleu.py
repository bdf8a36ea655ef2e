"""Corpus BLEU and chrF (sacreBLEU), as training's evaluation and decode.py report them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bleu_chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU and chrF from sacreBLEU, with their signatures."""
    import sacrebleu

    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }

"""Corpus BLEU and chrF (sacreBLEU), as training's evaluation and decode.py report them:
whole (`bleu_chrf`) or a chunk at a time (`CorpusScores`), one computation.

    scores = bleu_chrf(hyps, refs)   # {"bleu", "chrf", "bleu_signature", "chrf_signature"}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bleu_chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU and chrF of `hyps` against `refs` (one reference each), with their
    sacreBLEU signatures."""
    scores = CorpusScores()
    scores.add(hyps, refs)
    return scores.result()


class CorpusScores:
    """BLEU and chrF of a corpus seen a chunk at a time, equal to sacreBLEU's corpus scores
    of all of it.

    sacreBLEU's corpus scores are functions of per-sentence statistics summed
    over the corpus (n-gram matches and totals, lengths); this keeps only those
    sums, so memory holds no text, and `stats` can be saved and resumed:

        scores = CorpusScores()
        scores.add(hyps_of_chunk, refs_of_chunk)   # per chunk
        scores.result()                            # as sacreBLEU's corpus_score of all
        CorpusScores(scores.stats)                 # go on from saved sums
    """

    def __init__(self, stats: dict[str, list[int]] | None = None):
        import sacrebleu

        self._metrics = {"bleu": sacrebleu.metrics.BLEU(), "chrf": sacrebleu.metrics.CHRF()}
        self.stats = {name: list(v) for name, v in (stats or {}).items()}

    def add(self, hyps: Sequence[str], refs: Sequence[str]) -> None:
        if not hyps:
            return
        for name, metric in self._metrics.items():
            # The statistics corpus_score sums (sacreBLEU >= 2.0's own significance tests
            # use the same two methods).
            rows = metric._extract_corpus_statistics(list(hyps), [list(refs)])
            sums = [int(sum(column)) for column in zip(*rows, strict=True)]
            old = self.stats.get(name, [0] * len(sums))
            self.stats[name] = [a + b for a, b in zip(old, sums, strict=True)]

    def result(self) -> dict[str, Any]:
        """{"bleu", "chrf", "bleu_signature", "chrf_signature"}."""
        out = {}
        for name, metric in self._metrics.items():
            # Also sets num_refs for the signature; an empty corpus scores 0.
            (empty,) = metric._extract_corpus_statistics([""], [[""]])
            stats = self.stats.get(name, [0] * len(empty))
            out[name] = float(metric._compute_score_from_stats(stats).score)
            out[f"{name}_signature"] = str(metric.get_signature())
        return out

    def summary(self) -> str:
        """Two lines, as decode.py prints them: 'BLEU = 27.31  nrefs:1|case:mixed|...' and
        'chrF = 55.02  nrefs:1|...'."""
        r = self.result()
        return "\n".join(
            f"{label} = {r[name]:.2f}  {r[name + '_signature']}"
            for name, label in (("bleu", "BLEU"), ("chrf", "chrF"))
        )

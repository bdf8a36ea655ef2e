"""How a search runs, as one object from decode.py's flags or a training config to the
batch loop and the compiled programs.

    settings = SearchSettings(beam_size=4, alpha=0.6, n_best=2, batch_tokens=4096)
    hyps = translate_ids(model, sources, settings)       # search/translate.py
    rule = settings.rule(vocab_limit=None)               # model/beam.py's static part
"""

from __future__ import annotations

import dataclasses

from data.plans import MIN_ROWS
from model import beam
from model.scoring import DEFAULT_LENGTH_PENALTY


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """A search's settings; every translator (live, exported, CTranslate2) has one.

    beam_size: K (1 = greedy search); alpha: the length-penalty exponent.
    n_best: hypotheses kept per source (<= beam_size), best first.
    length_penalty: "gnmt" or "average" (model/decoding.py `length_penalty`).
    stop: "bound" (exact) or "heuristic" (about half the steps; model/beam.py `Rule`).
    steps_per_check: steps between tests of the stopping condition (the same results
      for any value); None = the platform's (model/beam.py `steps_per_check`).
    batch_tokens: padded source tokens per batch (beam search holds K times as many).
    carry: carry a batch's unfinished sources over to smaller batches (True) or run
      each batch's whole search in one program (False; fewer programs to compile);
      None = the platform's (search/stages.py `carries_over`). The same results.
    min_rows: the fewest rows of a batch (data/plans.py `plan_translation`): 1 for a
      dev set translated again and again, where 8 rows of filler cost 8x the search.
    """

    beam_size: int = 4
    alpha: float = 0.6
    n_best: int = 1
    length_penalty: str = DEFAULT_LENGTH_PENALTY
    stop: str = "bound"
    steps_per_check: int | None = None
    batch_tokens: int = 4096
    carry: bool | None = None
    min_rows: int = MIN_ROWS

    def __post_init__(self) -> None:
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"n_best must be in [1, beam_size={self.beam_size}]: {self.n_best}")
        if self.stop not in beam.BEAM_STOPS:
            raise ValueError(f"stop must be one of {beam.BEAM_STOPS}, got {self.stop!r}")

    def rule(self, vocab_limit: int | None = None) -> beam.Rule:
        """model/beam.py's static settings: beam search that stops a source once its n_best
        best are final ("bound") or no live beam would beat them if it ended next
        ("heuristic"), or for beam_size 1 greedy search (the first hypothesis that ends),
        scored the same way; never emitting ids >= vocab_limit."""
        per = beam.steps_per_check() if self.steps_per_check is None else self.steps_per_check
        stop = "first" if self.beam_size == 1 else self.stop
        return beam.Rule(self.beam_size, self.n_best, stop, self.length_penalty, vocab_limit, per)

    def replace(self, **changes) -> SearchSettings:
        return dataclasses.replace(self, **changes)

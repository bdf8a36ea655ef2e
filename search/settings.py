"""How a search runs, as one object from decode.py's flags or a training config to the
batch loop and the compiled programs.

    settings = SearchSettings(beam_size=4, alpha=0.6, n_best=2, batch_tokens=512)
    hyps = translate_ids(model, sources, settings)       # search/translate.py
    rule = settings.rule(vocab_limit=None)               # search/beam.py's static part
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from attention_jax.data.plans import MIN_ROWS
from attention_jax.search import beam
from attention_jax.search.defaults import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_CONSTRAINT_TOKENS,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_MAX_CONSTRAINTS,
    DEFAULT_MIN_LENGTH,
    DEFAULT_STOP,
    default_batch_tokens,
)
from attention_jax.search.stages import Targets


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """A search's settings; every translator (live, exported, CTranslate2) has one.

    beam_size: K (1 = greedy search); alpha: the length-penalty exponent.
    n_best: hypotheses kept per source (<= beam_size), best first.
    length_penalty: "gnmt" or "average" (search/decoding.py `length_penalty`).
    stop: "bound" (exact) or "heuristic" (about half the steps; search/beam.py `Rule`).
    steps_per_check: steps between tests of the stopping condition (the same results
      for any value); None = the platform's (search/beam.py `steps_per_check`).
    batch_tokens: padded source tokens per batch (beam search holds K times as many);
      None = the platform's (search/defaults.py; `tokens_per_batch` resolves it).
    min_rows: the rows of every batch of an input of at most this many sources
      (data/plans.py `plan_translation`); every other batch is full.
    min_length: the fewest tokens before EOS (1: no empty translation; search/defaults.py).
    max_constraints, constraint_tokens: the most phrases a source may have to contain,
      and the most tokens of each (they size the search's arrays).
    """

    beam_size: int = DEFAULT_BEAM_SIZE
    alpha: float = DEFAULT_ALPHA
    n_best: int = 1
    length_penalty: str = DEFAULT_LENGTH_PENALTY
    stop: str = DEFAULT_STOP
    steps_per_check: int | None = None
    batch_tokens: int | None = None
    min_rows: int = MIN_ROWS
    min_length: int = DEFAULT_MIN_LENGTH
    max_constraints: int = DEFAULT_MAX_CONSTRAINTS
    constraint_tokens: int = DEFAULT_CONSTRAINT_TOKENS

    def __post_init__(self) -> None:
        # n_best, stop, length penalty, steps per check and min_length: the Rule's checks
        beam.Rule(
            self.beam_size,
            n_best=self.n_best,
            stop=self.stop,
            penalty=self.length_penalty,
            steps_per_check=1 if self.steps_per_check is None else self.steps_per_check,
            min_length=self.min_length,
        )
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")

    @property
    def tokens_per_batch(self) -> int:
        """batch_tokens, or the platform's default."""
        return default_batch_tokens() if self.batch_tokens is None else self.batch_tokens

    def rule(self, vocab_limit: int | None = None) -> beam.Rule:
        """search/beam.py's static settings: beam search that stops a source once its n_best
        best are final ("bound") or no live beam would beat them if it ended next
        ("heuristic"), or for beam_size 1 greedy search (the first hypothesis that ends),
        scored the same way; never emitting ids >= vocab_limit."""
        per = beam.steps_per_check() if self.steps_per_check is None else self.steps_per_check
        stop = "count" if self.beam_size == 1 else self.stop
        return beam.Rule(
            self.beam_size,
            self.n_best,
            stop,
            self.length_penalty,
            vocab_limit,
            per,
            self.min_length,
        )

    def targets(
        self,
        prefixes: Sequence[Sequence[int]] | None = None,
        constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> Targets | None:
        """The prefixes and constraints of some sources, sized by these settings (None:
        neither)."""
        if prefixes is None and constraints is None:
            return None
        return Targets(prefixes, constraints, self.max_constraints, self.constraint_tokens)

    def replace(self, **changes) -> SearchSettings:
        return dataclasses.replace(self, **changes)

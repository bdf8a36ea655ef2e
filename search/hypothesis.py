"""What every translator returns per source: its hypotheses, best first."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence

import numpy as np

from attention_jax import EOS_ID, PAD_ID

# Token-id lists (sources, or given translations); indices into them; per source its
# hypotheses (what a backend's translate and score return)
IdLists = Sequence[Sequence[int]]
Indices = Collection[int]


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One translation: output ids (no BOS, EOS or padding) and the search's score.

    score = log P(tokens + EOS | source) / lp(len), what beam search ranks by (gnmt:
    ((5 + len) / 6)^alpha, len counting EOS; search.decoding.length_penalty); greedy
    search (beam 1) is scored the same way. met: with constraints, whether it contains
    each of its source's phrases (None: no constraints). A given translation's score
    (search/likelihood.py) is log P(tokens + EOS | source) unnormalized, and
    token_log_probs holds each token's log-probability, EOS's last.
    """

    tokens: list[int]
    score: float
    met: tuple[bool, ...] | None = None
    token_log_probs: tuple[float, ...] | None = None


def hypotheses(
    tokens: np.ndarray, scores: np.ndarray, met: np.ndarray | None = None, phrases: int = 0
) -> list[Hypothesis]:
    """One source's [n_best, L] tokens and [n_best] scores -> its hypotheses, best first;
    met [n_best, Q]: which of its first `phrases` constraints each contains."""
    out = []
    for n, (row, score) in enumerate(zip(tokens.tolist(), scores.tolist(), strict=True)):
        if not math.isfinite(score):  # a slot the beam never filled
            continue
        end = row.index(EOS_ID) if EOS_ID in row else len(row)
        found = None if met is None else tuple(bool(x) for x in met[n, :phrases])
        out.append(Hypothesis([t for t in row[:end] if t != PAD_ID], float(score), found))
    return out


PerSource = list[list[Hypothesis]]

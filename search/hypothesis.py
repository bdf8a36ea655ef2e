"""What every translator returns per source: its hypotheses, best first."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from model import EOS_ID, PAD_ID


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One translation: output ids (no BOS, EOS or padding) and the search's score.

    score = log P(tokens + EOS | source) / lp(len), what beam search ranks by (gnmt:
    ((5 + len) / 6)^alpha, len counting EOS; model.decoding.length_penalty); greedy
    search (beam 1) is scored the same way.
    """

    tokens: list[int]
    score: float


def hypotheses(tokens: np.ndarray, scores: np.ndarray) -> list[Hypothesis]:
    """One source's [n_best, L] tokens and [n_best] scores -> its hypotheses, best first."""
    out = []
    for row, score in zip(tokens.tolist(), scores.tolist(), strict=True):
        if not math.isfinite(score):  # a slot the beam never filled
            continue
        end = row.index(EOS_ID) if EOS_ID in row else len(row)
        out.append(Hypothesis([t for t in row[:end] if t != PAD_ID], float(score)))
    return out

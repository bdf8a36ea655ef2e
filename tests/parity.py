"""Two implementations of one search, compared as the parity tests compare them: every
line identical, or a near-tie the model itself cannot decide.

    ties = NearTies(model, penalty="average", alpha=1.0)
    result = ties.compare(sources, ours, theirs, search="beam")  # hypotheses per line
    assert result.ok, result.report()

Where two lines differ, both outputs are scored by our model (a forward pass in
float32, as the searches score): for beam search, each whole hypothesis by the
search's own ranking, log P(tokens + EOS) / lp(len); for greedy search, the two
tokens at the first position where they diverge, given the prefix they share. The
line is a near-tie when the two scores are within `tol` of each other, under the
ranking of either implementation (`conventions`: CTranslate2 takes its softmax over
the tokens it may emit, ours over all of them). Anything else is a difference, and
fails however few lines it touches: a bound such as "95% of lines" sits on a near-tie
count that another CPU's kernels move (tests/parity.py's tests, docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_jax import BOS_ID, EOS_ID, PAD_ID
from attention_jax.search.scoring import length_penalty

# How close two scores (log-probabilities, or their length-normalized means) must be
# for the model not to tell them apart: float32 searches of one model in two
# implementations differ by ~1e-5 per token, so this leaves 10x room for a 50-token
# hypothesis and never calls a real preference a tie (the digit model's scores differ
# by 0.05-5 between its candidates).
TIE = 5e-3


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logp(graphdef, state, src, tgt_in):
    """log-softmax of the logits: src [B, S], tgt_in [B, T] -> [B, T, V] float32."""
    return jax.nn.log_softmax(nnx.merge(graphdef, state)(src, tgt_in), axis=-1)


def source_ids(tokenizer: Any, data: bytes, max_length: int) -> list[list[int]]:
    """Each line of an input file's bytes as decode.py encodes it: its ids, cut to
    max_length - 1, then EOS (an empty line: no ids)."""
    from attention_jax.inference.lines import encode_lines

    lines = data.decode("utf-8", errors="replace").split("\n")[:-1]
    lines = [line.rstrip("\r") for line in lines]
    _, per_line, _ = encode_lines(tokenizer, lines, max_length, False)
    return [[*ids, EOS_ID] if ids else [] for ids in per_line]


@dataclasses.dataclass
class Line:
    """One line's verdict: "same", "tie" (with the gap and where) or "different"."""

    index: int
    verdict: str
    gap: float = 0.0
    detail: str = ""


@dataclasses.dataclass
class Result:
    lines: list[Line]

    @property
    def ok(self) -> bool:
        return all(line.verdict != "different" for line in self.lines)

    def count(self, verdict: str) -> int:
        return sum(line.verdict == verdict for line in self.lines)

    def report(self) -> str:
        bad = [line for line in self.lines if line.verdict == "different"]
        head = (
            f"{self.count('same')} identical, {self.count('tie')} near-ties, "
            f"{len(bad)} different of {len(self.lines)} lines"
        )
        return "\n".join([head, *(f"  line {x.index}: gap {x.gap:.4g} {x.detail}" for x in bad)])


@dataclasses.dataclass
class NearTies:
    """Our model's scores of two searches' outputs (see the module docstring).

    model: the Transformer both implementations run (ours, or the one CTranslate2
      converted). penalty, alpha: the length penalty the searches rank by.
    suppressed: token ids the other implementation may never emit (CTranslate2:
      <pad>, <s>): its ranking takes the softmax over the others.
    """

    model: Any
    penalty: str = "gnmt"
    alpha: float = 0.6
    suppressed: Sequence[int] = (PAD_ID, BOS_ID)
    tol: float = TIE

    def _logps(self, src: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """[len(tokens) + 1, V] float64: log P(next | prefix) at each position, EOS last."""
        width = 1 << max(len(src) - 1, 1).bit_length()  # few compiled shapes
        length = 1 << len(tokens).bit_length()
        s = np.zeros((1, width), np.int32)
        s[0, : len(src)] = src
        t = np.zeros((1, length), np.int32)
        t[0, : len(tokens) + 1] = [BOS_ID, *tokens]
        out = _logp(*nnx.split(self.model), jnp.asarray(s), jnp.asarray(t))
        return np.asarray(out[0, : len(tokens) + 1], np.float64)

    def _scores(
        self, src: Sequence[int], tokens: Sequence[int], skip: int = 0
    ) -> tuple[float, float]:
        """(ours, the other's) ranking score of a whole hypothesis; its first `skip` tokens
        (a prefix, forced) count in its length only."""
        logp = self._logps(src, tokens)
        picked = logp[np.arange(len(tokens) + 1), [*tokens, EOS_ID]]
        picked[:skip] = 0.0
        kept = np.log1p(-np.exp(logp[:, list(self.suppressed)]).sum(axis=1))  # [T+1]
        lp = float(length_penalty(len(tokens) + 1, self.alpha, self.penalty))
        return picked.sum() / lp, (picked - kept).sum() / lp

    def _line(
        self, i: int, src, a: Sequence[int], b: Sequence[int], search: str, skip: int = 0
    ) -> Line:
        if list(a) == list(b):
            return Line(i, "same")
        if search == "greedy":  # the first token where they part, after the prefix they share
            t = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            t = min(len(a), len(b)) if t is None else t
            logp = self._logps(src, a[:t])[t]
            x, y = ([*a, EOS_ID][t], [*b, EOS_ID][t])
            gap = abs(logp[x] - logp[y])
            detail = f"at token {t}: {x} vs {y}"
        else:
            (a_ours, a_other) = self._scores(src, a, skip)
            (b_ours, b_other) = self._scores(src, b, skip)
            gap = min(abs(a_ours - b_ours), abs(a_other - b_other))
            detail = f"scores {a_ours:.5f} vs {b_ours:.5f} ({a_other:.5f} vs {b_other:.5f})"
        return Line(i, "tie" if gap <= self.tol else "different", float(gap), detail)

    def compare(
        self,
        sources: Sequence[Sequence[int]],
        ours: Sequence[Sequence[Sequence[int]]],
        theirs: Sequence[Sequence[Sequence[int]]],
        search: str = "beam",
        prefixes: Sequence[Sequence[int]] | None = None,
    ) -> Result:
        """Per line i, its hypotheses' tokens in both (best first; n-best lists compared
        rank by rank): identical, a near-tie, or different. sources[i]: line i's source ids
        (EOS-terminated), as both translated it; prefixes[i]: the start both were given
        (it counts in the length, not in the score)."""
        if search not in ("beam", "greedy"):
            raise ValueError(f"search must be beam or greedy, got {search!r}")
        lines = []
        for i, (src, a, b) in enumerate(zip(sources, ours, theirs, strict=True)):
            if len(a) != len(b):
                lines.append(Line(i, "different", float("inf"), f"{len(a)} vs {len(b)} hyps"))
                continue
            skip = len(prefixes[i]) if prefixes is not None else 0
            verdicts = [self._line(i, src, x, y, search, skip) for x, y in zip(a, b, strict=True)]
            rank = lambda v: ("same", "tie", "different").index(v.verdict)
            lines.append(max(verdicts, key=rank, default=Line(i, "same")))  # none: an empty line
        return Result(lines)

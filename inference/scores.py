"""decode.py --score: given translations scored by the model, one JSON object per line.

    pairs = encode_pairs(tokenizer, lines, given_lines, max_length=256, max_len=256)
    done = score_segments(translator, pairs)              # a Translated, as translating gives
    format_lines(done.hypotheses, "scores")               # {"score", "token_log_probs", "tokens"}

Line i of the --score file is a translation of input line i. Its score is log P(its
tokens + EOS | the source), natural log, unnormalized, and token_log_probs holds one
log-probability per target token, EOS's last (search/likelihood.py), so that a corpus
is filtered by either (docs/decoding.md). The source is cut at max_length tokens as
for translating, the translation at the model's max_len; each cut counts as a long
line. An empty source line has nothing to score: its object has a null score and
empty lists. Every backend scores (the live model, an export, CTranslate2's
score_batch), in batches by a token budget on every device, streamed and resumed as
translation is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from attention_jax import EOS_ID
from attention_jax.inference.lines import Segment, Translated, encode_lines
from attention_jax.inference.targets import same_count
from attention_jax.search import timing
from attention_jax.search.hypothesis import Hypothesis
from attention_jax.search.translate import Backend, Progress


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
    """Lines and their given translations as the model scores them: a segment per line
    with a source (its ids + EOS), that line's translation (ids + EOS) beside it."""

    segments: list[Segment]
    given: list[list[int]]  # per segment
    line_tokens: list[list[int]]  # per line, its (possibly cut) source ids
    num_long: int  # sources cut, plus translations cut


def encode_pairs(
    tokenizer: Any,
    lines: Sequence[str],
    given_lines: Sequence[str],
    *,
    max_length: int,
    max_len: int,
    first_line: int = 1,
) -> EncodedPairs:
    """Sources with the source side's tokenizer (cut at max_length - 1 tokens), their
    translations with the target side's (cut at max_len - 1 tokens), each then EOS.
    UserError if `given_lines` has another count (naming the line where they part)."""
    same_count(lines, given_lines, "--score", first_line)
    segments, line_tokens, num_long = encode_lines(tokenizer, lines, max_length, split=False)
    targets = tokenizer.encode_target_batch([g.strip() for g in given_lines])
    given = []
    for segment in segments:
        ids = targets[segment.line]
        if len(ids) + 1 > max_len:
            num_long += 1
            ids = ids[: max_len - 1]
        given.append([*ids, EOS_ID])
    return EncodedPairs(segments, given, line_tokens, num_long)


def score_segments(
    translator: Backend,
    pairs: EncodedPairs,
    progress: Progress | None = None,
    known: dict[int, list[Hypothesis]] | None = None,
) -> Translated:
    """The pairs scored, as `translate_segments` gives translations: per line [its dict:
    score, token_log_probs, tokens] ([] for an empty source). progress(indices,
    results) per batch; known: segments scored before (a resumed chunk's journal)."""
    known = known or {}
    with timing.phase("search"):
        ids = [s.ids for s in pairs.segments]
        found = translator.score(ids, pairs.given, progress, skip=known.keys())
    for i, hyps in known.items():
        found[i] = hyps
    per_line: list[list[dict[str, Any]]] = [[] for _ in pairs.line_tokens]
    for segment, hyps in zip(pairs.segments, found, strict=True):
        if not hyps:  # another process's journal held it (process 0 writes the output)
            continue
        hyp = hyps[0]
        logp = list(hyp.token_log_probs or ())
        per_line[segment.line] = [{"score": hyp.score, "token_log_probs": logp,
                                   "tokens": hyp.tokens}]  # fmt: skip
    return Translated(per_line, list(pairs.segments), found, pairs.line_tokens)

"""decode.py --long_lines=sentences: a line cut into sentences, each translated alone.

    split = sentence_splitter("de")
    split("Das Haus ist alt. Der Hund bellt!")   # ['Das Haus ist alt.', 'Der Hund bellt!']

A line that holds a paragraph is translated sentence by sentence (inference/lines.py
`encode_lines`), and the translations are joined with a space into one output line,
so a model trained on sentences never sees more than one, and the output keeps one
line per input line. The segmenter is sentencex (Wikimedia's; rules and abbreviation
lists for many languages, with fallbacks between related ones), chosen by the source
language: --source_lang, or the workdir's config.source_lang.

A line's prefix is its first sentence's. Each of its --constraints phrases must be
met once in the line: `share_phrases` gives it to the one sentence whose source makes
it likeliest (the model's log-probability of the phrase's tokens as the start of that
sentence's translation; the first sentence on a tie), and `phrases_met` reports, per
phrase of the line, whether the joined translation holds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from attention_jax import EOS_ID
from attention_jax.inference import processes
from attention_jax.inference.targets import EncodedLines
from attention_jax.runtime.errors import UserError


def sentence_splitter(language: str) -> Callable[[str], list[str]]:
    """text -> its sentences, stripped, none empty (UserError without sentencex)."""
    try:
        import sentencex
    except ImportError as e:
        raise UserError(
            "--long_lines=sentences needs sentencex: pip install 'attention-jax[translate]'"
        ) from e

    def split(text: str) -> list[str]:
        return [s.strip() for s in sentencex.segment(language, text) if s.strip()]

    return split


def splitter_for(
    long_lines: str, source_lang: str | None, config: Any = None
) -> Callable[[str], list[str]] | None:
    """For long_lines "sentences": the splitter of `source_lang`, or of a workdir's
    config.source_lang (UserError without either); None for the other modes."""
    if long_lines != "sentences":
        return None
    language = source_lang or (config.get("source_lang") if config is not None else None)
    if not language:
        raise UserError("--long_lines=sentences: give --source_lang (the input's language)")
    return sentence_splitter(language)


def share_phrases(translator: Any, encoded: EncodedLines) -> EncodedLines:
    """`encoded` with each phrase of a line of several segments given to one of them (see
    the module docstring); lines of one segment keep theirs. Process 0's choice holds
    on every process, so that all of them run the same batches."""
    targets, phrases = encoded.targets, encoded.phrases
    if targets is None or targets.constraints is None or phrases is None:
        return encoded
    by_line: dict[int, list[int]] = {}
    for j, segment in enumerate(encoded.segments):
        by_line.setdefault(segment.line, []).append(j)
    asks = [(line, q, j) for line, js in by_line.items() if len(js) > 1
            for q in range(len(phrases[line])) for j in js]  # fmt: skip
    if not asks:
        return encoded
    scored = translator.score(
        [encoded.segments[j].ids for _, _, j in asks],
        [[*phrases[line][q], EOS_ID] for line, q, _ in asks],
    )
    best: dict[tuple[int, int], tuple[float, int]] = {}  # (line, phrase) -> (value, segment)
    for (line, q, j), (found,) in zip(asks, scored, strict=True):
        value = sum(found.token_log_probs[:-1])  # the phrase's tokens, not its EOS
        if (line, q) not in best or value > best[line, q][0]:
            best[line, q] = (value, j)
    # [line, phrase, segment] in the line's order (lists: process 0's go through JSON)
    chosen = processes.from_main(sorted([line, q, j] for (line, q), (_, j) in best.items()))
    constraints = [list(c) for c in targets.constraints]
    for js in by_line.values():
        for j in js if len(js) > 1 else ():
            constraints[j] = []
    for line, q, j in chosen:
        constraints[j].append(phrases[line][q])
    return dataclasses.replace(
        encoded, targets=dataclasses.replace(targets, constraints=constraints)
    )


def phrases_met(hypotheses: list[list[dict[str, Any]]], encoded: EncodedLines) -> None:
    """For each line of several segments with phrases: its hypotheses' constraints_met,
    per phrase of the line in its order, whether the joined tokens hold it."""
    if encoded.phrases is None:
        return
    count: dict[int, int] = {}
    for segment in encoded.segments:
        count[segment.line] = count.get(segment.line, 0) + 1
    for line, n in count.items():
        if n < 2:
            continue
        for h in hypotheses[line]:
            h["constraints_met"] = [_holds(h["tokens"], p) for p in encoded.phrases[line]]


def _holds(tokens: list[int], phrase: list[int]) -> bool:
    n = len(phrase)
    return any(tokens[i : i + n] == phrase for i in range(len(tokens) - n + 1))

"""decode.py --prefix and --constraints: per input line, what its translation must hold.

    prefixes, phrases = encode_targets(tokenizer, lines, prefix_lines, constraint_lines,
                                       first_line=1, settings=settings)
    chunk = encode_chunk(tokenizer, lines, prefix_lines, constraint_lines, max_length=256,
                         split=False, settings=settings)    # segments, their targets

Line i of --prefix is the start translation i must have (empty: none); line i of
--constraints holds the phrases it must contain, separated by tabs (fairseq's
convention; empty: none). Both files have one line per input line and are read a
chunk at a time beside the input (inference/stream.py). Each is encoded with the
target side's tokenizer; anything a search cannot honour is one UserError that names
the line and the flag to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from attention_jax.inference.lines import LineReader, Segment, encode_lines
from attention_jax.runtime.errors import UserError
from attention_jax.search.scoring import prefix_room
from attention_jax.search.settings import SearchSettings
from attention_jax.search.stages import Targets


def split_phrases(line: str) -> list[str]:
    """A --constraints line -> its phrases: split at tabs, stripped, empty ones dropped."""
    return [p.strip() for p in line.split("\t") if p.strip()]


def encode_targets(
    tokenizer: Any,
    lines: Sequence[str],
    prefix_lines: Sequence[str] | None,
    constraint_lines: Sequence[str] | None,
    *,
    first_line: int,
    settings: SearchSettings,
) -> tuple[list[list[int]] | None, list[list[list[int]]] | None]:
    """(per line its prefix ids, per line its phrases' ids), None for a file not given.

    lines: the input lines of a chunk (its first is line `first_line` of the input, for
    the messages); an empty input line gets no translation, so its prefix and
    phrases are not looked at.
    """
    prefixes = phrases = None
    if prefix_lines is not None:
        same_count(lines, prefix_lines, "--prefix", first_line)
        prefixes = tokenizer.encode_target_batch([p.strip() for p in prefix_lines])
    if constraint_lines is not None:
        same_count(lines, constraint_lines, "--constraints", first_line)
        split = [split_phrases(line) for line in constraint_lines]
        flat = tokenizer.encode_target_batch([p for ps in split for p in ps])
        phrases, at = [], 0
        for n, (line, ps) in enumerate(zip(lines, split, strict=True)):
            ids, at = flat[at : at + len(ps)], at + len(ps)
            if line.strip():
                _check_phrases(ps, ids, first_line + n, settings)
            phrases.append(ids)
    return prefixes, phrases


@dataclasses.dataclass(frozen=True)
class EncodedLines:
    """Lines as the search takes them: their segments (inference/lines.py), each line's
    token ids, how many were too long, and the segments' prefixes and phrases."""

    segments: list[Segment]
    line_tokens: list[list[int]]
    num_long: int
    targets: Targets | None
    # per line, its prefix and phrases as decoded and as written, where they differ
    # (`user_texts`; None: nowhere)
    user: list[list[tuple[str, str, bool]]] | None = None
    phrases: list[list[list[int]]] | None = None  # per line, its phrases' ids


def encode_chunk(
    tokenizer: Any,
    lines: Sequence[str],
    prefix_lines: Sequence[str] | None,
    constraint_lines: Sequence[str] | None,
    *,
    max_length: int,
    split: bool,
    settings: SearchSettings,
    first_line: int = 1,
    sentences: Callable[[str], list[str]] | None = None,
) -> EncodedLines:
    """`lines` encoded into segments (a line longer than max_length truncated, or with
    `split` cut; with `sentences`, a segment per sentence), with the targets of their
    lines' prefixes and phrases: a line's prefix and phrases are its first segment's
    (`split` is refused with them; inference/sentences.py `share_phrases` gives each
    phrase of a line of sentences to one of them). The one encoding of decode.py's
    chunks and of the library's `Translator`."""
    segments, line_tokens, num_long = encode_lines(tokenizer, lines, max_length, split, sentences)
    if prefix_lines is None and constraint_lines is None:
        return EncodedLines(segments, line_tokens, num_long, None)
    prefixes, phrases = encode_targets(
        tokenizer, lines, prefix_lines, constraint_lines, first_line=first_line, settings=settings
    )
    first = lambda segment, x: x if segment.start == 0 else []  # a line's first segment
    pick = lambda per_line: (
        None if per_line is None else [first(s, per_line[s.line]) for s in segments]
    )
    targets = Targets.of(settings, pick(prefixes), pick(phrases))
    user = user_texts(tokenizer, prefix_lines, constraint_lines, prefixes, phrases)
    return EncodedLines(segments, line_tokens, num_long, targets, user, phrases)


def user_texts(
    tokenizer: Any,
    prefix_lines: Sequence[str] | None,
    constraint_lines: Sequence[str] | None,
    prefixes: list[list[int]] | None,
    phrases: list[list[list[int]]] | None,
) -> list[list[tuple[str, str, bool]]] | None:
    """Per line, (its text as the tokenizer decodes it, as the user wrote it, whether it
    is the prefix) for the prefix and each phrase the tokenizer normalizes (NFKC: '…'
    becomes '...', 'ｏｎｅ' 'one'); None if none is normalized. `keep_user_texts` puts the
    user's text back into the translations."""
    count = len(prefix_lines if prefix_lines is not None else constraint_lines or [])
    out: list[list[tuple[str, str, bool]]] = [[] for _ in range(count)]
    for i, (line, ids) in enumerate(zip(prefix_lines or [], prefixes or [], strict=True)):
        written = line.strip()
        if written and (decoded := tokenizer.decode(ids)) != written:
            out[i].append((decoded, written, True))
    for i, (line, ids) in enumerate(zip(constraint_lines or [], phrases or [], strict=True)):
        for written, phrase in zip(split_phrases(line), ids, strict=True):
            if (decoded := tokenizer.decode(phrase)) and decoded != written:
                out[i].append((decoded, written, False))
    return out if any(out) else None


def keep_user_texts(
    hypotheses: list[list[dict[str, Any]]], user: list[list[tuple[str, str, bool]]] | None
) -> None:
    """In each line's hypotheses' texts, the prefix and phrases as the user wrote them
    (`user_texts`): a prefix where the text starts with its decoded form, a phrase
    wherever its decoded form occurs."""
    for line, pairs in zip(hypotheses, user or [], strict=False):
        for h in line:
            text = h["text"]
            for decoded, written, at_start in pairs:
                if not at_start:
                    text = text.replace(decoded, written)
                elif text.startswith(decoded):
                    text = written + text[len(decoded) :]
            h["text"] = text


def same_count(lines: Sequence[str], other: Sequence[str], flag: str, first_line: int) -> None:
    if len(other) != len(lines):
        end = first_line + min(len(lines), len(other))
        raise UserError(
            f"{flag} has {'fewer' if len(other) < len(lines) else 'more'} lines than the "
            f"input (they part at line {end}): give one line per input line"
        )


def _check_phrases(
    phrases: list[str], ids: list[list[int]], line: int, settings: SearchSettings
) -> None:
    if len(phrases) > settings.max_constraints:
        raise UserError(
            f"--constraints line {line} has {len(phrases)} phrases, more than "
            f"--max_constraints={settings.max_constraints}"
        )
    for phrase, tokens in zip(phrases, ids, strict=True):
        if not tokens:
            raise UserError(f"--constraints line {line}: {phrase!r} encodes to no tokens")
        if len(tokens) > settings.constraint_tokens:
            raise UserError(
                f"--constraints line {line}: {phrase!r} is {len(tokens)} tokens, more than "
                f"--constraint_tokens={settings.constraint_tokens}"
            )


def check_files(
    tokenizer: Any,
    input_path: str,
    prefix_path: str | None,
    constraints_path: str | None,
    *,
    max_length: int,
    max_len: int,
    settings: SearchSettings,
    chunk: int = 10_000,
    sentences: Callable[[str], list[str]] | None = None,
) -> None:
    """Every line of --prefix and --constraints as the search will take it, before anything
    is written (UserError for the first bad one): one pass over the files, a chunk at a
    time. A prefix must leave its translation room for EOS: at most min(source tokens +
    50, max_len) - 1 tokens."""
    readers = [LineReader(p) if p else None for p in (input_path, prefix_path, constraints_path)]
    try:
        first = 1
        while lines := readers[0].read(chunk)[0]:
            more = [r.read(len(lines))[0] if r is not None else None for r in readers[1:]]
            prefixes, _ = encode_targets(
                tokenizer, lines, *more, first_line=first, settings=settings
            )
            if prefixes is not None:  # the room of each line's first segment
                segments, per_line, _ = encode_lines(tokenizer, lines, max_length, False, sentences)
                sources = [[] for _ in per_line]
                for segment in reversed(segments):
                    sources[segment.line] = segment.ids[:-1]
                for n, (ids, prefix) in enumerate(zip(sources, prefixes, strict=True)):
                    room = prefix_room(len(ids) + 1, max_len)  # its ids, then EOS
                    if ids and len(prefix) > room:
                        raise UserError(
                            f"--prefix line {first + n} is {len(prefix)} tokens, more than the "
                            f"{room} the translation of its source may have"
                        )
            first += len(lines)
    finally:
        for r in readers:
            if r is not None:
                r.close()

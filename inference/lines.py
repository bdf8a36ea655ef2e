"""Lines of text in, lines of translations out: reading, writing, and what a line becomes.

    lines, bad = read_lines("test.de")                      # split on '\\n' only
    segments, line_tokens, num_long = encode_lines(tokenizer, lines, 256, split=False)
    done = translate_segments(translator, tokenizer, segments, line_tokens)
    write_lines("test.en", format_lines(done.hypotheses, "text"))

Each step is a function of its inputs alone, so a driver that reads and writes a
file in chunks (inference/stream.py: `LineReader` for the lines, search/bleu.py's
`CorpusScores` for BLEU/chrF) calls them once per chunk. A line is encoded into one segment
(ids + EOS), or into several when it is longer than `max_length` and `split` is
asked for (else it is truncated); its translation joins its segments' ones.
Bad input never shifts lines: an empty or whitespace-only line gives no
hypotheses (an empty text line, or an object with an empty list in jsonl).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from attention_jax import EOS_ID
from attention_jax.data import atomic_write
from attention_jax.search import timing
from attention_jax.search.hypothesis import Hypothesis
from attention_jax.search.stages import Targets
from attention_jax.search.translate import Backend, Progress


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of one input line, as translated: ids [*line tokens[start:...], EOS]."""

    line: int  # index of its line
    start: int  # index in the line's tokens of its first token
    ids: list[int]


@dataclasses.dataclass
class Translated:
    """Lines translated: per line its hypotheses (dicts: text, score, tokens), best first,
    and what they came from (for alignments and plots)."""

    hypotheses: list[list[dict[str, Any]]]
    segments: list[Segment]
    search: list[list[Hypothesis]]  # per segment
    line_tokens: list[list[int]]  # per line, its (possibly truncated) token ids


def read_lines(path: str) -> tuple[list[str], int]:
    """Lines of `path` ('-' = stdin) split on '\\n' only, and how many had invalid UTF-8.

    str.splitlines would also split on \\x0b, \\x1c, U+2028, ... and shift lines.
    Raises OSError if the file cannot be read. `LineReader` reads the same lines a
    chunk at a time.
    """
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()  # the newline that ends the last line starts no new line
    lines, bad = [], 0
    for b in raw:
        line, invalid = decode_line(b)
        lines.append(line)
        bad += invalid
    return lines, bad


def decode_line(raw: bytes) -> tuple[str, bool]:
    """One line's bytes (without its '\\n') as text, a trailing '\\r' dropped; and whether
    it had invalid UTF-8 (replaced with U+FFFD)."""
    try:
        line, invalid = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        line, invalid = raw.decode("utf-8", errors="replace"), True
    return line.removesuffix("\r"), invalid


class LineReader:
    """The lines `read_lines` gives, read `n` at a time from byte `offset` of a file.

        reader = LineReader("corpus.de")
        lines, bad = reader.read(10_000)   # [] at the end; reader.offset: bytes consumed
        reader = LineReader("corpus.de", offset=saved)   # on again where a job stopped

    Memory holds one chunk of lines, whatever the file's size. '-' reads stdin
    (offset 0 only). Raises OSError if the file cannot be read.
    """

    def __init__(self, path: str, offset: int = 0):
        self._file = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
        self._owned = path != "-"
        if offset:
            self._file.seek(offset)
        self.offset = offset

    def read(self, n: int) -> tuple[list[str], int]:
        """(up to n lines, how many of them had invalid UTF-8)."""
        lines, bad = [], 0
        while len(lines) < n:
            raw = self._file.readline()  # binary: ends at b"\n" only
            if not raw:
                break
            self.offset += len(raw)
            line, invalid = decode_line(raw.removesuffix(b"\n"))
            lines.append(line)
            bad += invalid
        return lines, bad

    def close(self) -> None:
        if self._owned:
            self._file.close()


def count_lines(path: str, block: int = 1 << 20) -> int:
    """How many lines `read_lines` finds in the file at `path`, in constant memory."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while data := f.read(block):
            count += data.count(b"\n")
            last = data[-1:]
    return count + (last != b"\n")  # a last line without its newline counts


def write_lines(path: str, lines: Sequence[str]) -> None:
    """One line each ('-' = stdout); a file is replaced only once it is complete.

    Raises OSError if the file cannot be written.
    """
    text = output_text(lines)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    with atomic_write(path, "w") as f:
        f.write(text)


def output_text(lines: Sequence[str]) -> str:
    """Lines as written: each ends with '\\n' (a newline inside a line becomes a space)."""
    return "".join(line.replace("\n", " ") + "\n" for line in lines)


def encode_lines(
    tokenizer: Any,
    lines: Sequence[str],
    max_length: int,
    split: bool,
    sentences: Callable[[str], list[str]] | None = None,
) -> tuple[list[Segment], list[list[int]], int]:
    """(segments to translate, each line's token ids, the number of long lines).

    A line of more than max_length - 1 tokens is truncated to them, or with
    `split` cut into segments of at most that many. With `sentences` (a line's text ->
    its sentences, inference/sentences.py), each line is first cut into sentences, a
    segment each (a sentence too long is cut as `split` cuts; it counts as long).
    """
    if sentences is None:
        pieces = [[line.strip()] for line in lines]
    else:
        pieces = [sentences(line.strip()) if line.strip() else [] for line in lines]
    flat = tokenizer.encode_batch([p for ps in pieces for p in ps])
    per_line, segments, long, at = [], [], 0, 0
    for i, ps in enumerate(pieces):
        parts, at = flat[at : at + len(ps)], at + len(ps)
        long += sum(len(ids) + 1 > max_length for ids in parts)
        if sentences is None and not split:
            parts = [ids[: max_length - 1] for ids in parts]
        line_ids: list[int] = []
        for ids in parts:
            for start in range(0, len(ids), max_length - 1):
                piece = [*ids[start : start + max_length - 1], EOS_ID]
                segments.append(Segment(i, len(line_ids) + start, piece))
            line_ids += ids
        per_line.append(line_ids)
    return segments, per_line, long


def line_hypotheses(
    tokenizer: Any, segments: Sequence[Segment], search: Sequence[list[Hypothesis]], num_lines: int
) -> list[list[dict[str, Any]]]:
    """Per line, its hypotheses as dicts (text, score, tokens), best first.

    A line cut into several segments has as many hypotheses as its segment with
    the fewest; hypothesis k joins the segments' k-th ones (texts with a space,
    tokens end to end, scores added up).
    """
    parts: list[list[list[Hypothesis]]] = [[] for _ in range(num_lines)]
    for segment, hyps in zip(segments, search, strict=True):
        parts[segment.line].append(hyps)
    out = []
    for segs in parts:
        ranks = min((len(h) for h in segs), default=0)
        line = []
        for k in range(ranks):
            hs = [h[k] for h in segs]
            entry = {
                "text": " ".join(tokenizer.decode(h.tokens) for h in hs),
                "score": sum(h.score for h in hs),
                "tokens": [t for h in hs for t in h.tokens],
            }
            if hs[0].met is not None:  # --constraints: which of the line's phrases it holds
                entry["constraints_met"] = list(hs[0].met)
            line.append(entry)
        out.append(line)
    return out


def translate_segments(
    translator: Backend,
    tokenizer: Any,
    segments: Sequence[Segment],
    line_tokens: list[list[int]],
    progress: Progress | None = None,
    known: dict[int, list[Hypothesis]] | None = None,
    targets: Targets | None = None,
) -> Translated:
    """Translate the segments of `encode_lines`; `progress(indices, hypotheses)` per batch
    (search/stages.py `Progress`, indices into `segments`). known: segments translated
    before (a resumed chunk's journal), given their hypotheses instead of translated.
    targets: the segments' prefixes and constraints."""
    known = known or {}
    with timing.phase("search"):
        ids = [s.ids for s in segments]
        search = translator.translate(ids, progress, skip=known.keys(), targets=targets)
    for i, hyps in known.items():
        search[i] = hyps
    with timing.phase("detokenize"):
        hypotheses = line_hypotheses(tokenizer, segments, search, len(line_tokens))
    return Translated(hypotheses, list(segments), search, line_tokens)


def format_lines(hypotheses: Sequence[list[dict[str, Any]]], output_format: str) -> list[str]:
    """What is printed per line: the best text ("text"), all hypotheses ("jsonl"), or
    a given translation's score (decode.py --score: "scores", inference/scores.py)."""
    if output_format == "scores":  # an empty source: a null score
        unscored = {"score": None, "token_log_probs": [], "tokens": []}
        return [json.dumps(line[0] if line else unscored) for line in hypotheses]
    if output_format == "jsonl":
        return [json.dumps({"hypotheses": line}, ensure_ascii=False) for line in hypotheses]
    return best_texts(hypotheses)


def best_texts(hypotheses: Sequence[list[dict[str, Any]]]) -> list[str]:
    """Each line's best translation ('' for a line without hypotheses)."""
    return [line[0]["text"] if line else "" for line in hypotheses]

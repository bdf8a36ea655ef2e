"""Progress of a translation job on stderr: lines done, lines/s, tokens/s, ETA; and its
warnings (`warn`).

    meter = Meter(total=1_000_000, done=30_000)     # 30k lines done by an earlier run
    meter.start_chunk(lines=10_000, segments=10_012)
    meter.batch(sentences=256, tokens=3_900)        # search.translate.Progress
    meter.end_chunk()
    meter.close()

A bar (tqdm) when stderr is a terminal; otherwise, for logs, one line every
`every` seconds:

    decode.py: 40000/1000000 lines (4.0%), 45.2 lines/s, 612 tokens/s, ETA 5:53:58

Rates count this run only (lines an earlier run did are not its speed). Within
a chunk, lines advance with its segments translated (a chunk's lines are
written when all of its batches are done).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def warn(msg: str) -> None:
    """A warning of decode.py's job, as one `warning: ...` line on stderr."""
    print(f"warning: {msg}", file=sys.stderr)


def format_eta(seconds: float) -> str:
    """H:MM:SS."""
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def progress_line(done: float, total: int | None, lines_s: float, tokens_s: float) -> str:
    """One progress line: lines done (of total), rates, and the ETA when the total is known."""
    text = f"decode.py: {int(done)}"
    if total:
        text += f"/{total} lines ({100 * done / total:.1f}%)"
    else:
        text += " lines"
    text += f", {lines_s:.1f} lines/s, {tokens_s:.0f} tokens/s"
    if total and lines_s > 0:
        text += f", ETA {format_eta((total - done) / lines_s)}"
    return text


class Meter:
    """Counts a job's progress and shows it on `stream` (a bar on a terminal, else lines)."""

    def __init__(
        self,
        total: int | None,
        done: int = 0,
        *,
        stream: TextIO | None = None,
        every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        bar: bool | None = None,
    ):
        self.total, self.stream, self.every, self.clock = total, stream or sys.stderr, every, clock
        self.start_done = self.done = done  # lines
        self.tokens = 0  # output tokens this run
        self.start = self.last_print = clock()
        self._chunk = (0, 1)  # (lines, segments) of the chunk being translated
        self._chunk_segments = 0
        use_bar = self.stream.isatty() if bar is None else bar
        self._bar: Any = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=done, unit="line", file=self.stream, dynamic_ncols=True
            )

    def _lines(self) -> float:
        """Lines done, counting the translated share of the current chunk."""
        lines, segments = self._chunk
        return self.done + lines * min(self._chunk_segments / max(segments, 1), 1.0)

    def rates(self) -> tuple[float, float]:
        """(lines/s, tokens/s) of this run so far."""
        seconds = max(self.clock() - self.start, 1e-9)
        return (self._lines() - self.start_done) / seconds, self.tokens / seconds

    def start_chunk(self, lines: int, segments: int) -> None:
        self._chunk, self._chunk_segments = (lines, segments), 0

    def batch(self, sentences: int, tokens: int) -> None:
        """A batch of `sentences` segments and `tokens` output tokens is done."""
        self._chunk_segments += sentences
        self.tokens += tokens
        self._show()

    def skip(self, sentences: int) -> None:
        """`sentences` segments of the chunk an earlier run translated (not this run's pace)."""
        lines, segments = self._chunk
        self._chunk_segments += sentences
        self.start_done += lines * sentences / max(segments, 1)

    def write(self, text: str) -> None:
        """A line of news between progress lines (or above the bar)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream)

    def end_chunk(self) -> None:
        self.done += self._chunk[0]
        self._chunk, self._chunk_segments = (0, 1), 0
        self._show()

    def _show(self) -> None:
        lines_s, tokens_s = self.rates()
        if self._bar is not None:
            self._bar.n = int(self._lines())
            self._bar.set_postfix(tok_s=f"{tokens_s:.0f}", refresh=False)
            self._bar.refresh()
        elif self.clock() - self.last_print >= self.every:
            self.last_print = self.clock()
            print(progress_line(self._lines(), self.total, lines_s, tokens_s), file=self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

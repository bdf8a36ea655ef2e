"""decode.py's loop: an input translated a chunk at a time, in bounded memory.

    job = StreamJob(translator, tokenizer, LineReader("big.de"), read_lines=10_000, ...)
    totals = translate_stream(job, open_output("big.en", record_job, restart=False), meter)

Each chunk: `read_lines` lines are read, encoded (inference/lines.py), handed to
the `Backend` as one list (which sorts them by length into batches of a few
static shapes, data/plans.py), joined back into lines, given alignments and
plots if asked, formatted and appended to the output in input order, with the
record of everything counted so far (`Totals`). The next chunk is read and
encoded in a thread of its own while one is translated, and the programs its
batches need start compiling or loading then (`LiveTranslator.prepare`), so
memory holds at most two chunks' lines and one chunk's translations; BLEU and
chrF keep only their summed statistics (`CorpusScores`, in `Totals.scores`). Each
finished batch's results also go to the output's journal (inference/output.py), so
that a run killed mid-chunk loses only the batches in flight. An output that was
started by an earlier run of the same job goes on from its record
(inference/output.py): the readers start at the recorded offsets and the counters
at the recorded values, so the finished file and summary are those of one
uninterrupted run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from attention_jax import Transformer
from attention_jax.inference import processes
from attention_jax.inference.alignment import add_alignments
from attention_jax.inference.lines import (
    Translated,
    best_texts,
    format_lines,
    output_text,
    translate_segments,
)
from attention_jax.inference.output import Journal
from attention_jax.inference.plots import plot_lines
from attention_jax.inference.progress import Meter
from attention_jax.inference.scores import EncodedPairs, encode_pairs, score_segments
from attention_jax.inference.sentences import phrases_met, share_phrases
from attention_jax.inference.targets import EncodedLines, encode_chunk, keep_user_texts
from attention_jax.runtime.errors import UserError
from attention_jax.search import timing
from attention_jax.search.bleu import CorpusScores
from attention_jax.search.hypothesis import Hypothesis
from attention_jax.search.stages import output_tokens
from attention_jax.search.translate import Backend, Progress


class Reader(Protocol):
    """Lines in chunks: `read(n)` -> (up to n lines, how many had invalid UTF-8); `offset`
    is where the next chunk starts (bytes of a file, or lines of a list)."""

    offset: int

    def read(self, n: int) -> tuple[list[str], int]: ...

    def close(self) -> None: ...


class ListReader:
    """Lines held in memory (a dataset split) as a `Reader`; the offset counts lines."""

    def __init__(self, lines: Sequence[str], offset: int = 0):
        self.lines, self.offset = lines, offset

    def read(self, n: int) -> tuple[list[str], int]:
        chunk = list(self.lines[self.offset : self.offset + n])
        self.offset += len(chunk)
        return chunk, 0

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Totals:
    """What a job has done so far: saved with each chunk, the summary and warnings at the end."""

    lines: int = 0
    input_offset: int = 0  # where the next chunk starts in the input ...
    reference_offset: int = 0  # ... and in the references
    prefix_offset: int = 0  # ... in --prefix
    constraints_offset: int = 0  # ... in --constraints
    score_offset: int = 0  # ... in --score
    bad_utf8: int = 0  # lines with invalid UTF-8
    long: int = 0  # lines over max_length (truncated or split)
    empty: int = 0  # lines without a translation
    segments: int = 0  # sources translated (a split line has several)
    tokens: int = 0  # output tokens
    seconds: float = 0.0  # encoding and translating
    plots: int = 0  # attention plots written
    scores: dict[str, list[int]] | None = None  # CorpusScores.stats

    @classmethod
    def from_record(cls, done: dict[str, Any]) -> Totals:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in done.items() if k in fields})


@dataclasses.dataclass
class StreamJob:
    """What `translate_stream` needs: a translator and its tokenizer, the readers, and how
    lines are cut, written and looked at (decode.py's flags of the same names)."""

    translator: Backend
    tokenizer: Any
    source: Reader
    read_lines: int
    max_length: int  # longest source in tokens with EOS
    long_lines: str = "truncate"  # or "split", or "sentences" (with `sentences`)
    sentences: Callable[[str], list[str]] | None = None  # a line -> its sentences
    output_format: str = "text"
    references: Reader | None = None
    prefixes: Reader | None = None  # --prefix: line i, the start translation i must have
    constraints: Reader | None = None  # --constraints: line i, its phrases (tab-separated)
    given: Reader | None = None  # --score: line i, a translation of it, scored (not translated)
    model: Transformer | None = None  # the live model: alignments and plots
    alignment: bool = False
    plot_attention: str | None = None
    num_plots: int = 4


class Output(Protocol):
    """Where chunks go (inference/output.py): `done` is the record an earlier run left;
    `journal` (or None) keeps the running chunk's finished batches."""

    done: dict[str, Any]
    journal: Journal | None

    def append(self, data: bytes, done: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class _Read:
    """A chunk read and encoded: its lines, where the input goes on after it, its segments,
    and what their translations must hold, or their given translations (and where
    --prefix, --constraints and --score go on)."""

    lines: list[str]
    bad_utf8: int
    offset: int
    encoded: EncodedLines | EncodedPairs
    offsets: tuple[int, int, int] = (0, 0, 0)


def _read(job: StreamJob, first: int) -> _Read | None:
    """The next chunk (its first line is line `first` of the input), read and encoded, and
    its programs being prepared (in a thread of its own while the previous one is
    translated); None at the end of the input."""
    with timing.phase("read"):
        lines, bad_utf8 = job.source.read(job.read_lines)
    if not lines:
        return None
    offset = job.source.offset
    read = lambda reader: None if reader is None else reader.read(len(lines))[0]
    beside = (job.prefixes, job.constraints, job.given)
    if job.given is not None:
        with timing.phase("tokenize"):
            pairs = encode_pairs(
                job.tokenizer, lines, read(job.given), max_length=job.max_length,
                max_len=job.translator.max_len, first_line=first,
            )  # fmt: skip
        prepare = getattr(job.translator, "prepare_scores", None)
        if prepare is not None:  # its programs compile while the chunk before is scored
            prepare([s.ids for s in pairs.segments], pairs.given)
        offsets = tuple(r.offset if r is not None else 0 for r in beside)
        return _Read(lines, bad_utf8, offset, pairs, offsets)
    with timing.phase("tokenize"):
        encoded = encode_chunk(
            job.tokenizer,
            lines,
            read(job.prefixes),  # the next lines of --prefix and --constraints
            read(job.constraints),
            max_length=job.max_length,
            split=job.long_lines == "split",
            settings=job.translator.settings,
            first_line=first,
            sentences=job.sentences,
        )
    offsets = tuple(r.offset if r is not None else 0 for r in beside)
    prepare = getattr(job.translator, "prepare", None)
    if prepare is not None:  # its programs compile while the chunk before is translated
        prepare([s.ids for s in encoded.segments], targets=encoded.targets)
    return _Read(lines, bad_utf8, offset, encoded, offsets)


def translate_encoded(
    translator: Backend,
    tokenizer: Any,
    encoded: EncodedLines,
    progress: Progress | None = None,
    known: dict[int, list[Hypothesis]] | None = None,
) -> Translated:
    """`encode_chunk`'s lines translated with their targets (inference/lines.py
    `translate_segments`, whose progress and known these are): a line's phrases shared
    out among its sentences first, then whether each line holds them, and its prefix and
    phrases as the user wrote them ('…', not '...'). decode.py's chunks and the library's
    `Translator` (inference/text.py) both translate through here."""
    encoded = share_phrases(translator, encoded)
    translated = translate_segments(
        translator, tokenizer, encoded.segments, encoded.line_tokens, progress, known,
        encoded.targets,
    )  # fmt: skip
    phrases_met(translated.hypotheses, encoded)
    keep_user_texts(translated.hypotheses, encoded.user)
    return translated


def translate_chunk(
    job: StreamJob, chunk: _Read, meter: Meter, journal: Journal | None = None
) -> Translated:
    """One chunk's segments translated (with alignments if asked).

    journal: where each finished batch's results go, and the results an earlier run
    of the job left for this chunk, which are not translated again.
    """
    meter.start_chunk(len(chunk.lines), len(chunk.encoded.segments))
    known = journal.read() if journal is not None else {}
    if jax.process_count() > 1:  # every process translates what process 0's journal lacks
        ids = processes.known_sources(known)
        known = known if processes.is_main() else {i: [] for i in ids}
    if known:
        if processes.is_main():
            meter.write(
                f"decode.py: {len(known)} sentences of the running chunk were done by an "
                "earlier run of this command"
            )
        meter.skip(len(known))
        timing.count("journal_sources", len(known))
        timing.count("journal_tokens", output_tokens(list(known.values())))

    def progress(indices: Sequence[int], found: Sequence[list[Any]]) -> None:
        meter.batch(len(indices), output_tokens(found))
        if journal is not None:
            journal.write(indices, found)

    if isinstance(chunk.encoded, EncodedPairs):
        return score_segments(job.translator, chunk.encoded, progress, known)
    translated = translate_encoded(job.translator, job.tokenizer, chunk.encoded, progress, known)
    if job.alignment:
        with timing.phase("alignment"):
            add_alignments(job.model, job.tokenizer, translated)
    return translated


def _references(job: StreamJob, count: int) -> list[str]:
    refs, _ = job.references.read(count)
    if len(refs) < count:
        raise UserError("--reference has fewer lines than the input")
    return refs


def _chunk(
    job: StreamJob,
    chunk: _Read,
    totals: Totals,
    meter: Meter,
    journal: Journal | None = None,
) -> tuple[bytes, Totals]:
    """A chunk translated: its output bytes, and the totals with it.

    A function of its own so that the chunk's translations are freed when it returns.
    """
    lines = chunk.lines
    start = time.perf_counter()
    translated = translate_chunk(job, chunk, meter, journal)
    seconds = time.perf_counter() - start
    scores = totals.scores
    if job.references is not None:  # the sums so far, with this chunk's added
        corpus = CorpusScores(scores)
        corpus.add(best_texts(translated.hypotheses), _references(job, len(lines)))
        scores = corpus.stats
    plots = totals.plots
    if job.plot_attention and plots < job.num_plots:
        count = job.num_plots - plots
        plots += len(
            plot_lines(job.model, job.tokenizer, translated, job.plot_attention, count, plots)
        )
    with timing.phase("format"):
        text = output_text(format_lines(translated.hypotheses, job.output_format))
    totals = dataclasses.replace(
        totals,
        lines=totals.lines + len(lines),
        input_offset=chunk.offset,
        reference_offset=job.references.offset if job.references else 0,
        prefix_offset=chunk.offsets[0],
        constraints_offset=chunk.offsets[1],
        score_offset=chunk.offsets[2],
        bad_utf8=totals.bad_utf8 + chunk.bad_utf8,
        long=totals.long + chunk.encoded.num_long,
        empty=totals.empty + sum(1 for h in translated.hypotheses if not h),
        segments=totals.segments + len(translated.segments),
        tokens=totals.tokens + sum(len(h[0].tokens) + 1 for h in translated.search if h),
        seconds=totals.seconds + seconds,
        plots=plots,
        scores=scores,
    )
    return text.encode("utf-8"), totals


def translate_stream(job: StreamJob, out: Output, meter: Meter) -> Totals:
    """Translate `job.source` chunk by chunk into `out`, from where its record says."""
    totals = Totals.from_record(out.done)
    journal = getattr(out, "journal", None)
    # The next chunk is read and encoded while this one is translated: at most two
    # chunks of lines in memory, and the device does not wait for the tokenizer.
    reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="read")
    first = totals.lines + 1  # the input line a chunk starts at
    try:
        upcoming = reader.submit(_read, job, first)
        while (chunk := upcoming.result()) is not None:
            first += len(chunk.lines)
            upcoming = reader.submit(_read, job, first)
            data, totals = _chunk(job, chunk, totals, meter, journal)
            with timing.phase("write"):
                out.append(data, dataclasses.asdict(totals))
            del chunk, data
            meter.end_chunk()
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
    for flag, extra in (("--reference", job.references), ("--prefix", job.prefixes),
                        ("--constraints", job.constraints), ("--score", job.given)):  # fmt: skip
        if extra is not None and extra.read(1)[0]:
            raise UserError(f"{flag} has more lines than the input")
    return totals

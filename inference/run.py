"""decode.py's command: open a translator, stream the lines through it in order, report.

    run(DecodeOptions(workdir="workdir/tiny", input="test.de", output="test.en"))

Steps: check the input (and references); open a `Backend` (the workdir's
live model, an exported one, or, with --dry_run, a stand-in that plans batches
without a model); describe the job (its inputs, model and settings) and open
the output, which goes on from an earlier run's record of the same job
(inference/output.py); translate chunk by chunk (inference/stream.py) with
progress on stderr (inference/progress.py); then the summary, BLEU/chrF
against references and the plots' count. Progress, warnings and the summary
go to stderr; BLEU/chrF go to stdout unless the translations do. Everything
the user can fix is a UserError; a failure or Ctrl-C mid-job keeps the
chunks done for the next run.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from typing import Any

import jax

from attention_jax.data import load_split
from attention_jax.inference import processes
from attention_jax.inference.lines import LineReader, count_lines
from attention_jax.inference.options import DecodeOptions
from attention_jax.inference.output import (
    PartialOutput,
    StreamOutput,
    file_identity,
    lines_identity,
)
from attention_jax.inference.progress import Meter, warn
from attention_jax.inference.sentences import splitter_for
from attention_jax.inference.stream import ListReader, Reader, StreamJob, Totals, translate_stream
from attention_jax.inference.targets import check_files
from attention_jax.inference.translators import (
    Loaded,
    dry_run,
    open_translator,
    require_ctranslate2,
)
from attention_jax.runtime.errors import UserError
from attention_jax.search import timing
from attention_jax.search.bleu import CorpusScores
from attention_jax.search.settings import DEFAULTS

# Options that are not settings of a job's output: the files and the checkpoint
# (described by their identity instead: --checkpoint_step=N resumes a job that loaded
# step N as the newest), --restart itself, and what only --export uses.
_NOT_SETTINGS = (
    "input", "output", "reference", "workdir", "exported", "checkpoint", "checkpoint_step",
    "average_last", "restart", "export", "export_platforms", "plot_attention", "ct2",
    "export_ct2", "quantization", "stats", "prefix", "constraints", "score", "min_rows",
    "search",
)  # fmt: skip
# The files read beside the input, line by line, each a `Totals` offset "<name>_offset"
BESIDE = ("prefix", "constraints", "score")


def check_inputs(options: DecodeOptions) -> int | None:
    """Before anything slow: --input and the files read beside it exist, and a reference,
    prefix, constraints or score file has as many lines as a file input. Returns the
    input's number of lines (None for stdin or --split), for the ETA."""
    extra = {"--reference": options.reference}
    extra.update({f"--{name}": getattr(options, name) for name in BESIDE})
    for flag, path in list(extra.items())[1:]:
        if path and not os.path.isfile(path):
            raise UserError(f"{flag} {path} does not exist")
    if options.split or options.input == "-":
        return None
    if not os.path.isfile(options.input):
        raise UserError(f"--input {options.input} does not exist")
    try:
        total = count_lines(options.input)
        for flag, path in extra.items():
            if path and (n := count_lines(path)) != total:
                raise UserError(f"{flag} has {n} lines but the input {total}")
    except OSError as e:
        raise UserError(f"cannot read {e.filename}: {e.strerror}") from e
    return total


def split_lines(config: Any, split: str) -> tuple[list[str], list[str]]:
    """Sources and targets of `split` of the workdir's dataset."""
    corpus = load_split(config, split)
    pairs = [corpus[i] for i in range(len(corpus))]
    return [src for src, _ in pairs], [tgt for _, tgt in pairs]


def describe_inputs(
    options: DecodeOptions, loaded: Loaded, split: tuple[list[str], list[str]] | None
) -> dict[str, Any] | None:
    """The identity of what is translated (and scored): --input and --reference, or the
    split's (sources, targets); None for stdin (it cannot be read again: not resumable)."""
    targets = {name: getattr(options, name) and file_identity(getattr(options, name))
               for name in BESIDE}  # fmt: skip
    if split is not None:
        what = {"split": options.split, "dataset": str(loaded.config.dataset)}
        return {"split": lines_identity([*split[0], *split[1]], **what), **targets}
    if options.input == "-" or not os.path.isfile(options.input):
        return None
    refs = options.reference
    return {
        "input": file_identity(options.input),
        "reference": refs and file_identity(refs),
        **targets,
    }


def describe_job(
    options: DecodeOptions, loaded: Loaded, inputs: dict[str, Any] | None, max_length: int
) -> dict[str, Any] | None:
    """What a job's output depends on, compared when a partial output is resumed: inputs,
    model, every setting (as resolved), and the JAX version (numerics)."""
    if inputs is None:
        return None
    mine = lambda d: {k: v for k, v in d.items() if k not in _NOT_SETTINGS}
    settings = mine(dataclasses.asdict(options))
    settings.update(mine(dataclasses.asdict(loaded.translator.settings)))  # as resolved
    plots = options.plot_attention and os.path.abspath(options.plot_attention)
    settings.update(
        max_length=max_length, plot_attention=plots, read_lines=options.chunk_lines,
        batch_tokens=options.tokens_per_batch,
    )  # fmt: skip
    model = loaded.identity or {"translator": loaded.description}
    return {"inputs": inputs, "model": model, "settings": settings, "jax": jax.__version__}


def open_readers(
    options: DecodeOptions, split: tuple[list[str], list[str]] | None, done: dict[str, Any]
) -> tuple[Reader, Reader | None]:
    """(source, references or None) readers, at the offsets of an earlier run's record."""
    if split is not None:
        sources, targets = split
        lines = done.get("lines", 0)
        return ListReader(sources, lines), ListReader(targets, lines)
    source = LineReader(options.input, done.get("input_offset", 0))
    if not options.reference:
        return source, None
    return source, LineReader(options.reference, done.get("reference_offset", 0))


def open_beside(options: DecodeOptions, done: dict[str, Any]) -> tuple[Reader | None, ...]:
    """(--prefix, --constraints, --score) readers or None, at the offsets of an earlier
    run's record."""
    paths = [getattr(options, name) for name in BESIDE]
    return tuple(
        LineReader(path, done.get(f"{name}_offset", 0)) if path else None
        for name, path in zip(BESIDE, paths, strict=True)
    )


def sentence_splitter_of(options: DecodeOptions, loaded: Loaded) -> Any:
    """--long_lines=sentences: the splitter of --source_lang or the workdir's language."""
    return splitter_for(options.long_lines, options.source_lang, loaded.config)


def _kept(out: Any) -> str:
    lines = out.done.get("lines", 0)
    if not (out.resumable and lines):
        return ""
    return f"; {lines} lines are kept in {out.partial}: run the same command again to go on"


def run(options: DecodeOptions) -> None:
    """decode.py after its flags were checked; raises UserError for what the user can fix."""
    if options.ct2:
        require_ctranslate2()
    total = check_inputs(options)
    processes.check_single_process_flags(options)
    loaded = open_translator(options)
    if options.dry_run:
        loaded = dry_run(loaded, options)
    max_len = loaded.translator.max_len
    max_length = min(options.max_length or max_len, max_len)
    if max_length < 2:
        raise UserError(f"--max_length must be >= 2, got {max_length}")
    split = split_lines(loaded.config, options.split) if options.split else None
    sentences = sentence_splitter_of(options, loaded)
    if (options.prefix or options.constraints) and split is None and options.input != "-":
        check_files(
            loaded.tokenizer, options.input, options.prefix, options.constraints,
            max_length=max_length, max_len=max_len, settings=loaded.translator.settings,
            sentences=sentences,
        )  # fmt: skip
    job = describe_job(options, loaded, describe_inputs(options, loaded, split), max_length)
    out = processes.open_shared_output(options.output, job, options.restart)
    if out.done.get("lines") and processes.is_main():
        print(
            f"decode.py: going on with {out.partial}: {out.done['lines']} lines were done by "
            "an earlier run of this command",
            file=sys.stderr,
        )
    if split is not None:
        total = len(split[0])
    earlier = Totals.from_record(out.done)  # what an earlier run of the job did
    timing.mark("started")
    totals = _translate(options, loaded, out, max_length, split, total, sentences)
    if not processes.is_main():
        return
    report(totals, loaded, options, max_length)
    if options.stats:
        write_stats(options, totals, earlier, loaded)
    if options.reference or options.split:  # last: the line a user looks for
        scores = CorpusScores(totals.scores).summary()
        print(scores, file=sys.stderr if options.output == "-" else sys.stdout)


def write_stats(options: DecodeOptions, totals: Totals, earlier: Totals, loaded: Loaded) -> None:
    """--stats: where this run's wall time went (search/timing.py)."""
    lines, tokens = totals.lines - earlier.lines, totals.tokens - earlier.tokens
    sharding = getattr(loaded.translator, "sharding", None)
    try:
        timing.report(
            options.stats,
            lines=lines,
            # a resumed chunk's sources that its journal held: not this run's work
            tokens=tokens - timing.counted("journal_tokens"),
            search_devices=len(getattr(sharding, "device_set", ())) or 1,
            batch_tokens=options.tokens_per_batch,
        )
    except OSError as e:
        raise UserError(f"--stats {options.stats}: {e.strerror}") from e


def _translate(
    options: DecodeOptions,
    loaded: Loaded,
    out: PartialOutput | StreamOutput,
    max_length: int,
    split: tuple[list[str], list[str]] | None,
    total: int | None,
    sentences: Any,
) -> Totals:
    """The stream loop around `out`: finished when complete, kept for a resume otherwise.
    sentences: `sentence_splitter_of`'s splitter (None: lines are not split)."""
    quiet = {} if processes.is_main() else {"stream": io.StringIO(), "bar": False}
    meter = Meter(total, out.done.get("lines", 0), **quiet)
    source = references = None
    beside: tuple[Reader | None, ...] = (None,) * len(BESIDE)
    try:
        source, references = open_readers(options, split, out.done)
        beside = open_beside(options, out.done)
        stream = StreamJob(
            loaded.translator,
            loaded.tokenizer,
            source,
            read_lines=options.chunk_lines,
            max_length=max_length,
            long_lines=options.long_lines,
            sentences=sentences,
            output_format="scores" if options.score else options.output_format,
            references=references,
            prefixes=beside[0],
            constraints=beside[1],
            given=beside[2],
            model=loaded.model,
            alignment=options.alignment,
            plot_attention=options.plot_attention,
            num_plots=options.num_plots,
        )
        totals = translate_stream(stream, out, meter)
        meter.close()
        out.finish()
        return totals
    except KeyboardInterrupt:
        meter.close()
        print(f"decode.py: interrupted{_kept(out)}", file=sys.stderr)
        sys.exit(130)
    except OSError as e:
        raise UserError(f"{e.filename or options.output}: {e.strerror}{_kept(out)}") from e
    except UserError as e:
        raise UserError(f"{e}{_kept(out)}") from e
    except Exception as e:  # e.g. XlaRuntimeError: RESOURCE_EXHAUSTED
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        raise UserError(
            f"the device ran out of memory for batches of {options.tokens_per_batch} source "
            f"tokens (x beam {loaded.translator.settings.beam_size}): lower --batch_tokens"
            f"{_kept(out)}"
        ) from e
    finally:
        meter.close()
        out.close()
        for reader in (source, references, *beside):
            if reader is not None:
                reader.close()


def report(totals: Totals, loaded: Loaded, options: DecodeOptions, max_length: int) -> None:
    """Warnings, the summary line and the plots written (stderr)."""
    if totals.bad_utf8:
        warn(f"{totals.bad_utf8} line(s) had invalid UTF-8 (replaced)")
    if totals.long and options.score:
        warn(
            f"{totals.long} source(s) over {max_length} tokens or translation(s) over "
            f"{loaded.translator.max_len} truncated: their scores are of the truncated lines"
        )
    elif totals.long and options.long_lines == "sentences":
        warn(f"{totals.long} sentence(s) over {max_length} tokens split")
    elif totals.long:
        how = "split" if options.long_lines == "split" else "truncated"
        warn(f"{totals.long} line(s) over {max_length} tokens {how}")
    seconds = max(totals.seconds, 1e-9)
    search = loaded.translator.settings
    stop = f", {search.stop} stop" if search.stop != DEFAULTS.stop else ""
    what = f"beam {search.beam_size}, alpha {search.alpha}{stop}"
    if options.score:
        what = f"scored {totals.segments} translations"
    print(
        f"decode.py: {totals.lines} lines ({totals.empty} empty) from {loaded.description}, "
        f"{what}: {seconds:.1f} s, {totals.segments / seconds:.1f} sentences/s, "
        f"{totals.tokens / seconds:.0f} tokens/s",
        file=sys.stderr,
    )
    if options.plot_attention:
        print(
            f"wrote {totals.plots} attention plot(s) to {options.plot_attention}", file=sys.stderr
        )

"""decode.py's command: open a translator, translate lines in order, write them, report.

    run(DecodeOptions(workdir="workdir/tiny", input="test.de", output="test.en"))

Steps: read the input lines (or a split of the workdir's dataset); open a
`Translator` (the workdir's live model, or an exported one); encode, translate
and join the lines (inference/lines.py); add alignments; write; print the
summary, BLEU/chrF against references, attention plots. Progress, warnings and
the summary go to stderr; BLEU/chrF go to stdout unless the translations do.
Everything the user can fix is a UsageError.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

from data import DataError, Tokenizer, load_split
from inference.alignment import add_alignments
from inference.export import ExportedTranslator, export_translator
from inference.lines import (
    Translated,
    best_texts,
    bleu_chrf,
    encode_lines,
    format_lines,
    read_lines,
    translate_segments,
    write_lines,
)
from inference.options import DecodeOptions, UsageError
from inference.plots import plot_lines
from inference.restore import load_workdir
from inference.translate import LiveTranslator, Translator, vocab_limit
from model import Transformer


@dataclasses.dataclass
class Loaded:
    """What lines are translated with: a translator and its tokenizer; for a workdir also
    its model (alignments, plots, export) and training config (--split)."""

    translator: Translator
    tokenizer: Tokenizer
    description: str  # "step 3000", "the translator exported in DIR"
    model: Transformer | None = None
    config: Any = None


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def read_inputs(options: DecodeOptions) -> tuple[list[str], int, list[str] | None]:
    """(lines, lines with invalid UTF-8, reference lines or None) of --input/--reference."""
    if options.split:
        return [], 0, None
    if options.input != "-" and not os.path.isfile(options.input):
        raise UsageError(f"--input {options.input} does not exist")
    lines, bad_utf8 = _read(options.input)
    refs = None
    if options.reference:
        refs, _ = _read(options.reference)
        if len(refs) != len(lines):
            raise UsageError(f"--reference has {len(refs)} lines but the input {len(lines)}")
    return lines, bad_utf8, refs


def _read(path: str) -> tuple[list[str], int]:
    try:
        return read_lines(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from e


def open_translator(options: DecodeOptions) -> Loaded:
    """The exported translator of --exported, the CTranslate2 model of --ct2, or the live
    model of --workdir."""
    if options.exported:
        return _open_exported(options)
    if options.ct2:
        return _open_ct2(options)
    model, config, step, tokenizer = load_workdir(
        options.workdir, step=options.checkpoint_step, average_last=options.average_last
    )
    beam_size, alpha, n_best = options.search
    translator = LiveTranslator(
        model,
        beam_size=beam_size,
        alpha=alpha,
        n_best=n_best,
        batch_tokens=options.batch_tokens,
        vocab_limit=vocab_limit(tokenizer.vocab_size, model.config),
        length_penalty=options.penalty,
    )
    return Loaded(translator, tokenizer, f"step {step}", model, config)


def _open_exported(options: DecodeOptions) -> Loaded:
    try:
        translator = ExportedTranslator.load(options.exported, options.batch_tokens)
        tokenizer = Tokenizer.load(translator.tokenizer_path)
    except (OSError, ValueError, DataError) as e:
        raise UsageError(str(e)) from e
    for name in ("beam_size", "alpha", "n_best", "length_penalty"):
        asked, exported = getattr(options, name), getattr(translator, name)
        if asked is not None and asked != exported:
            raise UsageError(
                f"{options.exported} was exported with {name}={exported}; export again to change it"
            )
    return Loaded(translator, tokenizer, f"the translator exported in {options.exported}")


def _open_ct2(options: DecodeOptions) -> Loaded:
    from inference.ct2 import CT2Translator

    try:
        translator = CT2Translator.load(
            options.ct2,
            beam_size=options.beam_size,
            alpha=options.alpha,
            n_best=options.search[2],
            device=options.device or "cpu",
            threads=options.threads,
            batch_tokens=options.batch_tokens,
        )
        tokenizer = Tokenizer.load(translator.tokenizer_path)
    except (ImportError, OSError, ValueError, DataError) as e:
        raise UsageError(str(e)) from e
    return Loaded(translator, tokenizer, f"the CTranslate2 model in {options.ct2}")


def export(loaded: Loaded, options: DecodeOptions) -> None:
    """--export: the live model as a self-contained translator (inference/export.py)."""
    t0 = time.perf_counter()
    beam_size, alpha, n_best = options.search
    meta = export_translator(
        loaded.model,
        loaded.tokenizer.proto,
        options.export,
        beam_size=beam_size,
        alpha=alpha,
        n_best=n_best,
        vocab_limit=loaded.translator.vocab_limit,
        config=loaded.config.to_dict(),
        platforms=list(options.export_platforms) or None,
        length_penalty=options.penalty,
    )
    print(
        f"decode.py: exported {len(meta['widths'])} search programs (widths "
        f"{meta['widths'][0]}..{meta['widths'][-1]}, beam {beam_size}, alpha "
        f"{alpha}, n_best {n_best}, {'+'.join(meta['platforms'])}) and "
        f"{meta['num_params']} parameter arrays to {options.export} in "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )


def export_ct2(loaded: Loaded, options: DecodeOptions) -> None:
    """--export_ct2: the live model as a CTranslate2 model (inference/ct2_export.py)."""
    from inference.ct2_export import export_ct2 as write

    t0 = time.perf_counter()
    beam_size, alpha, _ = options.search
    tokenizer = loaded.tokenizer
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    source = {
        "workdir": os.path.abspath(options.workdir),
        "checkpoint": loaded.description,
        "average_last": options.average_last,
    }
    try:
        write(
            loaded.model,
            pieces,
            tokenizer.proto,
            options.export_ct2,
            quantization=options.quantization,
            alpha=alpha,
            beam_size=beam_size,
            source=source,
        )
    except (ImportError, OSError, ValueError) as e:
        raise UsageError(str(e)) from e
    print(
        f"decode.py: wrote the {options.quantization} CTranslate2 model of {loaded.description} "
        f"to {options.export_ct2} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )


def split_lines(config: Any, split: str) -> tuple[list[str], list[str]]:
    """Sources and targets of `split` of the workdir's dataset."""
    try:
        corpus = load_split(config, split)
    except DataError as e:
        raise UsageError(str(e)) from e
    pairs = [corpus[i] for i in range(len(corpus))]
    return [src for src, _ in pairs], [tgt for _, tgt in pairs]


def translate(
    loaded: Loaded, lines: list[str], max_length: int, split: bool
) -> tuple[Translated, dict[str, float]]:
    """The lines translated, with a progress bar; and (seconds, segments, tokens)."""
    from tqdm import tqdm

    segments, line_tokens, num_long = encode_lines(loaded.tokenizer, lines, max_length, split)
    if num_long:
        _warn(f"{num_long} line(s) over {max_length} tokens {'split' if split else 'truncated'}")
    bar = tqdm(total=len(segments), unit="sent", file=sys.stderr, dynamic_ncols=True)
    start, done = time.perf_counter(), [0, 0]

    def progress(sentences: int, tokens: int) -> None:
        done[0] += sentences
        done[1] += tokens
        bar.update(sentences)
        bar.set_postfix(tok_s=f"{done[1] / (time.perf_counter() - start):.0f}", refresh=False)

    translated = translate_segments(
        loaded.translator, loaded.tokenizer, segments, line_tokens, progress
    )
    bar.close()
    stats = {"seconds": time.perf_counter() - start, "segments": len(segments), "tokens": done[1]}
    return translated, stats


def run(options: DecodeOptions) -> None:
    """decode.py after its flags were checked; raises UsageError for what the user can fix."""
    if options.ct2 or options.export_ct2:
        from inference.ct2_export import import_ctranslate2

        try:
            import_ctranslate2()  # before the slow part: how to install it
        except ImportError as e:
            raise UsageError(str(e)) from e
    lines, bad_utf8, refs = read_inputs(options)
    loaded = open_translator(options)
    if options.export:
        return export(loaded, options)
    if options.export_ct2:
        return export_ct2(loaded, options)
    if options.split:
        lines, refs = split_lines(loaded.config, options.split)
    max_len = loaded.translator.max_len
    max_length = min(options.max_length or max_len, max_len)
    if max_length < 2:
        raise UsageError(f"--max_length must be >= 2, got {max_length}")
    if bad_utf8:
        _warn(f"{bad_utf8} line(s) had invalid UTF-8 (replaced)")
    translated, stats = translate(loaded, lines, max_length, options.long_lines == "split")
    if options.alignment:
        add_alignments(loaded.model, loaded.tokenizer, translated)
    try:
        write_lines(options.output, format_lines(translated.hypotheses, options.output_format))
    except OSError as e:
        raise UsageError(f"cannot write {options.output}: {e.strerror}") from e
    report(lines, translated, stats, loaded)
    if refs is not None:
        print_scores(best_texts(translated.hypotheses), refs, options.output)
    if options.plot_attention:
        paths = plot_lines(
            loaded.model, loaded.tokenizer, translated, options.plot_attention, options.num_plots
        )
        print(f"wrote {len(paths)} attention plot(s) to {options.plot_attention}", file=sys.stderr)


def report(lines: list[str], translated: Translated, stats: dict, loaded: Loaded) -> None:
    """The summary line on stderr."""
    seconds = max(stats["seconds"], 1e-9)
    empty = sum(1 for x in translated.hypotheses if not x)
    translator = loaded.translator
    print(
        f"decode.py: {len(lines)} lines ({empty} empty) from {loaded.description}, beam "
        f"{translator.beam_size}, alpha {translator.alpha}: {seconds:.1f} s, "
        f"{stats['segments'] / seconds:.1f} sentences/s, {stats['tokens'] / seconds:.0f} tokens/s",
        file=sys.stderr,
    )


def print_scores(hyps: list[str], refs: list[str], output: str) -> None:
    """BLEU and chrF with their signatures: on stdout, or stderr when it holds the output."""
    scores = bleu_chrf(hyps, refs)
    out = sys.stderr if output == "-" else sys.stdout
    print(f"BLEU = {scores['bleu']:.2f}  {scores['bleu_signature']}", file=out)
    print(f"chrF = {scores['chrf']:.2f}  {scores['chrf_signature']}", file=out)

"""Translate a file with a trained model: batched beam search, one output line per input line.

    python decode.py --workdir=workdir/tiny --input=test.de --output=test.en \
        [--beam_size=4] [--alpha=0.6] [--average_last=5] [--reference=test.ref.en] \
        [--plot_attention=pictures/]
    echo "Das Haus ist alt." | python decode.py --workdir=workdir/tiny
    python decode.py --workdir=workdir/tiny --split=test --output=test.hyp   # + BLEU, chrF
    python decode.py --workdir=workdir/tiny --n_best=4 --output_format=jsonl --alignment
    python decode.py --workdir=workdir/tiny --export=translator/     # self-contained export
    python decode.py --exported=translator/ --input=test.de          # ... used alone

Bad input never shifts lines: empty or whitespace-only lines give empty lines
(in jsonl, an object with no hypotheses), undecodable bytes are replaced (and
counted), lines longer than the model's maximum are truncated (or split,
--long_lines=split) with a warning. Progress, warnings and the summary go to
stderr; BLEU/chrF go to stdout unless the translations do.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "workdir", None, "Training workdir (config.json, checkpoints/, tokenizer.model)."
)
flags.DEFINE_string("input", "-", "Source text, one sentence a line; '-' = stdin.")
flags.DEFINE_string("output", "-", "Translations, one a line; '-' = stdout. Written atomically.")
flags.DEFINE_integer("beam_size", 4, "Beam size K; 1 = greedy search.")
flags.DEFINE_float("alpha", 0.6, "Length penalty exponent: score = log P / ((5 + len) / 6)^alpha.")
flags.DEFINE_integer("checkpoint_step", None, "Checkpoint step to load (default: the newest).")
flags.DEFINE_integer("average_last", 1, "Average the parameters of the last N checkpoints.")
flags.DEFINE_string("reference", None, "Reference translations: print sacreBLEU BLEU and chrF.")
flags.DEFINE_enum(
    "split", None, ["train", "dev", "test"],
    "Translate this split of the workdir's dataset (config.dataset) instead of --input, "
    "and score it against its targets.",
)  # fmt: skip
flags.DEFINE_string("plot_attention", None, "Write cross-attention heatmaps (PNG) into this dir.")
flags.DEFINE_integer("num_plots", 4, "How many sentences --plot_attention draws.")
flags.DEFINE_integer("batch_tokens", 4096, "Padded source tokens per batch (x beam in memory).")
flags.DEFINE_integer("max_length", None, "Longest source in tokens incl. EOS (default: max_len).")
flags.DEFINE_enum("long_lines", "truncate", ["truncate", "split"], "What to do with long lines.")
flags.DEFINE_integer("n_best", 1, "Hypotheses per line, best first (<= beam_size; jsonl).")
flags.DEFINE_enum(
    "output_format", "text", ["text", "jsonl"],
    "text: the best translation per line. jsonl: one object per line, "
    '{"hypotheses": [{"text", "score", "tokens"[, "alignment"]}, ...]}.',
)  # fmt: skip
flags.DEFINE_boolean(
    "alignment", False, "jsonl: add source-target word links 'i-j' from cross-attention."
)
flags.DEFINE_string("export", None, "Write a self-contained translator into this directory.")
flags.DEFINE_list("export_platforms", [], "Backends to export for (e.g. cpu,cuda); default: this.")
flags.DEFINE_string("exported", None, "Translate with an exported translator (no --workdir).")
flags.DEFINE_string(
    "compilation_cache", None,
    "Persistent XLA compilation cache ('off' = none; default: "
    "$ATTENTION_JAX_COMPILATION_CACHE or ~/.cache/attention-jax/xla).",
)  # fmt: skip


class UsageError(Exception):
    """Something the user can fix; printed as one line, exit code 1."""


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


# --- Lines in, lines out ----------------------------------------------------------------


def read_lines(path: str) -> tuple[list[str], int]:
    """Lines of `path` ('-' = stdin) split on '\\n' only, and how many had invalid UTF-8.

    str.splitlines would also split on \\x0b, \\x1c, U+2028, ... and shift lines.
    """
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror}") from e
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()  # the newline that ends the last line starts no new line
    lines, bad = [], 0
    for b in raw:
        try:
            line = b.decode("utf-8")
        except UnicodeDecodeError:
            line, bad = b.decode("utf-8", errors="replace"), bad + 1
        lines.append(line.removesuffix("\r"))
    return lines, bad


def write_output(path: str, lines: list[str]) -> None:
    """Write one line per translation; a file is replaced only once it is complete."""
    text = "".join(line.replace("\n", " ") + "\n" for line in lines)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".decode-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from e


def encode_sources(tokenizer, lines: list[str], max_length: int, split: bool):
    """Segments to translate: (line index, first token's index in the line, ids + EOS).

    Returns the segments, each line's token ids, and the number of long lines.
    """
    from model import EOS_ID

    per_line = tokenizer.encode_batch([line.strip() for line in lines])
    segments, long = [], 0
    for i, ids in enumerate(per_line):
        if len(ids) + 1 > max_length:
            long += 1
            if not split:
                ids = per_line[i] = ids[: max_length - 1]
        for start in range(0, len(ids), max_length - 1):
            segments.append((i, start, [*ids[start : start + max_length - 1], EOS_ID]))
    return segments, per_line, long


# --- What is printed per line --------------------------------------------------------------


def line_hypotheses(tokenizer, segments, hypotheses, num_lines: int) -> list[list[dict]]:
    """Per line, its hypotheses as dicts (text, score, tokens), best first.

    A line cut into several segments (--long_lines=split) has as many hypotheses
    as its segment with the fewest; hypothesis k joins the segments' k-th ones
    (texts with a space, tokens end to end, scores added up).
    """
    parts: list[list[list]] = [[] for _ in range(num_lines)]
    for (i, start, _), hyps in zip(segments, hypotheses, strict=True):
        parts[i].append((start, hyps))
    out = []
    for segs in parts:
        ranks = min((len(h) for _, h in segs), default=0)
        line = []
        for k in range(ranks):
            hs = [h[k] for _, h in segs]
            line.append(
                {
                    "text": " ".join(tokenizer.decode(h.tokens) for h in hs),
                    "score": sum(h.score for h in hs),
                    "tokens": [t for h in hs for t in h.tokens],
                }
            )
        out.append(line)
    return out


def add_alignments(model, tokenizer, segments, hypotheses, per_line, lines_out) -> None:
    """Add "alignment" to every hypothesis of `lines_out`, in place.

    Links index the words of the whole line: a segment's source words are
    offset by the line's words before it, its output words by the earlier
    segments' outputs (hypotheses of split lines are joined in order).
    """
    from training.alignment import word_alignments, word_ids

    piece = tokenizer.id_to_piece
    pairs = [
        (src, h.tokens)
        for (_, _, src), hyps in zip(segments, hypotheses, strict=True)
        for h in hyps
    ]
    found = iter(word_alignments(model, piece, pairs))
    links = [[next(found) for _ in hyps] for hyps in hypotheses]  # [segment][rank]
    by_line: dict[int, list[tuple[int, int]]] = {}
    for n, (i, start, _) in enumerate(segments):
        by_line.setdefault(i, []).append((n, start))
    for i, segs in by_line.items():
        words = word_ids([piece(t) for t in per_line[i]])  # the line's word of each token
        for k, hyp in enumerate(lines_out[i]):
            out, tgt_offset = [], 0
            for n, start in segs:
                for link in links[n][k].split():
                    a, b = map(int, link.split("-"))
                    out.append(f"{a + int(words[start])}-{b + tgt_offset}")
                tokens = hypotheses[n][k].tokens
                tgt_offset += len(set(word_ids([piece(t) for t in tokens]).tolist()))
            hyp["alignment"] = " ".join(out)


def plot_attention(model, tokenizer, sources, outputs, directory: str) -> list[str]:
    """One PNG per sentence: cross-attention (mean over heads), a panel per decoder layer."""
    import jax.numpy as jnp
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from model import BOS_ID, EOS_ID

    os.makedirs(directory, exist_ok=True)
    paths = []
    for n, (src, out) in enumerate(zip(sources, outputs, strict=True)):
        tgt = [*out, EOS_ID]
        tgt_in = jnp.asarray([[BOS_ID, *tgt[:-1]]], jnp.int32)  # row t predicts tgt[t]
        weights = model.cross_attention_weights(jnp.asarray([src], jnp.int32), tgt_in)
        weights = np.asarray(weights[:, 0].mean(axis=1))  # [L_dec, 1, N, T, S] -> [L_dec, T, S]
        src_pieces = [tokenizer.id_to_piece(t) for t in src]
        tgt_pieces = [tokenizer.id_to_piece(t) for t in tgt]
        layers = weights.shape[0]
        size = (max(4, 0.35 * len(src)) * layers, max(3, 0.35 * len(tgt)) + 1)
        fig, axes = plt.subplots(1, layers, figsize=size, squeeze=False)
        for layer, ax in enumerate(axes[0]):
            ax.imshow(weights[layer], cmap="viridis", vmin=0.0, aspect="auto")
            ax.set_xticks(range(len(src)), src_pieces, rotation=90, fontsize=8)
            ax.set_yticks(range(len(tgt)), tgt_pieces, fontsize=8)
            ax.set_title(f"layer {layer + 1}", fontsize=9)
            ax.set_xlabel("source")
        axes[0][0].set_ylabel("output")
        fig.tight_layout()
        path = os.path.join(directory, f"attention_{n:03d}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# --- The command ---------------------------------------------------------------------------


def check_flags() -> None:
    """Combinations of flags that cannot work, before anything slow happens."""
    if FLAGS.exported and (FLAGS.workdir or FLAGS.export):
        raise UsageError("--exported translates on its own: drop --workdir and --export")
    if not FLAGS.exported and not FLAGS.workdir:
        raise UsageError("--workdir is required (the directory train.py wrote), or --exported")
    if FLAGS.beam_size < 1 or FLAGS.alpha < 0 or FLAGS.batch_tokens < 1:
        raise UsageError("need --beam_size >= 1, --alpha >= 0 and --batch_tokens >= 1")
    if not 1 <= FLAGS.n_best <= FLAGS.beam_size:
        raise UsageError(f"--n_best must be in [1, --beam_size={FLAGS.beam_size}]")
    if FLAGS.output_format == "text" and FLAGS.n_best > 1 and not FLAGS.export:
        raise UsageError("--n_best > 1 needs --output_format=jsonl (text is the best translation)")
    if FLAGS.alignment and FLAGS.output_format != "jsonl":
        raise UsageError("--alignment needs --output_format=jsonl")
    needs_model = ["alignment", "plot_attention", "split", "checkpoint_step"]
    used = [f"--{n}" for n in needs_model if FLAGS[n].value] + (
        ["--average_last"] if FLAGS.average_last != 1 else []
    )
    if FLAGS.exported and used:
        raise UsageError(f"{', '.join(used)} need the trained model: use --workdir")
    if FLAGS.split and (FLAGS.input != "-" or FLAGS.reference):
        raise UsageError("--split replaces --input and --reference; give one or the other")


def read_inputs() -> tuple[list[str], int, list[str] | None]:
    """(lines, lines with invalid UTF-8, reference lines or None) from --input/--reference."""
    if FLAGS.split:
        return [], 0, None
    if FLAGS.input != "-" and not os.path.isfile(FLAGS.input):
        raise UsageError(f"--input {FLAGS.input} does not exist")
    lines, bad_utf8 = read_lines(FLAGS.input)
    refs = None
    if FLAGS.reference:
        refs, _ = read_lines(FLAGS.reference)
        if len(refs) != len(lines):
            raise UsageError(f"--reference has {len(refs)} lines but the input {len(lines)}")
    return lines, bad_utf8, refs


def load_exported():
    """(tokenizer, translate(sources, progress) -> hypotheses, max_len, description)."""
    from data import DataError, Tokenizer
    from training.export import ExportedTranslator

    try:
        translator = ExportedTranslator.load(FLAGS.exported)
        tokenizer = Tokenizer.load(translator.tokenizer_path)
    except (OSError, ValueError, DataError) as e:
        raise UsageError(str(e)) from e
    meta = translator.metadata
    for name in ("beam_size", "alpha", "n_best"):
        if FLAGS[name].present and FLAGS[name].value != meta[name]:
            raise UsageError(
                f"{FLAGS.exported} was exported with {name}={meta[name]}; export again to change it"
            )
    FLAGS.beam_size, FLAGS.alpha = meta["beam_size"], meta["alpha"]

    def translate(sources, progress):
        return translator.translate_ids(sources, batch_tokens=FLAGS.batch_tokens, progress=progress)

    return tokenizer, translate, meta["max_len"], f"the translator exported in {FLAGS.exported}"


def load_live():
    """(tokenizer, model, config, step) of --workdir, parameters averaged as asked."""
    from data import DataError, Tokenizer
    from training import TrainingError, restore_model

    tokenizer_path = os.path.join(FLAGS.workdir, "tokenizer.model")
    if os.path.isdir(FLAGS.workdir) and not os.path.isfile(tokenizer_path):
        raise UsageError(f"{tokenizer_path} is missing; was {FLAGS.workdir} made by train.py?")
    try:
        model, config, step = restore_model(
            FLAGS.workdir, step=FLAGS.checkpoint_step, average_last=FLAGS.average_last
        )
        tokenizer = Tokenizer.load(tokenizer_path)
    except (TrainingError, DataError) as e:
        raise UsageError(str(e)) from e
    return tokenizer, model, config, step


def export(model, tokenizer, config) -> None:
    from training.export import export_translator

    t0 = time.perf_counter()
    with open(tokenizer.path, "rb") as f:
        proto = f.read()
    limit = tokenizer.vocab_size if tokenizer.vocab_size < model.config.vocab_size else None
    meta = export_translator(
        model,
        proto,
        FLAGS.export,
        beam_size=FLAGS.beam_size,
        alpha=FLAGS.alpha,
        n_best=FLAGS.n_best,
        vocab_limit=limit,
        config=config.to_dict(),
        platforms=FLAGS.export_platforms or None,
    )
    print(
        f"decode.py: exported {len(meta['widths'])} search programs (widths "
        f"{meta['widths'][0]}..{meta['widths'][-1]}, beam {FLAGS.beam_size}, alpha "
        f"{FLAGS.alpha}, n_best {FLAGS.n_best}, {'+'.join(meta['platforms'])}) and "
        f"{meta['num_params']} parameter arrays to {FLAGS.export} in "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )


def translate_lines(tokenizer, translate, lines, max_length):
    """Per line, its hypotheses (dicts), plus the segments and search output behind them."""
    from tqdm import tqdm

    segments, per_line, num_long = encode_sources(
        tokenizer, lines, max_length, FLAGS.long_lines == "split"
    )
    if num_long:
        action = "split" if FLAGS.long_lines == "split" else "truncated"
        _warn(f"{num_long} line(s) over {max_length} tokens {action}")
    bar = tqdm(total=len(segments), unit="sent", file=sys.stderr, dynamic_ncols=True)
    start, done = time.perf_counter(), [0, 0]

    def progress(sentences: int, tokens: int) -> None:
        done[0] += sentences
        done[1] += tokens
        bar.update(sentences)
        bar.set_postfix(tok_s=f"{done[1] / (time.perf_counter() - start):.0f}", refresh=False)

    hypotheses = translate([ids for _, _, ids in segments], progress)
    bar.close()
    seconds = time.perf_counter() - start
    stats = {"seconds": seconds, "segments": len(segments), "tokens": done[1]}
    lines_out = line_hypotheses(tokenizer, segments, hypotheses, len(lines))
    return lines_out, (segments, hypotheses, per_line), stats


def run() -> None:
    """The whole command; raises UsageError for anything the user can fix."""
    check_flags()
    from training import xla

    cache = FLAGS.compilation_cache
    xla.enable_compilation_cache(xla.default_cache_dir() if cache is None else cache)
    lines, bad_utf8, refs = read_inputs()
    model = None
    if FLAGS.exported:
        tokenizer, translate, max_len, source = load_exported()
    else:
        from training.translate import translate_ids

        tokenizer, model, config, step = load_live()
        if FLAGS.export:
            return export(model, tokenizer, config)
        if FLAGS.split:
            lines, refs = split_lines(config)
        max_len, source = model.config.max_len, f"step {step}"
        limit = tokenizer.vocab_size if tokenizer.vocab_size < model.config.vocab_size else None

        def translate(sources, progress):
            return translate_ids(
                model,
                sources,
                beam_size=FLAGS.beam_size,
                alpha=FLAGS.alpha,
                n_best=FLAGS.n_best,
                batch_tokens=FLAGS.batch_tokens,
                vocab_limit=limit,
                progress=progress,
            )

    max_length = min(FLAGS.max_length or max_len, max_len)
    if max_length < 2:
        raise UsageError(f"--max_length must be >= 2, got {max_length}")
    if bad_utf8:
        _warn(f"{bad_utf8} line(s) had invalid UTF-8 (replaced)")
    lines_out, searched, stats = translate_lines(tokenizer, translate, lines, max_length)
    if FLAGS.alignment:
        add_alignments(model, tokenizer, *searched[:2], searched[2], lines_out)
    hyps = [line[0]["text"] if line else "" for line in lines_out]
    if FLAGS.output_format == "jsonl":
        out = [json.dumps({"hypotheses": line}, ensure_ascii=False) for line in lines_out]
    else:
        out = hyps
    write_output(FLAGS.output, out)

    seconds = max(stats["seconds"], 1e-9)
    print(
        f"decode.py: {len(lines)} lines ({sum(1 for x in lines_out if not x)} empty) from "
        f"{source}, beam {FLAGS.beam_size}, alpha {FLAGS.alpha}: {seconds:.1f} s, "
        f"{stats['segments'] / seconds:.1f} sentences/s, {stats['tokens'] / seconds:.0f} tokens/s",
        file=sys.stderr,
    )
    if refs is not None:
        score(hyps, refs)
    if FLAGS.plot_attention:
        plots(model, tokenizer, *searched[:2])


def split_lines(config) -> tuple[list[str], list[str]]:
    """Sources and targets of --split from the workdir's dataset."""
    from data import DataError, load_split

    try:
        corpus = load_split(config, FLAGS.split)
    except DataError as e:
        raise UsageError(str(e)) from e
    pairs = [corpus[i] for i in range(len(corpus))]
    return [src for src, _ in pairs], [tgt for _, tgt in pairs]


def score(hyps: list[str], refs: list[str]) -> None:
    import sacrebleu

    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    out = sys.stderr if FLAGS.output == "-" else sys.stdout
    print(f"BLEU = {b.score:.2f}  {bleu.get_signature()}", file=out)
    print(f"chrF = {c.score:.2f}  {chrf.get_signature()}", file=out)


def plots(model, tokenizer, segments, hypotheses) -> None:
    firsts: dict[int, int] = {}  # each line's first segment
    for n, (i, _, _) in enumerate(segments):
        firsts.setdefault(i, n)
    chosen = [n for _, n in sorted(firsts.items())][: FLAGS.num_plots]
    paths = plot_attention(
        model,
        tokenizer,
        [segments[n][2] for n in chosen],
        [hypotheses[n][0].tokens if hypotheses[n] else [] for n in chosen],
        FLAGS.plot_attention,
    )
    print(f"wrote {len(paths)} attention plot(s) to {FLAGS.plot_attention}", file=sys.stderr)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"decode.py: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(1)
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint read at INFO
    from training import log
    from training.xla import set_gpu_flags

    set_gpu_flags()  # before JAX initializes a backend
    log.setup()
    try:
        run()
    except UsageError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)

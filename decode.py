"""Translate a file with a trained model: batched beam search, one output line per input line.

    python decode.py --workdir=workdir/tiny --input=test.de --output=test.en \
        [--beam_size=4] [--alpha=0.6] [--average_last=5] [--reference=test.ref.en] \
        [--plot_attention=pictures/]
    echo "Das Haus ist alt." | python decode.py --workdir=workdir/tiny
    python decode.py --workdir=workdir/tiny --split=test --output=test.hyp   # + BLEU, chrF

Bad input never shifts lines: empty or whitespace-only lines give empty lines,
undecodable bytes are replaced (and counted), lines longer than the model's
maximum are truncated (or split, --long_lines=split) with a warning.
Progress, warnings and the summary go to stderr; BLEU/chrF go to stdout unless
the translations do.
"""

from __future__ import annotations

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


class UsageError(Exception):
    """Something the user can fix; printed as one line, exit code 1."""


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
    """EOS-terminated ids per segment, each segment's line, and the number of long lines."""
    from data import EOS_ID

    segments, owner, long = [], [], 0
    for i, ids in enumerate(tokenizer.encode_batch([line.strip() for line in lines])):
        if not ids:
            continue  # empty or whitespace-only: an empty translation
        if len(ids) + 1 > max_length:
            long += 1
            if not split:
                ids = ids[: max_length - 1]
        for start in range(0, len(ids), max_length - 1):
            segments.append([*ids[start : start + max_length - 1], EOS_ID])
            owner.append(i)
    return segments, owner, long


def plot_attention(model, tokenizer, sources, outputs, directory: str) -> list[str]:
    """One PNG per sentence: cross-attention (mean over heads), a panel per decoder layer."""
    import jax.numpy as jnp
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from data import BOS_ID, EOS_ID

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


def run() -> None:
    """The whole command; raises UsageError for anything the user can fix."""
    if not FLAGS.workdir:
        raise UsageError("--workdir is required (the directory train.py wrote)")
    if FLAGS.beam_size < 1 or FLAGS.alpha < 0 or FLAGS.batch_tokens < 1:
        raise UsageError("need --beam_size >= 1, --alpha >= 0 and --batch_tokens >= 1")
    if FLAGS.split and (FLAGS.input != "-" or FLAGS.reference):
        raise UsageError("--split replaces --input and --reference; give one or the other")
    lines, bad_utf8, refs = [], 0, None
    if not FLAGS.split:
        if FLAGS.input != "-" and not os.path.isfile(FLAGS.input):
            raise UsageError(f"--input {FLAGS.input} does not exist")
        lines, bad_utf8 = read_lines(FLAGS.input)
    if FLAGS.reference:
        refs, _ = read_lines(FLAGS.reference)
        if len(refs) != len(lines):
            raise UsageError(f"--reference has {len(refs)} lines but the input {len(lines)}")
    tokenizer_path = os.path.join(FLAGS.workdir, "tokenizer.model")

    from tqdm import tqdm

    from data import DataError, Tokenizer, load_split
    from model.decoding import translate_ids
    from training import TrainingError, restore_model

    if os.path.isdir(FLAGS.workdir) and not os.path.isfile(tokenizer_path):
        raise UsageError(f"{tokenizer_path} is missing; was {FLAGS.workdir} made by train.py?")
    try:
        tokenizer = Tokenizer.load(tokenizer_path) if os.path.isdir(FLAGS.workdir) else None
        model, config, step = restore_model(
            FLAGS.workdir, step=FLAGS.checkpoint_step, average_last=FLAGS.average_last
        )
        if FLAGS.split:
            corpus = load_split(config, FLAGS.split)
            pairs = [corpus[i] for i in range(len(corpus))]
            lines, refs = [src for src, _ in pairs], [tgt for _, tgt in pairs]
    except (TrainingError, DataError) as e:
        raise UsageError(str(e)) from e
    max_len = model.config.max_len
    max_length = min(FLAGS.max_length or max_len, max_len)
    if max_length < 2:
        raise UsageError(f"--max_length must be >= 2, got {max_length}")
    segments, owner, num_long = encode_sources(
        tokenizer, lines, max_length, FLAGS.long_lines == "split"
    )
    if num_long:
        action = "split" if FLAGS.long_lines == "split" else "truncated"
        print(f"warning: {num_long} line(s) over {max_length} tokens {action}", file=sys.stderr)
    if bad_utf8:
        print(f"warning: {bad_utf8} line(s) had invalid UTF-8 (replaced)", file=sys.stderr)

    bar = tqdm(total=len(segments), unit="sent", file=sys.stderr, dynamic_ncols=True)
    start, done = time.perf_counter(), [0, 0]

    def progress(sentences: int, tokens: int) -> None:
        done[0] += sentences
        done[1] += tokens
        bar.update(sentences)
        bar.set_postfix(tok_s=f"{done[1] / (time.perf_counter() - start):.0f}", refresh=False)

    outputs = translate_ids(
        model,
        segments,
        beam_size=FLAGS.beam_size,
        alpha=FLAGS.alpha,
        batch_tokens=FLAGS.batch_tokens,
        progress=progress,
    )
    bar.close()
    seconds = time.perf_counter() - start
    pieces: list[list[str]] = [[] for _ in lines]
    for i, out in zip(owner, outputs, strict=True):
        pieces[i].append(tokenizer.decode(out))
    hyps = [" ".join(p) for p in pieces]
    write_output(FLAGS.output, hyps)

    print(
        f"decode.py: {len(lines)} lines ({len(lines) - len(set(owner))} empty) from step {step}, "
        f"beam {FLAGS.beam_size}, alpha {FLAGS.alpha}: {seconds:.1f} s, "
        f"{len(segments) / max(seconds, 1e-9):.1f} sentences/s, "
        f"{done[1] / max(seconds, 1e-9):.0f} tokens/s",
        file=sys.stderr,
    )
    if refs is not None:
        import sacrebleu

        bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
        out = sys.stderr if FLAGS.output == "-" else sys.stdout
        print(f"BLEU = {b.score:.2f}  {bleu.get_signature()}", file=out)
        print(f"chrF = {c.score:.2f}  {chrf.get_signature()}", file=out)
    if FLAGS.plot_attention:
        first = sorted(set(owner))[: FLAGS.num_plots]
        chosen = [owner.index(i) for i in first]  # each line's first segment
        paths = plot_attention(
            model,
            tokenizer,
            [segments[j] for j in chosen],
            [outputs[j] for j in chosen],
            FLAGS.plot_attention,
        )
        print(f"wrote {len(paths)} attention plot(s) to {FLAGS.plot_attention}", file=sys.stderr)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"decode.py: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(1)
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint read at INFO
    from training.xla import set_gpu_flags

    set_gpu_flags()  # before JAX initializes a backend
    try:
        run()
    except UsageError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)

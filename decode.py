"""Translate a file with a trained model: batched beam search, one output line per input line.

    python decode.py --workdir=workdir/tiny --input=test.de --output=test.en \
        [--beam_size=4] [--alpha=0.6] [--average_last=5] [--reference=test.ref.en] \
        [--plot_attention=pictures/]
    echo "Das Haus ist alt." | python decode.py --workdir=workdir/tiny
    python decode.py --workdir=workdir/tiny --split=test --output=test.hyp   # + BLEU, chrF
    python decode.py --workdir=workdir/tiny --n_best=4 --output_format=jsonl --alignment
    python decode.py --workdir=workdir/tiny --export=translator/     # self-contained export
    python decode.py --exported=translator/ --input=test.de          # ... used alone
    python decode.py --workdir=workdir/tiny --input=big.de --output=big.en   # killed? run it again
    python decode.py --workdir=workdir/tiny --export_ct2=serve/ [--quantization=int8]
    python decode.py --ct2=serve/ --input=test.de --threads=2        # with CTranslate2
    python decode.py --marian=opus-mt-de-en/ --input=test.de         # an OPUS-MT model

Any input size: lines are read, translated and written a chunk (--read_lines) at
a time. An --output file is written as FILE.partial with a progress record and
renamed when complete; the same command run again after a kill goes on after the
last complete chunk (another input, model or flags: refused; --restart).

Bad input never shifts lines: empty or whitespace-only lines give empty lines
(in jsonl, an object with no hypotheses), undecodable bytes are replaced (and
counted), lines longer than the model's maximum are truncated (or split,
--long_lines=split) with a warning. Progress, warnings and the summary go to
stderr; BLEU/chrF go to stdout unless the translations do.

This file only starts the process; its flags are inference/cli.py's, parsed into one
`inference.options.DecodeOptions`, and the work is `inference.run.run` (translating) or
`inference.exports.write_translator` (--export, --export_ct2; docs/decoding.md).
"""

from __future__ import annotations

import gc
import time

_STARTED = time.perf_counter()  # --stats counts start-up from here
if __name__ == "__main__":
    # Start-up (JAX, Flax, Orbax) creates a great many objects that live as long as the
    # process, and no garbage: collections meanwhile would only walk them, again and
    # again. `main` freezes them out of the collector's generations, then turns it on.
    gc.disable()

import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from attention_jax.inference import cli  # noqa: E402 (defines the job's flags)
from attention_jax.runtime import process_flags  # noqa: E402 (defines the process's flags)

FLAGS = cli.FLAGS
flags.adopt_module_key_flags(cli)  # --help lists them as decode.py's
flags.adopt_module_key_flags(process_flags)


def start_processes() -> None:
    """jax.distributed for a job of several processes (before JAX starts a backend)."""
    from attention_jax.runtime import distributed

    distributed.initialize(*process_flags.where(), mode=process_flags.DISTRIBUTED.value)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"decode.py: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(1)
    logging.set_verbosity(logging.WARNING)  # Orbax logs every checkpoint read at INFO
    # Imported here so that `--help` and flag errors are fast and JAX-free.
    from attention_jax.runtime import log, xla
    from attention_jax.runtime.errors import UserError

    xla.set_gpu_flags()  # before JAX initializes a backend
    log.setup()
    try:
        options = cli.options_from_flags()
        options.check()
        start_processes()
        if options.stats:
            from attention_jax.search import timing

            timing.enable(origin=_STARTED)
        cache = process_flags.CACHE.value
        cache = xla.enable_compilation_cache(xla.default_cache_dir() if cache is None else cache)
        from attention_jax.inference.exports import write_translator
        from attention_jax.inference.run import run
        from attention_jax.search import programs

        programs.enable_beside(cache)  # the search programs whole: a new process loads them
        if not gc.isenabled():  # run as a program, its start-up done
            gc.freeze()
            gc.enable()

        (write_translator if options.export or options.export_ct2 else run)(options)
    except UserError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)

"""decode.py --export and --export_ct2: a trained model written as a translator that runs
without this checkout's training code, instead of translating.

    write_translator(DecodeOptions(workdir="workdir/tiny", export="translator/"))

--export writes a self-contained StableHLO translator (backends/stablehlo.py) that
`decode.py --exported` runs; --export_ct2 a CTranslate2 model (backends/ct2_export.py)
that `decode.py --ct2` and plain `ctranslate2.Translator` run.
"""

from __future__ import annotations

import os
import sys
import time

from attention_jax.backends.stablehlo import export_translator
from attention_jax.inference import processes
from attention_jax.inference.options import DecodeOptions
from attention_jax.inference.translators import Loaded, open_translator, require_ctranslate2
from attention_jax.runtime.errors import UserError


def write_translator(options: DecodeOptions) -> None:
    """The live model of --workdir or --marian, written as --export or --export_ct2 asks."""
    if options.export_ct2:
        require_ctranslate2()  # before the slow part: how to install it
    processes.check_single_process_flags(options)
    loaded = open_translator(options)
    if options.export:
        export(loaded, options)
    else:
        export_ct2(loaded, options)


def export(loaded: Loaded, options: DecodeOptions) -> None:
    """--export: the live model as a self-contained translator (backends/stablehlo.py)."""
    t0 = time.perf_counter()
    s = options.settings
    meta = export_translator(
        loaded.model,
        loaded.tokenizer.files(),
        options.export,
        s,
        vocab_limit=loaded.translator.vocab_limit,
        config=loaded.config.to_dict() if loaded.config is not None else None,
        platforms=list(options.export_platforms) or None,
    )
    print(
        f"decode.py: exported {len(meta['widths'])} search and scoring programs each (widths "
        f"{meta['widths'][0]}..{meta['widths'][-1]}, beam {s.beam_size}, alpha "
        f"{s.alpha}, n_best {s.n_best}, {'+'.join(meta['platforms'])}) and "
        f"{meta['num_params']} parameter arrays to {options.export} in "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )


def export_ct2(loaded: Loaded, options: DecodeOptions) -> None:
    """--export_ct2: the live model as a CTranslate2 model (backends/ct2_export.py)."""
    from attention_jax.backends.ct2_export import export_ct2 as write

    t0 = time.perf_counter()
    tokenizer = loaded.tokenizer
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    if options.marian:
        source = {"marian": os.path.abspath(options.marian)}
    else:
        source = {
            "workdir": os.path.abspath(options.workdir),
            "checkpoint": loaded.description,
            "average_last": options.average_last,
        }
    try:
        write(
            loaded.model,
            pieces,
            tokenizer.files(),
            options.export_ct2,
            quantization=options.quantization,
            search=options.settings,
            source=source,
        )
    except (ImportError, OSError, ValueError) as e:
        raise UserError(str(e)) from e
    print(
        f"decode.py: wrote the {options.quantization} CTranslate2 model of {loaded.description} "
        f"to {options.export_ct2} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )

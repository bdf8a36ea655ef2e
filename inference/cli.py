"""decode.py's flags: one per `DecodeOptions` field, of the field's name and default, one
per search setting (derived from search/settings.py `SearchSettings`: its name, type,
default, choices and help); the process's (jax.distributed, the compilation cache) are
runtime/process_flags.py's, as train.py's. Importing this module defines them; only
decode.py does.

Kept apart from inference/options.py so that `--help` and flag errors load absl alone,
not JAX, and so that importing the options (as tests and bench/ do) defines no flags
beside train.py's of the same names.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from absl import flags

from attention_jax.search.settings import SearchSettings

if TYPE_CHECKING:
    from attention_jax.inference.options import DecodeOptions

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "workdir", None, "Training workdir (config.json, checkpoints/, tokenizer.model)."
)
flags.DEFINE_string("input", "-", "Source text, one sentence a line; '-' = stdin.")
flags.DEFINE_string(
    "output", "-", "Translations, one a line; '-' = stdout. A file appears when complete."
)
flags.DEFINE_string(
    "prefix", None,
    "A file with one line per input line: the start translation i must have (target "
    "language; an empty line: none).",
)  # fmt: skip
flags.DEFINE_string(
    "constraints", None,
    "A file with one line per input line: the phrases translation i must contain, "
    "separated by tabs (an empty line: none). Not with --ct2.",
)  # fmt: skip
flags.DEFINE_string(
    "score", None,
    "A file with one line per input line: a translation of it, scored instead of "
    "translating. Writes one JSON object per line: score (log P of its tokens and EOS, "
    "natural log, unnormalized), token_log_probs and tokens.",
)  # fmt: skip
flags.DEFINE_enum(
    "checkpoint", "last", ["last", "best"],
    "last: the newest checkpoint (or --checkpoint_step). best: the one of the best dev "
    "evaluation (config.best_metric), which train.py keeps beside the newest.",
)  # fmt: skip
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
flags.DEFINE_integer("max_length", None, "Longest source in tokens incl. EOS (default: max_len).")
flags.DEFINE_enum(
    "long_lines", "truncate", ["truncate", "split", "sentences"],
    "A line over --max_length tokens: truncate it, or split it into pieces; sentences: "
    "translate every line sentence by sentence (sentencex, for --source_lang), joined "
    "with a space.",
)  # fmt: skip
flags.DEFINE_string(
    "source_lang", None,
    "The input's language (e.g. de), for --long_lines=sentences (default: the workdir's "
    "config.source_lang).",
)  # fmt: skip
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
    "export_ct2", None, "Write a CTranslate2 model (pip install '.[serve]') into this directory."
)
flags.DEFINE_enum(
    "quantization", "float32",
    ["float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16"],
    "--export_ct2: the weight type CTranslate2 stores.",
)  # fmt: skip
flags.DEFINE_string("ct2", None, "Translate with a CTranslate2 model directory (no --workdir).")
flags.DEFINE_string(
    "marian", None,
    "Translate with an OPUS-MT / Marian model directory (decoder.yml, the .npz, the "
    "vocabulary, source.spm and target.spm), in our JAX model (no --workdir).",
)  # fmt: skip
flags.DEFINE_enum("device", None, ["cpu", "cuda"], "--ct2: where CTranslate2 runs (default cpu).")
flags.DEFINE_integer(
    "threads",
    0,
    "--ct2: CTranslate2's threads; on a CPU each translates its own batch (0 = one per core).",
)
flags.DEFINE_integer(
    "read_lines", None,
    "Lines per chunk: read, sorted into batches, translated and written before the next "
    "(default: max(10000, 2.5 x --batch_tokens)). An --output file is resumable: run the "
    "same command again after a kill.",
)  # fmt: skip
flags.DEFINE_boolean("restart", False, "Discard a partial --output of an earlier run.")
flags.DEFINE_boolean(
    "dry_run", False, "Read, tokenize, batch and write without the model (lines are copied)."
)
flags.DEFINE_string(
    "stats", None,
    "Write where the wall time went (start-up, programs, host work, device busy and idle) "
    "into this file as JSON, and a table to stderr.",
)  # fmt: skip

# A flag per search setting, of SearchSettings' name, type, default, choices and help.
_DEFINE = {
    "int": flags.DEFINE_integer,
    "int | None": flags.DEFINE_integer,
    "float": flags.DEFINE_float,
}
SEARCH_FLAGS = tuple(f.name for f in SearchSettings.fields(flag=True))
for _field in SearchSettings.fields(flag=True):
    _help, _choices = _field.metadata["help"], _field.metadata["choices"]
    if _choices:
        flags.DEFINE_enum(_field.name, _field.default, list(_choices), _help)
    else:
        _DEFINE[_field.type](_field.name, _field.default, _help)

# Every flag of this module is the DecodeOptions field of its name, with the field's
# default, or a search setting (tests/test_stream_parts.py checks names, defaults and
# choices); the process's are runtime/process_flags.py's.


def job_flags() -> list[str]:
    """The names of the flags that make DecodeOptions' own fields (not the search
    settings)."""
    mine = FLAGS.get_flags_for_module(sys.modules[__name__])
    return [f.name for f in mine if f.name not in SEARCH_FLAGS]


def options_from_flags() -> DecodeOptions:
    """The parsed flags as one `DecodeOptions`: the search settings given (an exported
    translator or a CTranslate2 model has its own for the others)."""
    from attention_jax.inference.options import (
        DecodeOptions,  # JAX: not before the flags are parsed
    )

    values = {name: FLAGS[name].value for name in job_flags()}
    values["export_platforms"] = tuple(values["export_platforms"])
    search = {name: FLAGS[name].value for name in SEARCH_FLAGS if FLAGS[name].present}
    return DecodeOptions(**values, search=search)

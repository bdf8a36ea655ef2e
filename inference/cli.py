"""decode.py's flags: one per `DecodeOptions` field, of the field's name and default (the
search settings are None until given), and the process's (jax.distributed, the
compilation cache). Importing this module defines them; only decode.py does.

Kept apart from inference/options.py so that `--help` and flag errors load absl alone,
not JAX, and so that importing the options (as tests and bench/ do) defines no flags
beside train.py's of the same names.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from absl import flags

from attention_jax.search.defaults import (
    BATCH_TOKENS,
    BEAM_STOPS,
    CT2_BATCH_TOKENS,
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_CONSTRAINT_TOKENS,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_MAX_CONSTRAINTS,
    DEFAULT_MIN_LENGTH,
    DEFAULT_STOP,
    LENGTH_PENALTIES,
)

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
flags.DEFINE_integer("beam_size", DEFAULT_BEAM_SIZE, "Beam size K; 1 = greedy search.")
flags.DEFINE_float("alpha", DEFAULT_ALPHA, "Length penalty exponent: score = log P / lp(len).")
flags.DEFINE_enum(
    "length_penalty", DEFAULT_LENGTH_PENALTY, list(LENGTH_PENALTIES),
    "gnmt: lp = ((5 + len) / 6)^alpha (the default). average: lp = len^alpha (CTranslate2's; "
    "the default of --ct2). len counts EOS.",
)  # fmt: skip
flags.DEFINE_enum(
    "stop", DEFAULT_STOP, list(BEAM_STOPS),
    "When a source's beam search ends. bound: once no live beam can win, however long it "
    "grows (exact; the default). heuristic: once none would win if it ended at the next "
    "step (about half the steps; Hugging Face's default rule).",
)  # fmt: skip
flags.DEFINE_integer(
    "min_length", DEFAULT_MIN_LENGTH,
    "Fewest tokens before EOS: 1 = no empty translation of a non-empty line (as CTranslate2 "
    "and fairseq); 0 = a translation may end at once.",
)  # fmt: skip
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
flags.DEFINE_integer(
    "max_constraints", DEFAULT_MAX_CONSTRAINTS, "--constraints: the most phrases a line."
)
flags.DEFINE_integer(
    "constraint_tokens", DEFAULT_CONSTRAINT_TOKENS, "--constraints: the most tokens a phrase."
)
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
flags.DEFINE_integer(
    "batch_tokens", None,
    "Padded source tokens per batch (x beam in memory; default: "
    f"{BATCH_TOKENS['cpu']} on a CPU, {BATCH_TOKENS['gpu']} on a GPU or TPU; --ct2: "
    f"{CT2_BATCH_TOKENS['cpu']} on a CPU, {CT2_BATCH_TOKENS['cuda']} on CUDA).",
)  # fmt: skip
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
flags.DEFINE_string(
    "compilation_cache", None,
    "Persistent XLA compilation cache ('off' = none; default: "
    "$ATTENTION_JAX_COMPILATION_CACHE or ~/.cache/attention-jax/xla).",
)  # fmt: skip
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
flags.DEFINE_integer(
    "steps_per_check", None,
    "Search steps between tests of whether every source is done, in a loop XLA:GPU runs "
    "without a host round trip (default: the platform's, search/beam.py STEPS_PER_CHECK). "
    "The output is the same for any value.",
)  # fmt: skip
flags.DEFINE_string(
    "coordinator_address", None,
    "Several processes (hosts) translating one input into one output: HOST:PORT of process 0 "
    "(jax.distributed), with --num_processes and --process_id; as train.py's.",
)  # fmt: skip
flags.DEFINE_integer("num_processes", None, "Several processes: how many.")
flags.DEFINE_integer("process_id", None, "Several processes: this one's index (0 writes).")
flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "jax.distributed.initialize: 'auto' = when the flags above are given or a cluster is "
    "detected (TPU VM, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS); 'on' = always; 'off' = never.",
)  # fmt: skip
flags.DEFINE_string(
    "stats", None,
    "Write where the wall time went (start-up, programs, host work, device busy and idle) "
    "into this file as JSON, and a table to stderr.",
)  # fmt: skip

# The flags of the process; every other flag is the DecodeOptions field of its name, with
# the field's default (tests/test_stream_parts.py checks names, defaults and choices).
_PROCESS = (
    "compilation_cache",
    "coordinator_address",
    "num_processes",
    "process_id",
    "distributed",
)
# Settings an exported translator fixes (a CTranslate2 model has defaults for them):
# None in the options when not given here.
_SEARCH = ("beam_size", "alpha", "n_best", "length_penalty", "stop", "min_length")


def job_flags() -> list[str]:
    """The names of the flags that make DecodeOptions (all but the process's)."""
    mine = FLAGS.get_flags_for_module(sys.modules[__name__])
    return [flag.name for flag in mine if flag.name not in _PROCESS]


def options_from_flags() -> DecodeOptions:
    """The parsed flags as one `DecodeOptions`."""
    from attention_jax.inference.options import (
        DecodeOptions,  # JAX: not before the flags are parsed
    )

    values = {name: FLAGS[name].value for name in job_flags()}
    values.update({name: values[name] if FLAGS[name].present else None for name in _SEARCH})
    values["export_platforms"] = tuple(values["export_platforms"])
    return DecodeOptions(**values)

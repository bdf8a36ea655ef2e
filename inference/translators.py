"""Which translator a decode.py job translates with: the live model of a workdir or of an
OPUS-MT directory, an exported one, a CTranslate2 model, or (--dry_run) a stand-in
that plans batches without a model; with its tokenizer and what it depends on.

    loaded = open_translator(options)    # Loaded(translator, tokenizer, description, ...)
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from attention_jax import Transformer
from attention_jax.backends.stablehlo import ExportedTranslator
from attention_jax.data import Tokenizer, files_identity, load_tokenizer
from attention_jax.ensemble import Ensemble
from attention_jax.inference.options import DecodeOptions
from attention_jax.inference.progress import warn
from attention_jax.runtime.errors import UserError
from attention_jax.search.translate import (
    Backend,
    LiveTranslator,
    PlanOnlyTranslator,
    vocab_limit,
)
from attention_jax.training.workdir import load_workdir, workdir_identity


@dataclasses.dataclass
class Loaded:
    """What lines are translated with: a translator and its tokenizer; for a workdir also
    its model (alignments, plots, export) and training config (--split); for --marian
    its model."""

    translator: Backend
    tokenizer: Tokenizer  # or data.tokenizer.MarianTokenizer (the same interface)
    description: str  # "step 3000", "the translator exported in DIR"
    model: Transformer | None = None
    config: Any = None
    # What the translations depend on, for resuming a job (None: the description); a new
    # backend gives e.g. {"ct2": files_identity([directory])}.
    identity: dict[str, Any] | None = None


def open_translator(options: DecodeOptions) -> Loaded:
    """The translator of --exported, --ct2 (CTranslate2), or the live model of --workdir or
    --marian (an OPUS-MT directory): `OPENERS[options.backend]`."""
    return OPENERS[options.backend](options)


def _shardings() -> tuple[NamedSharding | None, NamedSharding | None]:
    """(rows, parameters): each batch's rows split over every device of the job, the
    parameters replicated on all of them; (None, None) on a single device."""
    if jax.device_count() == 1:
        return None, None
    auto = (jax.sharding.AxisType.Auto,)  # the partitioner places what is not constrained
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=auto)
    return NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())


def _open_marian(options: DecodeOptions) -> Loaded:
    from attention_jax.backends.marian import load_directory

    rows, replicated = _shardings()  # every device of the job, or None for one
    model, tokenizer = load_directory(options.marian, replicated)
    identity = {"marian": files_identity([options.marian])}
    description = f"the Marian model in {options.marian}"
    translator = _live(options, model, tokenizer, rows)
    return Loaded(translator, tokenizer, description, model, None, identity)


def _open_workdir(options: DecodeOptions) -> Loaded:
    rows, replicated = _shardings()
    if len(options.workdirs) > 1:
        return _open_ensemble(options, rows, replicated)
    (workdir,) = options.workdirs
    model, config, step, tokenizer = load_workdir(
        workdir, step=options.step, average_last=options.average_last, sharding=replicated
    )
    identity = workdir_identity(workdir, step, options.average_last)
    translator = _live(options, model, tokenizer, rows)
    return Loaded(translator, tokenizer, f"step {step}", model, config, identity)


def _open_ensemble(options: DecodeOptions, rows: Any, replicated: Any) -> Loaded:
    """--workdir=A,B,...: the workdirs' models as one `Ensemble` (model/ensemble.py),
    UserError unless they share a tokenizer and a vocabulary size."""
    loaded = [
        load_workdir(d, step=options.step, average_last=options.average_last,
                     sharding=replicated)
        for d in options.workdirs
    ]  # fmt: skip
    (first, config, _, tokenizer), names = loaded[0], options.workdirs
    for name, (model, _, _, other) in zip(names[1:], loaded[1:], strict=True):
        if other.files() != tokenizer.files():
            raise UserError(
                f"{name} has another tokenizer than {names[0]}: the models of an ensemble "
                "share theirs (train each with the first's tokenizer.model, copied into its "
                "workdir before it starts)"
            )
        if model.config.vocab_size != first.config.vocab_size:
            raise UserError(
                f"{name}'s vocabulary has {model.config.vocab_size} ids and {names[0]}'s "
                f"{first.config.vocab_size}: the models of an ensemble share theirs"
            )
    steps = [step for _, _, step, _ in loaded]
    identity = {"ensemble": [workdir_identity(d, step, options.average_last)
                             for d, step in zip(names, steps, strict=True)]}  # fmt: skip
    translator = _live(options, Ensemble([m for m, _, _, _ in loaded]), tokenizer, rows)
    description = "an ensemble of " + ", ".join(
        f"{d} (step {step})" for d, step in zip(names, steps, strict=True)
    )
    return Loaded(translator, tokenizer, description, None, config, identity)


def require_ctranslate2() -> None:
    """ImportError from importing ctranslate2 as a UserError that says how to install it."""
    from attention_jax.backends.ct2_export import import_ctranslate2

    try:
        import_ctranslate2()
    except ImportError as e:
        raise UserError(str(e)) from e


def _live(
    options: DecodeOptions, model: Transformer | Ensemble, tokenizer: Any, rows: Any
) -> LiveTranslator:
    """The JAX model's translator, set as the options say."""
    limit = vocab_limit(tokenizer.vocab_size, model.config)
    return LiveTranslator(model, options.settings, vocab_limit=limit, sharding=rows)


def _open_exported(options: DecodeOptions) -> Loaded:
    try:
        translator = ExportedTranslator.load(options.exported, options.tokens_per_batch)
        tokenizer = load_tokenizer(options.exported)
    except (OSError, ValueError, UserError) as e:
        raise UserError(str(e)) from e
    _check_exported(options, translator)
    identity = {"exported": os.path.abspath(options.exported)}
    identity["files"] = files_identity([options.exported])
    description = f"the translator exported in {options.exported}"
    return Loaded(translator, tokenizer, description, identity=identity)


def _check_exported(options: DecodeOptions, translator: ExportedTranslator) -> None:
    """UserError if the options ask for a search the export did not fix, or to score with
    an export that has no scoring programs."""
    if options.score and not translator.scores:
        raise UserError(
            f"{options.exported} was exported without scoring programs: export it again"
        )
    for name in ("beam_size", "alpha", "n_best", "length_penalty", "stop", "min_length"):
        asked, exported = options.search.get(name), getattr(translator.settings, name)
        if asked is not None and asked != exported:
            raise UserError(
                f"{options.exported} was exported with {name}={exported}; export again to change it"
            )


def reconfigure(loaded: Loaded, options: DecodeOptions) -> Loaded:
    """`loaded` searching as `options` asks, its model and tokenizer kept (the library's
    per-call settings): UserError for a setting an export fixed."""
    translator = copy.copy(loaded.translator)
    if options.backend == "exported":
        _check_exported(options, translator)
        batch_tokens = options.search.get("batch_tokens")
        translator.settings = translator.settings.replace(batch_tokens=batch_tokens)
    elif options.backend == "ct2":
        device = options.device or "cpu"
        translator.settings = translator.settings_for(translator.decoding, device, options.search)
    else:
        translator.settings = options.settings
    return dataclasses.replace(loaded, translator=translator)


def dry_run(loaded: Loaded, options: DecodeOptions) -> Loaded:
    """--dry_run: `loaded` with a translator that plans and fills its batches but runs no
    model (each line comes out as its own tokens, detokenized)."""
    t = loaded.translator
    settings = t.settings.replace(batch_tokens=options.tokens_per_batch)
    stand_in = PlanOnlyTranslator(t.max_len, settings)
    return dataclasses.replace(
        loaded, translator=stand_in, description=f"{loaded.description} (dry run: no model)"
    )


def _open_ct2(options: DecodeOptions) -> Loaded:
    from attention_jax.backends.ct2 import CT2Translator
    from attention_jax.backends.ct2_export import int8_saturates

    try:
        translator = CT2Translator.load(
            options.ct2, device=options.device or "cpu", threads=options.threads,
            search=options.search,
        )  # fmt: skip
        tokenizer = load_tokenizer(options.ct2)
    except (ImportError, OSError, ValueError, UserError) as e:
        raise UserError(str(e)) from e
    int8 = str(translator.decoding.get("quantization", "")).startswith("int8")
    if int8 and (options.device or "cpu") == "cpu" and int8_saturates():
        warn(
            "this CPU has no VNNI: CTranslate2's int8 matrix products can saturate here "
            "(oneDNN's u8s8 kernels), so int8 output strays further from float32's than "
            "8-bit weights alone would make it; set CT2_USE_MKL=1 for accurate int8 "
            "(slower), or export float32 (faster than int8 on such CPUs)"
        )
    identity = {"ct2": os.path.abspath(options.ct2), "files": files_identity([options.ct2])}
    description = f"the CTranslate2 model in {options.ct2}"
    return Loaded(translator, tokenizer, description, identity=identity)


# How each backend is opened (`DecodeOptions.backend`): a new backend is one entry.
OPENERS: dict[str, Callable[[DecodeOptions], Loaded]] = {
    "exported": _open_exported,
    "ct2": _open_ct2,
    "marian": _open_marian,
    "workdir": _open_workdir,
}

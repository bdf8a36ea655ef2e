"""The training config: every check in one place, and its copy in the workdir.

    validate(config)                  # UserError naming the first bad field
    cfg = model_config(config)        # config.model + vocab_size -> TransformerConfig
    model = build_model(config, cfg)  # freshly initialized from config.seed
    settings = search_settings(config)  # config.search -> SearchSettings (evaluations)
    save_config(config, workdir)      # WORKDIR/config.json
    config = load_config(workdir)     # back, on top of configs/default.py

Defaults live only in configs/default.py: `load_config` lays a workdir's
config.json over them, so a workdir written before a field existed still
loads, and no caller needs `config.get(field, default)`.

`validate` runs before anything slow (corpus, tokenizer, compiling) and also
checks what depends on the machine: the mesh against the device count, the data
shards against the process count, and the batch against the batch axes.
The functions that consume the config (optimizer, input pipeline, steps)
trust it and do not repeat these checks.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from typing import Any

import jax
import ml_collections
from flax import nnx

from attention_jax import Transformer, TransformerConfig
from attention_jax.attention import resolve_config
from attention_jax.configs.default import RENAMED
from attention_jax.data import atomic_write
from attention_jax.runtime.errors import UserError
from attention_jax.search.settings import SearchSettings
from attention_jax.training.mesh import AXES as MESH_AXES
from attention_jax.training.mesh import mesh_shape

CONFIG_FILE = "config.json"

_log = logging.getLogger(__name__)

SCHEDULES = ("rsqrt", "linear_rsqrt", "cosine")
OPTIMIZERS = ("adam", "adamw")
NONFINITE_POLICIES = ("skip", "stop")
LONG_PAIRS = ("drop", "truncate")
TOKENIZER_TYPES = ("unigram", "bpe")

_POSITIVE = (
    "vocab_size",
    "max_length",
    "batch_tokens",
    "tokenizer_sample_size",
    "num_length_buckets",
    "num_train_steps",
    "log_every_steps",
    "grad_accum_steps",
)
# 0 means "never" (intervals), "all" (example counts) or "off"/"auto" (the rest).
_NON_NEGATIVE = (
    "eval_every_steps",
    "checkpoint_every_steps",
    "max_checkpoints_to_keep",
    "early_stop_patience",
    "checkpoint_every_minutes",
    "average_last",
    "peer_timeout_seconds",
    "eval_max_examples",
    "final_eval_max_examples",
    "num_examples_to_print",
    "warmup_steps",
    "max_consecutive_nonfinite",
    "data_shards",
    "data_workers",
    "mapped_cache_gb",
    "grad_clip_norm",
    "weight_decay",
    "loss_chunk_tokens",
    "peak_flops_per_device",
)
_CHOICES = {
    "schedule": SCHEDULES,
    "optimizer": OPTIMIZERS,
    "nonfinite_policy": NONFINITE_POLICIES,
    "long_pairs": LONG_PAIRS,
    "tokenizer_type": TOKENIZER_TYPES,
    "loss_logits_dtype": ("float32", "bfloat16"),
    "best_metric": ("chrf", "bleu", "loss"),
}


def defaults() -> ml_collections.ConfigDict:
    """configs/default.py: the reference list of fields and their defaults."""
    from attention_jax.configs import default

    return default.get_config()


def model_config(
    config: ml_collections.ConfigDict, platform: str | None = None
) -> TransformerConfig:
    """config.model + config.vocab_size -> TransformerConfig (ValueError names a bad field),
    its attention_impl resolved for `platform` (default: this machine's backend), once:
    'auto' -> 'cudnn' or 'xla' (`model.attention.resolve_impl`)."""
    return resolve_config(_model_fields(config), platform)


def build_model(config: ml_collections.ConfigDict, model_cfg: TransformerConfig) -> Transformer:
    """A freshly initialized Transformer of `model_cfg` (`model_config(config)`, resolved
    once by the caller): `params` from `config.seed`, dropout streams from `seed + 1`."""
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    return Transformer(model_cfg, rngs=rngs)


def _model_fields(config: ml_collections.ConfigDict) -> TransformerConfig:
    return TransformerConfig.from_dict({**config.model.to_dict(), "vocab_size": config.vocab_size})


def search_settings(config: ml_collections.ConfigDict) -> SearchSettings:
    """config.search -> the evaluations' SearchSettings (ValueError names a bad field)."""
    return SearchSettings(**config.search.to_dict())


def _renamed(saved: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields under their current names (configs/default.py `RENAMED`)."""
    saved = dict(saved)
    for old, new in RENAMED.items():
        if old in saved and "." in new:
            group, name = new.split(".")
            saved[group] = {**saved.get(group, {}), name: saved.pop(old)}
        elif old in saved:
            saved[new] = saved.pop(old)
    return saved


# --- Checks ----------------------------------------------------------------------------


def _unknown_keys(config: Any, reference: Any, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, close matches) for every key of `config` that `reference` lacks."""
    out = []
    for key in config:
        name = f"{prefix}{key}"
        if key not in reference:
            out.append((name, difflib.get_close_matches(key, list(reference.keys()), n=1)))
        elif isinstance(config[key], ml_collections.ConfigDict) and isinstance(
            reference[key], ml_collections.ConfigDict
        ):
            out += _unknown_keys(config[key], reference[key], name + ".")
    return out


def _check_fields(config: ml_collections.ConfigDict) -> None:
    """Names, ranges and choices of the machine-independent fields."""
    unknown = _unknown_keys(config, defaults())
    renamed = [f"config.{k} is now config.{RENAMED[k]}" for k, _ in unknown if k in RENAMED]
    if renamed:
        raise UserError(f"renamed config field(s): {'; '.join(renamed)}")
    if unknown:
        hints = [f"config.{k}" + (f" (did you mean {m[0]!r}?)" if m else "") for k, m in unknown]
        raise UserError(f"unknown config field(s): {', '.join(hints)}")
    for name in _POSITIVE:
        if not config[name] > 0:
            raise UserError(f"config.{name} must be > 0, got {config[name]!r}")
    for name in _NON_NEGATIVE:
        if not config[name] >= 0:
            raise UserError(f"config.{name} must be >= 0 (0 = never/all), got {config[name]!r}")
    for name, allowed in _CHOICES.items():
        if config[name] not in allowed:
            raise UserError(f"config.{name} must be one of {allowed}, got {config[name]!r}")
    if config.early_stop_patience and not config.eval_every_steps:
        raise UserError(
            "config.early_stop_patience counts dev evaluations: set config.eval_every_steps "
            "> 0, or early_stop_patience=0"
        )
    if config.loss_logits_dtype != "float32" and not config.loss_chunk_tokens:
        raise UserError(  # the loss over the whole vocabulary at once keeps float32 logits
            f"config.loss_logits_dtype={config.loss_logits_dtype!r} takes effect only with "
            "config.loss_chunk_tokens > 0: set --config.loss_chunk_tokens=2048 (as base and "
            "big do), or leave loss_logits_dtype at 'float32'"
        )
    for name in ("label_smoothing", "adam_b1", "adam_b2"):
        if not 0.0 <= config[name] < 1.0:
            raise UserError(f"config.{name} must be in [0, 1), got {config[name]}")
    if not config.adam_eps > 0:
        raise UserError(f"config.adam_eps must be > 0, got {config.adam_eps}")
    if config.schedule != "rsqrt" and not config.learning_rate > 0:
        raise UserError(f"config.learning_rate must be > 0, got {config.learning_rate}")
    try:
        _model_fields(config)
    except ValueError as e:
        raise UserError(f"bad model config: {e}") from e
    try:
        search_settings(config)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad config.search: {e}") from e
    if config.max_length > config.model.max_len:
        raise UserError(
            f"config.max_length={config.max_length} exceeds config.model.max_len="
            f"{config.model.max_len}, the longest position the model encodes"
        )


def _check_machine(config: ml_collections.ConfigDict, num_devices: int, num_processes: int) -> None:
    """The mesh, the data shards and the batch against the devices and processes."""
    sizes = tuple(config[f"mesh_{a}"] for a in MESH_AXES)
    shape = dict(zip(MESH_AXES, mesh_shape(sizes, num_devices), strict=True))
    pc = num_processes
    if pc > 1 and config.data_shards not in (0, pc):
        raise UserError(
            f"config.data_shards={config.data_shards} with {pc} processes: use 0 (one shard "
            f"per process) or {pc}; only a single process can read several shards"
        )
    # The longest bucket must hold one row per batch-axis device (times grad_accum_steps).
    batch_devices = shape["data"] * shape["fsdp"]
    rows = batch_devices * config.grad_accum_steps
    need = rows * config.max_length
    if config.batch_tokens < need:
        raise UserError(
            f"config.batch_tokens={config.batch_tokens} cannot fill the batch axes: the mesh "
            f"has {batch_devices} devices along ('data', 'fsdp') (mesh {shape}) and "
            f"grad_accum_steps={config.grad_accum_steps}, so a batch needs at least {rows} "
            f"rows of up to max_length={config.max_length} tokens: set "
            f"--config.batch_tokens={need} or more, lower max_length, or put devices on the "
            "'tensor' axis"
        )


def validate(
    config: ml_collections.ConfigDict,
    num_devices: int | None = None,
    num_processes: int | None = None,
) -> None:
    """Raise UserError naming the first bad field; nothing slow has happened yet.

    The machine checks are against this job's devices and processes, or the given
    counts (train.py --compile_for checks a slice it does not run on).
    """
    _check_fields(config)
    _check_machine(
        config,
        jax.device_count() if num_devices is None else num_devices,
        jax.process_count() if num_processes is None else num_processes,
    )


# --- The copy in the workdir -------------------------------------------------------------


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Write WORKDIR/config.json (atomically: a reader never sees half a file)."""
    with atomic_write(os.path.join(workdir, CONFIG_FILE), "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def _merge(base: ml_collections.ConfigDict, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(base.get(key), ml_collections.ConfigDict):
            _merge(base[key], value)
        else:
            base[key] = value


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """WORKDIR/config.json laid over configs/default.py (fields added since keep defaults)."""
    if not os.path.isdir(workdir):
        raise UserError(f"workdir {workdir!r} does not exist; train a model into it first")
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise UserError(
            f"{path} is missing; is {workdir!r} a training workdir? Train with "
            f"`python train.py --config=configs/tiny.py --workdir={workdir}`"
        )
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({e}); fix or delete it") from e
    config = defaults()
    with config.unlocked():
        _merge(config, _renamed(saved))
    return config


# Fields whose change alters the parameters' shapes or tree: such a checkpoint cannot
# be resumed. Other model fields (dropout, activation, dtype, attention_impl, remat,
# max_len) change how the same parameters compute, and resume.
MODEL_STRUCTURE = (
    "vocab_size",
    "model.d_model",
    "model.num_heads",
    "model.num_encoder_layers",
    "model.num_decoder_layers",
    "model.d_ff",
    "model.norm",
    "model.share_embeddings",
    "model.tie_output",
    "model.param_dtype",
    "model.attention_bias",
    "model.logits_bias",
    "model.positions",  # 'table' adds a parameter
)
# Fields that can change the optimizer state's structure (a transform added or removed).
OPTIMIZER_STRUCTURE = ("optimizer", "grad_clip_norm", "weight_decay")


def _flat(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """{dotted field: value}, tuples as lists (what config.json holds)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update({f"{key}.{k}": v for k, v in _flat(value).items()})
        else:
            out[key] = json.loads(json.dumps(value)) if isinstance(value, tuple) else value
    return out


def changed_fields(old: ml_collections.ConfigDict, new: ml_collections.ConfigDict) -> dict:
    """{dotted field: (old value, new value)} for every field that differs."""
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def describe(changes: dict, fields: tuple[str, ...] | None = None) -> str:
    """'model.d_model: checkpoint 32, config 64; ...' for `fields` (None = all) that changed."""
    keys = [k for k in changes if fields is None or k in fields]
    return "; ".join(f"{k}: checkpoint {changes[k][0]!r}, config {changes[k][1]!r}" for k in keys)


def check_resume(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Compare `config` with WORKDIR/config.json (the run that wrote the checkpoints).

    Logs every changed field. A change to the model's structure (MODEL_STRUCTURE)
    is a UserError naming the fields; everything else resumes (the optimizer
    state's structure is checked against the checkpoint itself when restoring).
    Returns the changes ({} for a workdir without config.json).
    """
    if not os.path.isfile(os.path.join(workdir, CONFIG_FILE)):
        return {}
    changes = changed_fields(load_config(workdir), config)
    if changes:
        _log.info(f"config changed since the checkpoints were written: {describe(changes)}")
    structural = describe(changes, MODEL_STRUCTURE)
    if structural:
        raise UserError(
            f"the checkpoints in {workdir} were trained with another model config "
            f"({structural}). Use the same model settings to resume, or a fresh --workdir "
            "for a new model"
        )
    return changes

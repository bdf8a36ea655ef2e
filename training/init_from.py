"""Fine-tuning from a trained OPUS-MT / Marian model: `config.init_from=DIR`.

    config = adopt_model(config)            # DIR's model: config.model.* and vocab_size
    tokenizer = run_tokenizer(config, workdir, corpus)   # DIR's, copied into the workdir
    state = with_imported_params(state, setup)   # a fresh state, holding DIR's weights

The run then trains as any other: its workdir holds DIR's tokenizer (source.spm,
target.spm, marian_vocab.json) instead of tokenizer.model, and config.json the
model's shape, so decode.py --workdir and every export read it as they read a
workdir trained from scratch. Only a fresh start takes DIR's weights; a resumed
run restores its own checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from attention_jax.backends import marian
from attention_jax.data import (
    Tokenizer,
    atomic_write_bytes,
    get_tokenizer,
    has_tokenizer,
    load_tokenizer,
)
from attention_jax.runtime import distributed
from attention_jax.runtime.errors import UserError
from attention_jax.training import config as config_lib
from attention_jax.training import steps

_log = logging.getLogger(__name__)

# The model's shape and Marian's variations come from DIR; dropout, dtypes, the
# attention kernel and rematerialization stay the config's (they train, not define, it).
ADOPTED = (
    "d_model",
    "num_heads",
    "num_encoder_layers",
    "num_decoder_layers",
    "d_ff",
    "activation",
    "norm",
    "share_embeddings",
    "tie_output",
    "max_len",
    "attention_bias",
    "logits_bias",
    "positions",
    "zero_start",
)


@functools.lru_cache(maxsize=1)
def _imported(directory: str) -> tuple[Any, list[str]]:
    """load_marian, once per run: the config and the parameters both come from it."""
    return marian.load_marian(directory)


def _model_of(directory: str, workdir: str | None) -> tuple[dict[str, Any], int]:
    """(the ADOPTED fields, vocab_size) of DIR's model: from the workdir's config.json when
    a run from the same DIR wrote it (a resumed run needs DIR no more), else from DIR."""
    if workdir and os.path.isfile(os.path.join(workdir, config_lib.CONFIG_FILE)):
        saved = config_lib.load_config(workdir)
        if saved.init_from == directory:
            return {name: saved.model[name] for name in ADOPTED}, saved.vocab_size
    if not os.path.isdir(directory):
        raise UserError(f"config.init_from={directory}: not a directory")
    model, pieces = _imported(directory)
    return {name: getattr(model.config, name) for name in ADOPTED}, len(pieces)


def adopt_model(
    config: ml_collections.ConfigDict, workdir: str | None = None
) -> ml_collections.ConfigDict:
    """`config` with the model fields (`ADOPTED`) and vocab_size of config.init_from's
    model; unchanged when init_from is empty. UserError for an unreadable DIR."""
    directory = config.init_from
    if directory is None:
        raise UserError(
            "this config fine-tunes a trained model: pass --config.init_from=DIR (an OPUS-MT "
            "/ Marian model directory, as decode.py --marian reads it)"
        )
    if not directory:
        return config
    fields, vocab_size = _model_of(directory, workdir)
    config = config.copy_and_resolve_references()
    changed = []
    for name, value in fields.items():
        if config.model[name] != value:
            changed.append(f"{name} {config.model[name]!r} -> {value!r}")
        config.model[name] = value
    if config.vocab_size != vocab_size:
        changed.append(f"vocab_size {config.vocab_size} -> {vocab_size}")
    config.vocab_size = vocab_size
    if changed:
        _log.info(f"config.init_from={directory}: the model's {', '.join(changed)}")
    return config


def run_tokenizer(config: ml_collections.ConfigDict, workdir: str, corpus: Any) -> Tokenizer:
    """The run's tokenizer, the workdir's: if it has none, process 0 copies config.init_from's
    into it (`write_tokenizer`) or trains one on `corpus` (`data.get_tokenizer`), and the
    other processes then load it."""
    if jax.process_index() == 0:
        write_tokenizer(config, workdir)
        tokenizer = get_tokenizer(config, workdir, corpus)
    distributed.sync("tokenizer")
    if jax.process_index() != 0:
        tokenizer = get_tokenizer(config, workdir, corpus)
    return tokenizer


def write_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Put config.init_from's tokenizer into a workdir that has none (no SentencePiece
    model is fitted); a workdir with a tokenizer must hold that one."""
    if not config.init_from:
        return
    held = has_tokenizer(workdir)  # a resumed run's, or one that stopped before a checkpoint
    if held and not os.path.isdir(config.init_from):
        return
    wanted = marian.opus_tokenizer(config.init_from)
    if held:
        if load_tokenizer(workdir).fingerprint != wanted.fingerprint:
            raise UserError(
                f"{workdir} holds another tokenizer than config.init_from={config.init_from}'s: "
                "fine-tune into a fresh workdir"
            )
        return
    for name, contents in wanted.files().items():
        atomic_write_bytes(os.path.join(workdir, name), contents)
    _log.info(f"the tokenizer of {config.init_from} -> {workdir}")


def with_imported_params(state: steps.TrainState, setup: steps.TrainSetup) -> steps.TrainState:
    """A fresh train state whose parameters are config.init_from's, placed as the state's
    (each process fills the shards its devices hold)."""
    directory = setup.config.init_from
    model, _ = _imported(directory)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    want = jax.tree.structure(setup.abstract.params)
    if jax.tree.structure(params) != want:
        raise UserError(f"config.init_from={directory}: its parameters do not fit the model")

    def place(value: Any, abstract: jax.ShapeDtypeStruct) -> jax.Array:
        host = np.asarray(value, abstract.dtype)
        if host.shape != abstract.shape:
            raise UserError(
                f"config.init_from={directory}: a parameter of shape {host.shape} where the "
                f"model has {abstract.shape}"
            )
        return jax.make_array_from_callback(host.shape, abstract.sharding, lambda i: host[i])

    placed = jax.tree.map(place, params, setup.abstract.params)
    _imported.cache_clear()  # the host copy is no longer needed
    _log.info(f"parameters from {directory} (step 0)")
    return state.replace(params=placed)

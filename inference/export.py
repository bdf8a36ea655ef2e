"""A self-contained translator: tokenizer, serialized search programs, parameters, metadata.

    export_translator(model, tokenizer_proto, "translator/", beam_size=4, alpha=0.6)
    translator = ExportedTranslator.load("translator/")  # no checkpoint, no model classes
    hyps = translator.translate(sources)                   # a Translator, as LiveTranslator

The directory holds
    tokenizer.model      the SentencePiece model (ids 0 pad, 1 EOS, 2 BOS, 3 unk)
    params.npz           the parameters as arrays p0000, p0001, ... in the order the
                         programs take them (a flat list: no pytree classes needed)
    search_S{W}.jax      `jax.export` serialization (StableHLO) of encode + search for
                         sources padded to width W, one per width of
                         data.plans.inference_widths(max_len); the batch dimension
                         is symbolic, so any number of rows runs the same program
    metadata.json        config, beam, alpha, n_best, widths, vocab_limit, shapes, jax
                         version and the platforms the programs were lowered for

Each program is `inference.translate.search_fn` of the live model with the
parameters as an argument, so the exported translator batches, searches and
prints exactly as decode.py does with the checkpoint. docs/decoding.md shows
how to call a program from plain JAX.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.files import atomic_write, atomic_write_bytes
from data.plans import inference_widths
from inference.translate import Hypothesis, Progress, run_batches, search_fn
from model import Transformer
from model.decoding import DEFAULT_LENGTH_PENALTY, EXTRA_DECODE_LEN

FORMAT_VERSION = 1
METADATA = "metadata.json"
PARAMS = "params.npz"
TOKENIZER = "tokenizer.model"

_log = logging.getLogger(__name__)


def _program_name(width: int) -> str:
    return f"search_S{width}.jax"


def export_translator(
    model: Transformer,
    tokenizer_proto: bytes,
    directory: str,
    *,
    beam_size: int,
    alpha: float,
    n_best: int = 1,
    vocab_limit: int | None = None,
    config: dict | None = None,
    platforms: Sequence[str] | None = None,
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
) -> dict:
    """Write the translator into `directory` (created; files replaced); returns the metadata.

    Args:
      model: the Transformer to export (its config's max_len bounds the widths).
      tokenizer_proto: the serialized SentencePiece model.
      beam_size, alpha, n_best, vocab_limit, length_penalty: fixed into the programs.
      config: the training config, stored in the metadata for reference.
      platforms: backends to lower for (e.g. ("cpu", "cuda")); None = this one.
    """
    os.makedirs(directory, exist_ok=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    max_len = model.config.max_len
    widths = inference_widths(max_len)

    def program(width: int) -> bytes:
        def translate(flat_params, src):  # [P arrays], [B, W] -> [B, n, L], [B, n]
            live = nnx.merge(graphdef, jax.tree.unflatten(treedef, flat_params), rest)
            search = search_fn(
                live,
                beam_size=beam_size,
                alpha=alpha,
                n_best=n_best,
                vocab_limit=vocab_limit,
                length_penalty=length_penalty,
            )
            return search(src)

        (b,) = jax.export.symbolic_shape("b")
        args = (
            [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
            jax.ShapeDtypeStruct((b, width), jnp.int32),
        )
        exported = jax.export.export(jax.jit(translate), platforms=platforms)(*args)
        return exported.serialize()

    shapes = {}
    for width in widths:
        t0 = time.time()
        blob = program(width)
        atomic_write_bytes(os.path.join(directory, _program_name(width)), blob)
        shapes[width] = len(blob)
        seconds = time.time() - t0
        _log.info(f"exported the width-{width} search: {len(blob) / 1e6:.2f} MB, {seconds:.1f}s")
    arrays = {f"p{i:04d}": np.asarray(x) for i, x in enumerate(leaves)}
    with atomic_write(os.path.join(directory, PARAMS)) as f:
        np.savez(f, **arrays)
    atomic_write_bytes(os.path.join(directory, TOKENIZER), tokenizer_proto)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    metadata = {
        "format_version": FORMAT_VERSION,
        "beam_size": beam_size,
        "alpha": alpha,
        "length_penalty": length_penalty,
        "n_best": n_best,
        "vocab_limit": vocab_limit,
        "max_len": max_len,
        "widths": widths,
        "program_bytes": {str(w): n for w, n in shapes.items()},
        "inputs": "flat params (params.npz p0000..), src int32 [b, W] (0 pad, EOS-terminated)",
        "outputs": "tokens int32 [b, n_best, L] (EOS-terminated, 0 after), scores f32 [b, n_best]",
        "output_length": {str(w): min(w + EXTRA_DECODE_LEN, max_len) for w in widths},
        "num_params": len(leaves),
        "param_paths": paths,
        "model": dataclasses.asdict(model.config),
        "config": config or {},
        "platforms": list(platforms or [jax.default_backend()]),
        "jax_version": jax.__version__,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_bytes(os.path.join(directory, METADATA), json.dumps(metadata, indent=2).encode())
    return metadata


class ExportedTranslator:
    """An exported directory as a `Translator` (its programs are loaded on first use).

    Beam size, alpha, n_best and the longest source are the export's (its metadata).
    """

    def __init__(
        self, directory: str, metadata: dict, params: list[np.ndarray], batch_tokens: int = 4096
    ):
        self.directory, self.metadata, self.params = directory, metadata, params
        self.batch_tokens = batch_tokens
        self.max_len, self.n_best = metadata["max_len"], metadata["n_best"]
        self.beam_size, self.alpha = metadata["beam_size"], metadata["alpha"]
        # Exports made before length penalties could be chosen used GNMT's.
        self.length_penalty = metadata.get("length_penalty", DEFAULT_LENGTH_PENALTY)
        self._programs: dict[int, jax.export.Exported] = {}

    @classmethod
    def load(cls, directory: str, batch_tokens: int = 4096) -> ExportedTranslator:
        """Read metadata.json and params.npz (ValueError with the fix if they are missing)."""
        path = os.path.join(directory, METADATA)
        if not os.path.isfile(path):
            raise ValueError(
                f"{path} is missing: is {directory!r} a directory written by "
                "`decode.py --workdir=W --export=DIR`?"
            )
        with open(path) as f:
            metadata = json.load(f)
        if metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format version {metadata.get('format_version')} unknown")
        with np.load(os.path.join(directory, PARAMS)) as npz:
            params = [npz[f"p{i:04d}"] for i in range(metadata["num_params"])]
        return cls(directory, metadata, params, batch_tokens)

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.directory, TOKENIZER)

    def _search(self, src: jax.Array) -> tuple[jax.Array, jax.Array]:
        width = src.shape[1]
        if width not in self._programs:
            with open(os.path.join(self.directory, _program_name(width)), "rb") as f:
                self._programs[width] = jax.export.deserialize(bytearray(f.read()))
        return self._programs[width].call(self.params, src)

    def translate(
        self, sources: Sequence[Sequence[int]], progress: Progress | None = None
    ) -> list[list[Hypothesis]]:
        """As `inference.translate.translate_ids` with the exported beam, alpha and n_best."""
        return run_batches(
            self._search,
            sources,
            max_len=self.max_len,
            batch_tokens=self.batch_tokens,
            progress=progress,
        )

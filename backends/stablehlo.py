"""A self-contained translator: tokenizer, serialized search programs, parameters, metadata.

    export_translator(model, tokenizer.files(), "translator/", SearchSettings(beam_size=4))
    translator = ExportedTranslator.load("translator/")  # no checkpoint, no model classes
    hyps = translator.translate(sources)                   # a Translator, as LiveTranslator

The directory holds
    tokenizer.model      the SentencePiece model (ids 0 pad, 1 EOS, 2 BOS, 3 unk), or an
                         OPUS-MT model's source.spm, target.spm and marian_vocab.json
    params.npz           the parameters as arrays p0000, p0001, ... in the order the
                         programs take them (a flat list: no pytree classes needed)
    search_S{W}.jax      `jax.export` serializations (StableHLO) of the search that
                         decode.py runs for a batch of sources padded to width W
                         (search/stages.py), its stages of growing room included:
                         (params, src) -> (tokens, scores); usable from plain JAX
                         (docs/decoding.md)
    score_S{W}.jax       the log-probability of each token of given translations padded
                         to width W (search/likelihood.py): (params, src, tgt) -> [b, W]
    metadata.json        config, beam, alpha, n_best, length penalty, widths and each
                         width's rooms, vocab_limit, shapes, jax version and the
                         platforms the programs were lowered for

One program per width W of data.plans.inference_widths(max_len); the batch
dimension is symbolic, so any number of rows runs the same program. The
programs are the live model's (search.translate.LiveSearch, search_fn) with
the parameters as an argument, so the exported translator batches, searches and
prints exactly as decode.py does with the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_jax import Transformer
from attention_jax.data import (
    atomic_write,
    atomic_write_bytes,
    inference_widths,
    read_versioned_json,
)
from attention_jax.search.decoding import tracing_for
from attention_jax.search.hypothesis import Hypothesis, IdLists, Indices, PerSource
from attention_jax.search.likelihood import score_pairs, token_log_probs
from attention_jax.search.scoring import output_limit
from attention_jax.search.settings import SearchSettings
from attention_jax.search.stages import Targets, run_stages, stage_rooms
from attention_jax.search.translate import Progress, search_fn

# 2: staged programs (start_S*, resume_S*_C*) beside the one-program search_S*.
# 3: the staged programs take `keep` and `until` and stop early; a resume for every room.
# 4: search_S* alone, the live search's program (its rooms in stages).
FORMAT_VERSION = 4
METADATA = "metadata.json"
PARAMS = "params.npz"

_log = logging.getLogger(__name__)


def _whole_name(width: int) -> str:
    return f"search_S{width}.jax"


def _score_name(width: int) -> str:
    return f"score_S{width}.jax"


def _serialize(fn, args, platforms) -> tuple[bytes, object]:
    """jax.export of fn at args (abstract) -> (serialized program, abstract outputs); its
    searches step as they do on each of `platforms` (None: this backend)."""
    with tracing_for(*(platforms or [jax.default_backend()])):
        exported = jax.export.export(jax.jit(fn), platforms=platforms)(*args)
    return exported.serialize(), exported.out_avals


def export_translator(
    model: Transformer,
    tokenizer_files: dict[str, bytes],
    directory: str,
    settings: SearchSettings,
    *,
    vocab_limit: int | None = None,
    config: dict | None = None,
    platforms: Sequence[str] | None = None,
) -> dict:
    """Write the translator into `directory` (created; files replaced); returns the metadata.

    Args:
      model: the Transformer to export (its config's max_len bounds the widths).
      tokenizer_files: the tokenizer's files ({name: contents}, `tokenizer.files()`).
      settings: beam_size, alpha, n_best, length_penalty, stop and min_length are fixed
        into the programs (batch_tokens is the reader's).
      vocab_limit: never emit ids >= this, also fixed into the programs.
      config: the training config, stored in the metadata for reference.
      platforms: backends to lower for (e.g. ("cpu", "cuda")); None = this one.
    """
    os.makedirs(directory, exist_ok=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    max_len = model.config.max_len
    widths = inference_widths(max_len)
    live = lambda flat: nnx.merge(graphdef, jax.tree.unflatten(treedef, flat), rest)
    sizes, rooms = _write_programs(
        directory, live, leaves, model.config, settings, vocab_limit, platforms
    )
    arrays = {f"p{i:04d}": np.asarray(x) for i, x in enumerate(leaves)}
    with atomic_write(os.path.join(directory, PARAMS)) as f:
        np.savez(f, **arrays)
    for name, data in tokenizer_files.items():
        atomic_write_bytes(os.path.join(directory, name), data)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    metadata = {
        "format_version": FORMAT_VERSION,
        "beam_size": settings.beam_size,
        "alpha": settings.alpha,
        "length_penalty": settings.length_penalty,
        "stop": settings.stop,
        "min_length": settings.min_length,
        "n_best": settings.n_best,
        "vocab_limit": vocab_limit,
        "max_len": max_len,
        "widths": widths,
        "rooms": {str(w): r for w, r in rooms.items()},
        "program_bytes": sizes,
        "inputs": "flat params (params.npz p0000..), src int32 [b, W] (0 pad, EOS-terminated)",
        "outputs": "tokens int32 [b, n_best, L] (EOS-terminated, 0 after), scores f32 [b, n_best]",
        "score_programs": "score_S{W}.jax: flat params, src and tgt int32 [b, W] (0 pad, "
        "EOS-terminated) -> each tgt token's log-probability f32 [b, W] (0 at padding)",
        "output_length": {str(w): output_limit(w, max_len) for w in widths},
        "num_params": len(leaves),
        "param_paths": paths,
        "model": model.config.to_dict(),
        "config": config or {},
        "platforms": list(platforms or [jax.default_backend()]),
        "jax_version": jax.__version__,
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_bytes(os.path.join(directory, METADATA), json.dumps(metadata, indent=2).encode())
    return metadata


def _write_programs(
    directory: str,
    live: Callable[[list[Any]], Transformer],
    leaves: list[Any],
    model_config: Any,
    settings: SearchSettings,
    vocab_limit: int | None,
    platforms: Sequence[str] | None,
) -> tuple[dict[str, int], dict[int, list[int]]]:
    """Serialize each width's search into `directory`. Returns (bytes per program, rooms
    per width)."""
    max_len = model_config.max_len

    def whole(flat, src):  # [P arrays], [B, W] -> [B, n, L], [B, n]
        return search_fn(live(flat), settings, vocab_limit)(src)

    def score(flat, src, tgt):  # [P arrays], [B, W], [B, W] -> [B, W]
        return token_log_probs(live(flat), src, tgt)

    (b,) = jax.export.symbolic_shape("b")
    flat = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    sizes, rooms = {}, {}
    t0 = time.time()
    for width in inference_widths(max_len):
        src = jax.ShapeDtypeStruct((b, width), jnp.int32)
        rooms[width] = stage_rooms(width, max_len)
        for name, fn, args in ((_whole_name(width), whole, (flat, src)),
                               (_score_name(width), score, (flat, src, src))):  # fmt: skip
            blob, _ = _serialize(fn, args, platforms)
            atomic_write_bytes(os.path.join(directory, name), blob)
            sizes[name] = len(blob)
        _log.info(f"exported the width-{width} program ({time.time() - t0:.1f}s so far)")
    return sizes, rooms


class ExportedTranslator:
    """An exported directory as a `Backend` (its programs are loaded on first use).

    Its settings (beam size, alpha, n_best, length penalty, stop) and the longest source
    are the export's (its metadata); only batch_tokens is the reader's.
    """

    def __init__(
        self,
        directory: str,
        metadata: dict,
        params: list[np.ndarray],
        batch_tokens: int | None = None,
    ):
        self.directory, self.metadata, self.params = directory, metadata, params
        self.max_len = metadata["max_len"]
        self.settings = SearchSettings(
            beam_size=metadata["beam_size"],
            alpha=metadata["alpha"],
            n_best=metadata["n_best"],
            length_penalty=metadata["length_penalty"],
            stop=metadata["stop"],
            min_length=metadata["min_length"],
            batch_tokens=batch_tokens,
        )
        self._programs: dict[str, jax.export.Exported] = {}

    @classmethod
    def load(cls, directory: str, batch_tokens: int | None = None) -> ExportedTranslator:
        """Read metadata.json and params.npz (ValueError with the fix if they are missing)."""
        writer = "decode.py --workdir=W --export=DIR"
        metadata = read_versioned_json(directory, METADATA, FORMAT_VERSION, writer)
        path = os.path.join(directory, METADATA)
        for width in metadata["widths"]:
            if metadata["rooms"][str(width)] != stage_rooms(width, metadata["max_len"]):
                raise ValueError(f"{path}: stages of another version; export the translator again")
        with np.load(os.path.join(directory, PARAMS)) as npz:
            params = [npz[f"p{i:04d}"] for i in range(metadata["num_params"])]
        return cls(directory, metadata, params, batch_tokens)

    def whole(
        self, src: jax.Array, rooms: Sequence[int], controls: Any = None
    ) -> tuple[jax.Array, jax.Array]:
        """search.stages.Search: the exported search of sources of src's width (its rooms
        are the export's: `load` checked they are `stage_rooms`; no prefixes or phrases)."""
        return self._program(_whole_name(src.shape[1])).call(self.params, src)

    @property
    def scores(self) -> bool:
        """Whether the export has the programs `score` runs."""
        return "score_programs" in self.metadata

    def _program(self, name: str) -> jax.export.Exported:
        """The program `name` of the directory, read once."""
        if name not in self._programs:
            with open(os.path.join(self.directory, name), "rb") as f:
                self._programs[name] = jax.export.deserialize(bytearray(f.read()))
        return self._programs[name]

    def score(
        self, sources: IdLists, given: IdLists, progress: Progress | None = None, skip: Indices = ()
    ) -> PerSource:
        """As `search.translate.LiveTranslator.score`, with the exported score programs
        (ValueError for an export written before they were)."""
        if not self.scores:
            raise ValueError(
                f"{self.directory} was exported without scoring programs: export it again"
            )
        call = lambda src, tgt: self._program(_score_name(src.shape[1])).call(self.params, src, tgt)
        return score_pairs(
            call, sources, given, max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch, progress=progress, skip=skip,
        )  # fmt: skip

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
        targets: Targets | None = None,
    ) -> list[list[Hypothesis]]:
        """As `search.translate.translate_ids` with the exported beam, alpha and n_best
        (ValueError for prefixes or constraints: the exported programs take neither)."""
        if targets is not None:
            raise ValueError(
                "an exported translator takes no prefixes or constraints: translate with "
                "--workdir (or --ct2 for prefixes)"
            )
        return run_stages(
            self,
            sources,
            max_len=self.max_len,
            batch_tokens=self.settings.tokens_per_batch,
            progress=progress,
            skip=skip,
        )

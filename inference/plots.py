"""Cross-attention heatmaps: one PNG per sentence, a panel per decoder layer.

paths = plot_lines(model, tokenizer, translated, "pictures/", count=4)
maps = attention_maps(model, src_ids, out_ids)   # [L_dec, T, S]: what each panel shows
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from attention_jax import BOS_ID, EOS_ID, Transformer
from attention_jax.data import inference_width
from attention_jax.inference.lines import Translated


@functools.partial(jax.jit, static_argnames="graphdef")
def _head_means(graphdef: Any, state: Any, src: jax.Array, tgt_in: jax.Array) -> jax.Array:
    """src [1, S], tgt_in [1, T] -> [L_dec, T, S]: each decoder layer's cross-attention,
    the mean of its heads."""
    return nnx.merge(graphdef, state).cross_attention_weights(src, tgt_in)[:, 0].mean(axis=1)


def _padded(ids: Sequence[int], max_len: int) -> np.ndarray:
    """[1, W]: ids then padding, W a fixed width (`inference_width`), so that sentences of
    many lengths share a few compiled programs (padding is masked: it changes no weight)."""
    row = np.zeros((1, inference_width(len(ids), max_len)), np.int32)
    row[0, : len(ids)] = ids
    return row


def attention_maps(model: Transformer, src: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """[L_dec, T, S]: where each of the output's T tokens (`out`, then EOS) looked in the
    source's S (ids with EOS), per decoder layer: its cross-attention, the mean of its
    heads."""
    max_len = model.config.max_len
    tgt_in = _padded([BOS_ID, *out], max_len)  # row t predicts token t (EOS last)
    weights = _head_means(*nnx.split(model), _padded(src, max_len), tgt_in)
    return np.asarray(weights)[:, : len(out) + 1, : len(src)]


def plot_attention(
    model: Transformer,
    tokenizer: Any,
    sources: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    directory: str,
    first: int = 0,
) -> list[str]:
    """One PNG per (source ids with EOS, output ids) pair: cross-attention, mean over heads.

    Returns the paths written (DIRECTORY/attention_000.png, ..., numbered from `first`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for n, (src, out) in enumerate(zip(sources, outputs, strict=True)):
        tgt = [*out, EOS_ID]
        weights = attention_maps(model, src, out)  # [L_dec, T, S]
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
        path = os.path.join(directory, f"attention_{first + n:03d}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_lines(
    model: Transformer,
    tokenizer: Any,
    translated: Translated,
    directory: str,
    count: int,
    first: int = 0,
) -> list[str]:
    """Plots of the first `count` lines' first segments and their best translations (files
    numbered from `first`: a chunk after plots of earlier chunks)."""
    firsts: dict[int, int] = {}  # each line's first segment
    for n, segment in enumerate(translated.segments):
        firsts.setdefault(segment.line, n)
    chosen = [n for _, n in sorted(firsts.items())][:count]
    search = translated.search
    return plot_attention(
        model,
        tokenizer,
        [translated.segments[n].ids for n in chosen],
        [search[n][0].tokens if search[n] else [] for n in chosen],
        directory,
        first,
    )

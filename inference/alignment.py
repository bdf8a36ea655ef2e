"""Word alignments from cross-attention, printed as fast_align and Marian print them.

    links = word_alignments(model, pieces, [(src_ids, out_ids), ...])   # ["0-0 1-2 2-1", ...]
    add_alignments(model, tokenizer, translated)   # decode.py's lines: "alignment" per hypothesis

For each (source, translation) pair the decoder is run once over the translation
(teacher forcing, as `Transformer.cross_attention_weights`), and its
cross-attention weights are averaged over every decoder layer and head: one
[T, S] matrix per pair, row t being where output token t looked in the source.
Subwords are merged into words (a SentencePiece piece that starts with '▁'
starts a word): a target word's rows are summed, a source word's columns are
summed, and each target word is linked to the source word it attends to most.
EOS rows and columns are left out. Pairs are "i-j" with i the source word and
j the target word, both 0-based indices into the whitespace-separated words
(of the line as SentencePiece normalizes it), sorted by j.

The mean over all layers and heads is the simplest choice that needs no
training signal; single layers align better in some models (Garg et al., 2019
found the penultimate layer best), which `layers` lets a user pick.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_jax import BOS_ID, EOS_ID, Transformer
from attention_jax.data import inference_width, plan_static
from attention_jax.inference.lines import Translated

WORD_START = "▁"


def word_ids(pieces: Sequence[str]) -> np.ndarray:
    """[n] word index of each piece: a piece starting with '▁' opens a new word."""
    ids, word = [], -1
    for i, piece in enumerate(pieces):
        if piece.startswith(WORD_START) or i == 0:
            word += 1
        ids.append(word)
    return np.asarray(ids, np.int64)


def align_words(weights: np.ndarray, src_words: np.ndarray, tgt_words: np.ndarray) -> str:
    """weights [T, S] (output token x source token) -> "i-j ..." word links, sorted by j."""
    if weights.size == 0:
        return ""
    n_src, n_tgt = int(src_words.max()) + 1, int(tgt_words.max()) + 1
    merged = np.zeros((n_tgt, n_src), np.float64)
    np.add.at(merged, (tgt_words[:, None], src_words[None, :]), weights)  # [T', S']
    return " ".join(f"{int(i)}-{j}" for j, i in enumerate(merged.argmax(axis=1)))


@functools.partial(jax.jit, static_argnames=("graphdef", "layers"))
def _mean_weights(graphdef, state, src, tgt_in, layers):
    """src [B, S], tgt_in [B, T] -> cross-attention weights [B, T, S], mean of layers x heads."""
    model = nnx.merge(graphdef, state)
    w = model.cross_attention_weights(src, tgt_in)  # [L_dec, B, N, T, S]
    if layers is not None:
        w = w[jnp.asarray(layers)]
    return w.mean(axis=(0, 2))  # [B, T, S]


def word_alignments(
    model: Transformer,
    piece: Callable[[int], str],
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    layers: tuple[int, ...] | None = None,
    batch_rows: int = 32,
) -> list[str]:
    """Word links "i-j ..." for each (source ids with EOS, output ids without EOS) pair.

    Args:
      model: the Transformer that produced the outputs.
      piece: token id -> SentencePiece piece (`Tokenizer.id_to_piece`).
      pairs: source ids (EOS-terminated, as translated) and output ids (no BOS/EOS).
      layers: decoder layers to average (None = all).
      batch_rows: pairs per forward pass; widths are padded to a few fixed values
        so that a file compiles a handful of programs.
    Returns:
      one string per pair ("" for an empty output).
    """
    max_len = model.config.max_len
    graphdef, state = nnx.split(model)
    out = [""] * len(pairs)
    todo = [i for i, (_, tgt) in enumerate(pairs) if len(tgt)]
    # Padded (source, target) widths: one compiled program per shape.
    width = lambda n: inference_width(n, max_len)
    shapes = [(width(len(src)), width(len(tgt) + 1)) for src, tgt in pairs]
    plan = plan_static(shapes, full_rows=lambda shape: batch_rows, order=todo)
    for chunk, (s, t), rows in plan:
        src = np.zeros((rows, s), np.int32)  # [B, S]
        tgt_in = np.zeros((rows, t), np.int32)  # [B, T]
        src[:, 0] = EOS_ID  # filler rows: a lone EOS, outputs dropped
        tgt_in[:, 0] = BOS_ID
        for r, i in enumerate(chunk):
            src_ids, tgt_ids = pairs[i]
            src[r, : len(src_ids)] = src_ids
            tgt_in[r, : len(tgt_ids) + 1] = [BOS_ID, *tgt_ids]  # row t predicts token t
        weights = np.asarray(_mean_weights(graphdef, state, src, tgt_in, layers))
        for r, i in enumerate(chunk):
            src_ids, tgt_ids = pairs[i]
            n_src = len(src_ids) - (1 if src_ids and src_ids[-1] == EOS_ID else 0)
            w = weights[r, : len(tgt_ids), :n_src]  # [T, S] without EOS rows/columns
            out[i] = align_words(
                w,
                word_ids([piece(x) for x in src_ids[:n_src]]),
                word_ids([piece(x) for x in tgt_ids]),
            )
    return out


def add_alignments(model: Transformer, tokenizer: Any, translated: Translated) -> None:
    """Add "alignment" to every hypothesis of `translated.hypotheses`, in place.

    Links index the words of the whole line: a segment's source words are
    offset by the line's words before it, its output words by the earlier
    segments' outputs (hypotheses of split lines are joined in order).
    """
    piece, segments, search = tokenizer.id_to_piece, translated.segments, translated.search
    pairs = [(seg.ids, h.tokens) for seg, hyps in zip(segments, search, strict=True) for h in hyps]
    found = iter(word_alignments(model, piece, pairs))
    links = [[next(found) for _ in hyps] for hyps in search]  # [segment][rank]
    by_line: dict[int, list[int]] = {}
    for n, seg in enumerate(segments):
        by_line.setdefault(seg.line, []).append(n)
    for i, segs in by_line.items():
        words = word_ids([piece(t) for t in translated.line_tokens[i]])  # each token's word
        for k, hyp in enumerate(translated.hypotheses[i]):
            out, tgt_offset = [], 0
            for n in segs:
                for link in links[n][k].split():
                    a, b = map(int, link.split("-"))
                    out.append(f"{a + int(words[segments[n].start])}-{b + tgt_offset}")
                tokens = search[n][k].tokens
                tgt_offset += len(set(word_ids([piece(t) for t in tokens]).tolist()))
            hyp["alignment"] = " ".join(out)

"""Translating many sources at once: static-shape batches, search, results in input order.

The one path from token ids to translations, taken by decode.py and by the
dev-set evaluation during training:

    hyps = translate_ids(model, sources, beam_size=4, alpha=0.6, batch_tokens=4096)
    hyps[i][0].tokens, hyps[i][0].score      # the best translation of sources[i]

Sources of any lengths are sorted by length and cut into batches whose padded
width comes from a short fixed list (`WIDTHS`) and whose row count is a power
of two, so a file of any size compiles a handful of search programs, not one
per batch. Search itself is model/decoding.py (beam search, or greedy for
beam 1), one jit-compiled `while_loop` per batch; batches are dispatched
before the previous one is read back, so the host work overlaps the device's.

With a mesh, each batch's rows are spread over the mesh's batch axes. Every
process passes *all* sources and gets all results back: each fills the rows
of the global batch that its devices hold, and the outputs are gathered, so a
multi-host job evaluates its dev set with every device and no host differs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model import EOS_ID, PAD_ID, Transformer
from model.decoding import beam_search, greedy_search, length_penalty
from training.mesh import BATCH_AXES, batch_divisor

# Padded source widths, ~1.5x apart: padding the source costs only encoder work
# (the search's steps follow the output), while every width compiles a program.
WIDTHS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MIN_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One translation: output ids (no BOS, EOS or padding) and the search's score.

    score = log P(tokens + EOS | source) / ((5 + len) / 6)^alpha, what beam search
    ranks by (len counts EOS); greedy search (beam 1) is scored the same way.
    """

    tokens: list[int]
    score: float


# --- Batch plan ------------------------------------------------------------------------


def bucket_width(n: int, max_len: int) -> int:
    """The padded width for a source of n tokens: the smallest width >= n, at most max_len."""
    return min(next((w for w in WIDTHS if w >= n), max_len), max_len)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_batches(
    lengths: Sequence[int], *, batch_tokens: int, max_len: int, rows_multiple: int = 1
) -> list[tuple[np.ndarray, int, int]]:
    """Group sources into batches of static shape; longest first.

    Args:
      lengths: tokens per source (EOS included); all in [1, max_len].
      batch_tokens: budget of padded source tokens per batch (rows * width).
      max_len: the model's longest position.
      rows_multiple: every batch's row count is a multiple of this (the devices
        of the mesh's batch axes).
    Returns:
      (indices into `lengths`, width S, rows B) per batch, with len(indices) <= B.
      Full batches have B = the largest power of two with B * S <= batch_tokens
      (at least `rows_multiple`); a width's last batch is padded up to a power of
      two (at least 8), so each width compiles at most a few batch sizes.
    """
    lengths = np.asarray(lengths, np.int64)
    widths = np.array([bucket_width(int(n), max_len) for n in lengths], np.int64)
    # Stable sort by decreasing length keeps equal-length sources in input order.
    order = np.argsort(-lengths, kind="stable")
    batches = []
    for width in sorted(set(widths.tolist()), reverse=True):
        idx = order[widths[order] == width]
        fit = 1 << (max(batch_tokens // width, 1).bit_length() - 1)  # power of two <= budget
        full = _round_up(fit, rows_multiple)
        for start in range(0, len(idx), full):
            chunk = idx[start : start + full]
            pow2 = 1 << (len(chunk) - 1).bit_length()
            rows = min(full, _round_up(max(MIN_ROWS, pow2), rows_multiple))
            batches.append((chunk, width, rows))
    return batches


# --- Search over one batch --------------------------------------------------------------


def _place(src: np.ndarray, mesh: Mesh | None) -> jax.Array:
    """[B, S] numpy (the whole batch, on every process) -> a device array, rows sharded."""
    if mesh is None:
        return jax.device_put(src)
    sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    return jax.make_array_from_callback(src.shape, sharding, lambda index: src[index])


def _fetch(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) device array -> the whole array on this host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def search_fn(
    model: Transformer,
    *,
    beam_size: int,
    alpha: float,
    n_best: int = 1,
    vocab_limit: int | None = None,
) -> Callable[[jax.Array], tuple[jax.Array, jax.Array]]:
    """The search of one batch: src [B, S] -> tokens [B, n_best, L], scores [B, n_best].

    Beam search for beam_size > 1, greedy search (scored the same way) for 1.
    The outputs are device arrays, not awaited. training/export.py exports this
    function, so an exported translator searches exactly as the live model.
    """

    def search(src: jax.Array) -> tuple[jax.Array, jax.Array]:
        if beam_size == 1:
            tokens, logp = greedy_search(model, src, vocab_limit=vocab_limit, return_logprob=True)
            lengths = (tokens != PAD_ID).sum(axis=1)  # [B], EOS included
            scores = logp / length_penalty(lengths, alpha)  # [B]
            return tokens[:, None], scores[:, None]  # [B, L] -> [B, 1, L]
        tokens, scores = beam_search(
            model, src, beam_size=beam_size, alpha=alpha, vocab_limit=vocab_limit
        )  # [B, K, L], [B, K]
        return tokens[:, :n_best], scores[:, :n_best]

    return search


def _hypotheses(tokens: np.ndarray, scores: np.ndarray) -> list[Hypothesis]:
    """One source's [n_best, L] tokens and [n_best] scores -> its hypotheses, best first."""
    out = []
    for row, score in zip(tokens.tolist(), scores.tolist(), strict=True):
        if not math.isfinite(score):  # a slot the beam never filled
            continue
        end = row.index(EOS_ID) if EOS_ID in row else len(row)
        out.append(Hypothesis([t for t in row[:end] if t != PAD_ID], float(score)))
    return out


def translate_ids(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    n_best: int = 1,
    batch_tokens: int = 4096,
    vocab_limit: int | None = None,
    mesh: Mesh | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[Hypothesis]]:
    """Translate token-id sources of any lengths, in batches of static shape.

    Args:
      model: a Transformer (evaluated deterministically).
      sources: id lists as the model was trained on (EOS-terminated), each at most
        `config.max_len` long; an empty list gives no hypotheses without running
        the model. With several processes, every process passes the same list.
      beam_size: K (1 = greedy search); alpha: the length-penalty exponent.
      n_best: hypotheses kept per source (<= beam_size), best first.
      batch_tokens: padded source tokens per batch (beam search holds K times as many).
      vocab_limit: never emit ids >= this (a tokenizer smaller than the vocabulary).
      mesh: spread each batch's rows over the mesh's ('data', 'fsdp') axes.
      progress: called after each batch with (sentences, output tokens) it finished.
    Returns:
      per source, in input order, its hypotheses (at most n_best; fewer when the
      beam found fewer distinct ones).
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    search = search_fn(
        model, beam_size=beam_size, alpha=alpha, n_best=n_best, vocab_limit=vocab_limit
    )
    return run_batches(
        search,
        sources,
        max_len=model.config.max_len,
        batch_tokens=batch_tokens,
        mesh=mesh,
        progress=progress,
    )


def run_batches(
    search: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    mesh: Mesh | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[Hypothesis]]:
    """`translate_ids` for any batch search (a live model's `search_fn`, or an exported one)."""
    too_long = [i for i, s in enumerate(sources) if len(s) > max_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} source(s) exceed max_len {max_len} (first: #{too_long[0]})"
        )
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    plan = plan_batches(
        [len(sources[i]) for i in nonempty],
        batch_tokens=batch_tokens,
        max_len=max_len,
        rows_multiple=batch_divisor(mesh) if mesh is not None else 1,
    )
    results: list[list[Hypothesis]] = [[] for _ in sources]

    def finish(tokens: jax.Array, scores: jax.Array, chunk: np.ndarray) -> None:
        tokens, scores = _fetch(tokens), _fetch(scores)  # waits for the device
        count = 0
        for r, j in enumerate(chunk):
            hyps = _hypotheses(tokens[r], scores[r])
            results[nonempty[j]] = hyps
            count += len(hyps[0].tokens) + 1 if hyps else 0
        if progress is not None:
            progress(len(chunk), count)

    pending = None
    for chunk, width, rows in plan:
        # Filler rows hold a lone EOS: a valid, cheap source whose output is dropped.
        src = np.zeros((rows, width), np.int32)  # [B, S]
        src[len(chunk) :, 0] = EOS_ID
        for r, j in enumerate(chunk):
            ids = sources[nonempty[j]]
            src[r, : len(ids)] = ids
        out = search(_place(src, mesh))
        # Dispatch is asynchronous: the next batch is queued before this one is read.
        if pending is not None:
            finish(*pending)
        pending = (*out, chunk)
    if pending is not None:
        finish(*pending)
    return results

"""The log-likelihood of given translations: each target token's log-probability under the
model, teacher-forced (decode.py --score, the library's `Translator.score`).

    logp = token_log_probs(model, src, tgt)            # [B, S], [B, T] -> [B, T]
    scored = score_ids(model, sources, targets, batch_tokens=4096)
    scored[i][0].score, scored[i][0].token_log_probs   # sum, and one per token with EOS

A pair's score is log P(target + EOS | source) = the sum of its tokens' natural-log
probabilities, EOS included, without length normalization: what CTranslate2's
`score_batch`, marian-scorer and fairseq's SequenceScorer give. Each probability is
the model's softmax over its whole vocabulary, as beam search takes it
(search/beam.py), so the score of a beam output at alpha 0 is the search's.

Pairs are batched as translation batches sources (data/plans.py `plan_translation`),
by the wider side of each pair: one program per width, both sides padded to it, so a
job's programs depend on the widths present, never on its size. A pair's result does
not depend on its batch: padding is masked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from attention_jax import EOS_ID, PAD_ID, Transformer
from attention_jax.search import programs
from attention_jax.search.decoding import Call
from attention_jax.search.hypothesis import Hypothesis, IdLists, Indices, PerSource
from attention_jax.search.settings import DEFAULTS, default_batch_tokens
from attention_jax.search.stages import (
    Progress,
    batch_of,
    fetch,
    place,
    plan_batches,
    rows_multiple,
    run_batches,
    search_streams,
)
from attention_jax.transformer import shift_right

# src [B, W], tgt [B, W] (device arrays) -> [B, W] float32 log-probabilities (0 at padding)
ScoreBatch = Callable[[jax.Array, jax.Array], jax.Array]


def token_log_probs(model: Transformer, src: jax.Array, tgt: jax.Array) -> jax.Array:
    """src [B, S], tgt [B, T] int32 (targets ending in EOS, 0-padded) -> [B, T] float32:
    log P(tgt[b, t] | src[b], tgt[b, :t]), 0 where tgt is padding."""
    logits = model(src, shift_right(tgt), deterministic=True)  # [B, T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    picked = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]  # [B, T]
    return jnp.where(tgt != PAD_ID, picked, 0.0)


@functools.partial(jax.jit, static_argnums=0)
def _token_log_probs(graphdef: Any, state: Any, src: jax.Array, tgt: jax.Array) -> jax.Array:
    return token_log_probs(nnx.merge(graphdef, state), src, tgt)


def live_scorer(model: Transformer, call: Call = programs.call) -> ScoreBatch:
    """`token_log_probs` of `model` as one compiled program per batch shape, run by `call`
    (search/programs.py: kept on disk where enabled, so a warm job compiles nothing)."""
    graphdef, state = nnx.split(model)
    return lambda src, tgt: call(_token_log_probs, graphdef, (state, src, tgt), {})


def prepare_scorer(model: Transformer, rows: int, width: int) -> None:
    """Start compiling or loading, in the background, the program of [rows, width] pairs."""
    shape = jax.ShapeDtypeStruct((rows, width), np.int32)
    live_scorer(model, programs.prepare)(shape, shape)


def plan_pairs(
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    multiple: int = 1,
    min_rows: int = DEFAULTS.min_rows,
    skip: Collection[int] = (),
) -> tuple[list[tuple[np.ndarray, int, int]], list[int]]:
    """(the batches: indices into `nonempty`, width, rows; the indices of the pairs with a
    source): search/stages.py `plan_batches`, a pair going by its wider side; pairs
    without a source are in no batch, and the pairs `skip` leave their rows to filler
    (the batches keep their shapes)."""
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    for i, source in enumerate(sources):
        if len(source) and (not targets[i] or targets[i][-1] != EOS_ID):
            raise ValueError(f"target #{i} does not end in EOS")
    return plan_batches(
        sources, max_len=max_len, batch_tokens=batch_tokens, multiple=multiple,
        min_rows=min_rows, skip=skip, beside=targets,
    )  # fmt: skip


def score_pairs(
    score_batch: ScoreBatch,
    sources: IdLists,
    targets: IdLists,
    *,
    max_len: int,
    batch_tokens: int,
    min_rows: int = DEFAULTS.min_rows,
    skip: Indices = (),
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
) -> PerSource:
    """Per pair, in input order, [its Hypothesis]: the target's tokens (without EOS), its
    score (the sum of `token_log_probs`) and `token_log_probs` (one per token, EOS last);
    [] for a pair without a source, or one of `skip`.

    sources: EOS-terminated id lists of at most max_len tokens; targets likewise
    (the given translations, EOS last). score_batch: [B, W] sources and targets on
    their devices -> their [B, W] log-probabilities (`live_scorer`, or an exported
    program). progress(indices, results) after each batch (in the order batches end).
    """
    plan, nonempty = plan_pairs(
        sources, targets, max_len=max_len, batch_tokens=batch_tokens,
        multiple=rows_multiple(sharding), min_rows=min_rows, skip=skip,
    )  # fmt: skip
    results: list[list[Hypothesis]] = [[] for _ in sources]

    def score_one(picked: list[int], width: int, rows: int) -> np.ndarray:
        """A batch scored, on a scoring thread: [B, W] log-probabilities, read back."""
        src = place(batch_of(sources, picked, rows, width), sharding)
        tgt = place(batch_of(targets, picked, rows, width), sharding)
        return np.asarray(fetch(score_batch(src, tgt)), np.float64)

    def finish(logp: np.ndarray, picked: list[int]) -> None:
        found = []
        for r, i in enumerate(picked):
            per_token = logp[r, : len(targets[i])]
            each = tuple(float(x) for x in per_token)
            results[i] = [Hypothesis(list(targets[i][:-1]), float(per_token.sum()), None, each)]
            found.append(results[i])
        if progress is not None:
            progress(picked, found)

    # As searches run: batches on a few threads, so that a GPU computes one while the host
    # reads another back, and a CPU's cores each run one.
    run_batches(plan, nonempty, score_one, finish, search_streams(sharding), "score")
    return results


def score_ids(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    targets: Sequence[Sequence[int]],
    *,
    batch_tokens: int | None = None,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
    skip: Collection[int] = (),
) -> list[list[Hypothesis]]:
    """`score_pairs` with the live model: per pair [Hypothesis(tokens, score,
    token_log_probs)], [] for an empty source. batch_tokens: the padded tokens of a
    batch's wider side (None: the platform's default, search/settings.py)."""
    return score_pairs(
        live_scorer(model),
        sources,
        targets,
        max_len=model.config.max_len,
        batch_tokens=default_batch_tokens() if batch_tokens is None else batch_tokens,
        sharding=sharding,
        progress=progress,
        skip=skip,
    )

"""Token ids in, translations out: the Translator interface, the live model's, and batching.

The one path from token ids to hypotheses, taken by decode.py and by the
dev-set evaluation during training:

    hyps = translate_ids(model, sources, beam_size=4, alpha=0.6, batch_tokens=4096)
    hyps[i][0].tokens, hyps[i][0].score      # the best translation of sources[i]

A `Translator` is what decode.py translates with: the live model of a workdir
(`LiveTranslator`) or an exported one (inference/export.py). Both cut sources
of any lengths into batches of a few static shapes (data/plans.py
`plan_translation`: sorted by length, padded widths from a short fixed list,
power-of-two row counts), so a file of any size compiles a handful of search
programs, not one per batch. Search itself is model/decoding.py (beam search,
or greedy for beam 1), one jit-compiled `while_loop` per batch; batches are
dispatched before the previous one is read back, so the host work overlaps
the device's.

With a `sharding` of the rows (e.g. training's batch sharding over its mesh),
each batch's rows are spread over the devices. Every process passes *all*
sources and gets all results back: each fills the rows of the global batch
that its devices hold, and the outputs are gathered, so a multi-host job
evaluates its dev set with every device and no host differs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from data.plans import plan_translation
from model import EOS_ID, PAD_ID, Transformer
from model.decoding import DEFAULT_LENGTH_PENALTY, beam_search, greedy_search, normalized_score

# progress(sentences, output tokens) after each batch
Progress = Callable[[int, int], None]
# A batch's search: src [B, S] -> tokens [B, n_best, L], scores [B, n_best]
Search = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One translation: output ids (no BOS, EOS or padding) and the search's score.

    score = log P(tokens + EOS | source) / lp(len), what beam search ranks by (gnmt:
    ((5 + len) / 6)^alpha, len counting EOS; model.decoding.length_penalty); greedy
    search (beam 1) is scored the same way.
    """

    tokens: list[int]
    score: float


class Translator(Protocol):
    """A translation backend: token-id sources -> hypotheses, in input order.

    sources are id lists as the model was trained on (EOS-terminated, at most
    `max_len` long); an empty one gets no hypotheses. Each source gets at most
    `n_best` hypotheses, best first.
    """

    max_len: int  # the longest source, in tokens with EOS
    beam_size: int
    alpha: float
    n_best: int

    def translate(
        self, sources: Sequence[Sequence[int]], progress: Progress | None = None
    ) -> list[list[Hypothesis]]: ...


def vocab_limit(tokenizer_size: int, config: Any) -> int | None:
    """The ids a model may emit: below the tokenizer's size when the model's vocabulary is
    larger (a corpus that supported fewer pieces); None = all of them."""
    return tokenizer_size if tokenizer_size < config.vocab_size else None


# --- Search over one batch --------------------------------------------------------------


def _rows_multiple(sharding: NamedSharding | None) -> int:
    """How many devices the rows are split over (every batch's rows are a multiple)."""
    if sharding is None:
        return 1
    axes = sharding.spec[0] if sharding.spec else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return math.prod(sharding.mesh.shape[a] for a in axes)


def _place(src: np.ndarray, sharding: NamedSharding | None) -> jax.Array:
    """[B, S] numpy (the whole batch, on every process) -> a device array, rows sharded."""
    if sharding is None:
        return jax.device_put(src)
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
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
) -> Search:
    """The search of one batch: src [B, S] -> tokens [B, n_best, L], scores [B, n_best].

    Beam search for beam_size > 1, greedy search (scored the same way) for 1.
    The outputs are device arrays, not awaited. inference/export.py exports this
    function, so an exported translator searches exactly as the live model.
    """

    def search(src: jax.Array) -> tuple[jax.Array, jax.Array]:
        if beam_size == 1:
            tokens, logp = greedy_search(model, src, vocab_limit=vocab_limit, return_logprob=True)
            lengths = (tokens != PAD_ID).sum(axis=1)  # [B], EOS included
            scores = normalized_score(logp, lengths, alpha, length_penalty)  # [B]
            return tokens[:, None], scores[:, None]  # [B, L] -> [B, 1, L]
        tokens, scores = beam_search(
            model,
            src,
            beam_size=beam_size,
            alpha=alpha,
            vocab_limit=vocab_limit,
            length_penalty=length_penalty,
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


# --- Many sources -----------------------------------------------------------------------


def translate_ids(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    n_best: int = 1,
    batch_tokens: int = 4096,
    vocab_limit: int | None = None,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
    length_penalty: str = DEFAULT_LENGTH_PENALTY,
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
      sharding: how each batch's [B, S] rows are placed (rows split over devices);
        None = on the default device.
      progress: called after each batch with (sentences, output tokens) it finished.
      length_penalty: "gnmt" or "average" (model.decoding.length_penalty).
    Returns:
      per source, in input order, its hypotheses (at most n_best; fewer when the
      beam found fewer distinct ones).
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    search = search_fn(
        model,
        beam_size=beam_size,
        alpha=alpha,
        n_best=n_best,
        vocab_limit=vocab_limit,
        length_penalty=length_penalty,
    )
    return run_batches(
        search,
        sources,
        max_len=model.config.max_len,
        batch_tokens=batch_tokens,
        sharding=sharding,
        progress=progress,
    )


def run_batches(
    search: Search,
    sources: Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_tokens: int,
    sharding: NamedSharding | None = None,
    progress: Progress | None = None,
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
    plan = plan_translation(
        [len(sources[i]) for i in nonempty],
        batch_tokens=batch_tokens,
        max_len=max_len,
        rows_multiple=_rows_multiple(sharding),
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
        out = search(_place(src, sharding))
        # Dispatch is asynchronous: the next batch is queued before this one is read.
        if pending is not None:
            finish(*pending)
        pending = (*out, chunk)
    if pending is not None:
        finish(*pending)
    return results


@dataclasses.dataclass
class LiveTranslator:
    """The `Translator` of a model in memory (e.g. restored from a training workdir)."""

    model: Transformer
    beam_size: int = 4
    alpha: float = 0.6
    n_best: int = 1
    batch_tokens: int = 4096
    vocab_limit: int | None = None
    length_penalty: str = DEFAULT_LENGTH_PENALTY

    @property
    def max_len(self) -> int:
        return self.model.config.max_len

    def translate(
        self, sources: Sequence[Sequence[int]], progress: Progress | None = None
    ) -> list[list[Hypothesis]]:
        return translate_ids(
            self.model,
            sources,
            beam_size=self.beam_size,
            alpha=self.alpha,
            n_best=self.n_best,
            batch_tokens=self.batch_tokens,
            vocab_limit=self.vocab_limit,
            progress=progress,
            length_penalty=self.length_penalty,
        )

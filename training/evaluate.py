"""Dev-set evaluation: loss/accuracy with teacher forcing, and BLEU/chrF of beam-search output."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from data import Tokenizer, eval_batches
from model import Transformer
from model.decoding import translate
from training.mesh import batch_divisor, shard_batch
from training.steps import summarize


class Subset:
    """The first `n` pairs of a corpus (n <= 0: all of it), with the same len()/[i] interface."""

    def __init__(self, corpus: Any, n: int = 0):
        self.corpus = corpus
        self.n = len(corpus) if n <= 0 else min(n, len(corpus))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[str, str]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.corpus[i]


def eval_loss(
    eval_step: Callable[..., dict[str, jax.Array]],
    params: nnx.State,
    rngs: nnx.State,
    config: Any,
    tokenizer: Tokenizer,
    corpus: Any,
    mesh: Mesh,
) -> dict[str, float]:
    """Token-weighted loss, accuracy and perplexity over every pair of `corpus`."""
    total = None
    for batch, _ in eval_batches(config, tokenizer, corpus, batch_multiple=batch_divisor(mesh)):
        sums = eval_step(params, rngs, shard_batch(batch, mesh))
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    if total is None:
        return {}
    return {k: float(v) for k, v in summarize(total).items()}


def translate_corpus(
    model: Transformer,
    tokenizer: Tokenizer,
    corpus: Any,
    config: Any,
    mesh: Mesh,
    *,
    beam_size: int,
    alpha: float,
) -> list[str]:
    """Detokenized translations of every source in `corpus`, in corpus order.

    With several processes, each decodes its shard of `corpus` (rows spread
    over the batch axes of the mesh) and the token ids are gathered, so every
    process returns the translations of the whole corpus.
    """
    hyps = [""] * len(corpus)
    # Beam search holds K hypotheses per source: keep the batch's tokens near batch_tokens.
    budget = max(int(config.batch_tokens) // max(beam_size, 1), 256)
    if jax.process_count() == 1:
        replicated = NamedSharding(mesh, PartitionSpec())
        for batch, index in eval_batches(config, tokenizer, corpus, batch_tokens=budget):
            src = jax.device_put(batch["src"], replicated)
            tokens = np.asarray(translate(model, src, beam_size=beam_size, alpha=alpha))
            _put(hyps, tokenizer, tokens, index)
        return hyps
    from jax.experimental import multihost_utils

    multiple = max(batch_divisor(mesh) // jax.process_count(), 1)
    for batch, index in eval_batches(
        config, tokenizer, corpus, batch_tokens=budget, batch_multiple=multiple
    ):
        src = shard_batch({"src": batch["src"]}, mesh)["src"]  # [B, S] over the processes
        tokens = translate(model, src, beam_size=beam_size, alpha=alpha)
        # Every process gets every row, and the corpus indices of every row.
        tokens = np.asarray(multihost_utils.process_allgather(tokens, tiled=True))
        index = np.asarray(
            multihost_utils.process_allgather(
                shard_batch({"i": index.astype(np.int32)}, mesh)["i"], tiled=True
            )
        )
        _put(hyps, tokenizer, tokens, index)
    return hyps


def _put(hyps: list[str], tokenizer: Tokenizer, tokens: np.ndarray, index: np.ndarray) -> None:
    for row, i in zip(tokens, index, strict=True):
        if i >= 0:
            hyps[i] = tokenizer.decode(row.tolist())


def bleu_chrf(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU and chrF from sacreBLEU, with their signatures."""
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hyps), [list(refs)])
    c = chrf.corpus_score(list(hyps), [list(refs)])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }

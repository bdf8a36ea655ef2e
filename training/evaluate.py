"""Dev-set evaluation: teacher-forced loss and accuracy, and BLEU/chrF of beam search (inference/).

metrics, examples = evaluate(state, setup, eval_step, tokenizer, dev, max_examples=100)
print(report(step, metrics, examples))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from attention_jax import EOS_ID, Transformer
from attention_jax.data import Tokenizer
from attention_jax.search.bleu import bleu_chrf
from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import translate_ids, vocab_limit
from attention_jax.training.config import search_settings
from attention_jax.training.input import process_eval_batches
from attention_jax.training.mesh import batch_divisor, batch_sharding, shard_batch
from attention_jax.training.steps import TrainSetup, TrainState, summarize


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
    batches = process_eval_batches(config, tokenizer, corpus, global_multiple=batch_divisor(mesh))
    for batch, _ in batches:
        sums = eval_step(params, rngs, shard_batch(batch, mesh))
        total = sums if total is None else jax.tree.map(jnp.add, total, sums)
    if total is None:
        return {}
    return {k: float(v) for k, v in summarize(total).items()}


def translate_corpus(
    model: Transformer,
    tokenizer: Tokenizer,
    sources: Sequence[str],
    *,
    max_length: int,
    settings: SearchSettings,
    mesh: Mesh,
) -> list[str]:
    """Detokenized translations of `sources` (in order), each cut to `max_length` tokens.

    Every process passes all sources; `search.translate.translate_ids` spreads the
    batches over the mesh (and processes) and returns every translation everywhere.
    """
    ids = [[*x[: max_length - 1], EOS_ID] for x in tokenizer.encode_batch(list(sources))]
    # decode.py's batches (the platform's batch_tokens): the same programs, compiled once
    # into the same caches. On one device they go through search/programs.py (kept on
    # disk, prepared side by side); over a mesh, through jax.jit.
    hyps = translate_ids(
        model,
        ids,
        settings,
        vocab_limit=vocab_limit(tokenizer.vocab_size, model.config),
        sharding=batch_sharding(mesh) if mesh.size > 1 else None,
    )
    return [tokenizer.decode(h[0].tokens) if h else "" for h in hyps]


def evaluate(
    state: TrainState,
    setup: TrainSetup,
    eval_step: Callable[..., dict[str, jax.Array]],
    tokenizer: Tokenizer,
    dev: Any,
    *,
    max_examples: int,
) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """Dev loss/accuracy on all of `dev`; BLEU/chrF on its first `max_examples` (0 = all).

    Returns the metrics (eval_loss, eval_accuracy, eval_perplexity, eval_bleu,
    eval_chrf, eval_examples, eval_seconds, bleu_signature) and the first
    `config.num_examples_to_print` (source, reference, hypothesis) triples.
    """
    config, mesh = setup.config, setup.mesh
    t0 = time.time()
    loss = eval_loss(eval_step, state.params, state.rngs, config, tokenizer, dev, mesh)
    out: dict[str, Any] = {
        f"eval_{k}": v for k, v in loss.items() if k not in ("tokens", "src_tokens")
    }
    model = nnx.merge(setup.graphdef, state.params, state.rngs)
    n = len(dev) if max_examples <= 0 else min(max_examples, len(dev))
    pairs = [dev[i] for i in range(n)]
    hyps = translate_corpus(
        model,
        tokenizer,
        [src for src, _ in pairs],
        max_length=config.max_length,
        settings=search_settings(config),
        mesh=mesh,
    )
    refs = [ref for _, ref in pairs]
    scores = bleu_chrf(hyps, refs)
    out.update(eval_bleu=scores["bleu"], eval_chrf=scores["chrf"])
    out["eval_examples"] = n
    out["eval_seconds"] = time.time() - t0
    out["bleu_signature"] = scores["bleu_signature"]
    examples = [(src, ref, hyp) for (src, ref), hyp in zip(pairs, hyps, strict=True)]
    return out, examples[: config.num_examples_to_print]


def report(step: int, ev: dict[str, Any], examples: list[tuple[str, str, str]]) -> str:
    """The evaluation as a few lines for the log."""
    lines = [
        f"eval @ step {step}: loss {ev['eval_loss']:.3f} acc {ev['eval_accuracy']:.3f} "
        f"BLEU {ev['eval_bleu']:.2f} chrF {ev['eval_chrf']:.2f} "
        f"({ev['eval_examples']} sentences, {ev['eval_seconds']:.0f}s)",
        f"  {ev['bleu_signature']}",
    ]
    for src, ref, hyp in examples:
        lines += [f"  SRC: {src}", f"  REF: {ref}", f"  HYP: {hyp}"]
    return "\n".join(lines)

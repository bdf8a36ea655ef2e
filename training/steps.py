"""Train state, loss, and the jit-compiled train and eval steps (pure functions).

    graphdef, abstract = abstract_train_state(config)
    state = init_train_state(config, graphdef, mesh, shardings)   # born sharded
    train_step = make_train_step(graphdef, tx, config, shardings, mesh)
    state, metrics = train_step(state, batch)                      # donates `state`

The model lives as `nnx.split` pieces: a static GraphDef plus two pytrees,
`params` (nnx.Param) and `rngs` (the dropout RNG streams, so that a resumed run
draws the same dropout masks as an uninterrupted one). The step merges them
into a Transformer, runs it, and splits it again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model import Transformer, TransformerConfig
from training.errors import TrainingError
from training.mesh import BATCH_AXES
from training.optim import make_schedule

PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")


@struct.dataclass
class TrainState:
    """Everything a checkpoint holds besides the data position (a pytree of arrays)."""

    step: jax.Array  # [] int32: updates applied so far
    params: nnx.State  # nnx.Param leaves, float32
    opt_state: optax.OptState
    rngs: nnx.State  # dropout RNG streams (keys and counts)


# --- Model construction -------------------------------------------------------


def model_config(config: Any) -> TransformerConfig:
    """config.model + config.vocab_size -> TransformerConfig (ValueError names a bad field)."""
    return TransformerConfig.from_dict({**config.model.to_dict(), "vocab_size": config.vocab_size})


def build_model(config: Any) -> Transformer:
    """A freshly initialized Transformer: `params` from `seed`, dropout streams from `seed + 1`."""
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    return Transformer(model_config(config), rngs=rngs)


def abstract_train_state(
    config: Any, tx: optax.GradientTransformation
) -> tuple[nnx.GraphDef, TrainState]:
    """The GraphDef and a TrainState of ShapeDtypeStructs, without allocating anything."""
    abstract_model = nnx.eval_shape(lambda: build_model(config))
    graphdef, _, _ = nnx.split(abstract_model, nnx.Param, ...)
    return graphdef, jax.eval_shape(_init_fn(config, tx))


def _init_fn(config: Any, tx: optax.GradientTransformation) -> Callable[[], TrainState]:
    def init():
        _, params, rngs = nnx.split(build_model(config), nnx.Param, ...)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rngs)

    return init


def init_train_state(
    config: Any, tx: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
    """Initialize params and optimizer state directly into their shardings (no host copy)."""
    return jax.jit(_init_fn(config, tx), out_shardings=shardings)()


# --- Loss ---------------------------------------------------------------------


def loss_sums(
    logits: jax.Array, targets: jax.Array, label_smoothing: float
) -> dict[str, jax.Array]:
    """Summed (not averaged) loss statistics over non-padding target tokens.

    Args:
      logits: [B, T, V] float32.
      targets: [B, T] int32, 0 = padding (weight 0).
      label_smoothing: eps_ls; the target gets 1 - eps, every other id eps / (V - 1).
    Returns:
      loss: sum of cross-entropy against the smoothed labels (what is minimized);
      nll: sum of the plain negative log-likelihood (for perplexity);
      correct: number of argmax hits; tokens: number of non-padding targets.
    """
    vocab = logits.shape[-1]
    weights = (targets != 0).astype(jnp.float32)  # [B, T]
    logits = logits.astype(jnp.float32)
    # Reductions over V only: log p_v = logits_v - lse is never materialized as a
    # second [B, T, V] array (XLA fuses each reduction into one pass over logits).
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    sum_logp = logits.sum(-1) - vocab * lse  # [B, T]: sum_v log p_v
    on, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    # -sum_v q_v log p_v with q = off everywhere except `on` at the target.
    smoothed = (on - off) * nll - off * sum_logp  # [B, T]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss": (smoothed * weights).sum(),
        "nll": (nll * weights).sum(),
        "correct": (correct * weights).sum(),
        "tokens": weights.sum(),
    }


def _forward_sums(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rngs: nnx.State,
    batch: Mapping[str, jax.Array],
    label_smoothing: float,
    deterministic: bool,
) -> tuple[jax.Array, tuple[dict[str, jax.Array], nnx.State]]:
    """(summed smoothed loss, (all sums, advanced RNG state)) of one (micro-)batch."""
    model = nnx.merge(graphdef, params, rngs, copy=True)
    packing = {k: batch[k] for k in PACKING_KEYS if k in batch}
    logits = model(batch["src"], batch["tgt_in"], deterministic=deterministic, **packing)
    sums = loss_sums(logits, batch["tgt_out"], label_smoothing)
    _, _, rngs = nnx.split(model, nnx.Param, ...)
    return sums["loss"], (sums, rngs)


def summarize(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums -> per-token means: loss, accuracy, perplexity (exp of the unsmoothed NLL)."""
    tokens = jnp.maximum(sums["tokens"], 1.0)
    return {
        "loss": sums["loss"] / tokens,
        "accuracy": sums["correct"] / tokens,
        "perplexity": jnp.exp(sums["nll"] / tokens),
        "tokens": sums["tokens"],
    }


# --- Steps --------------------------------------------------------------------


def _split_micro(x: jax.Array, k: int, mesh: Mesh) -> jax.Array:
    """[B, ...] -> [k, B/k, ...], micro-batch j = rows j, j+k, j+2k, ...

    Strided rows keep each micro-batch spread over every data shard, so the
    split needs no communication (a contiguous split would put micro-batch 0
    on the first devices only).
    """
    b = x.shape[0]
    x = x.reshape(b // k, k, *x.shape[1:])  # [B/k, k, ...]
    x = jnp.swapaxes(x, 0, 1)  # [k, B/k, ...]
    spec = PartitionSpec(None, BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    config: Any,
    shardings: TrainState,
    mesh: Mesh,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled `train_step(state, batch) -> (state, metrics)`; `state` is donated.

    A step whose loss or gradients are not finite leaves params and optimizer
    state unchanged (step and RNG streams still advance) and reports
    `metrics["nonfinite"] = 1`.

    With `grad_accum_steps = k`, the [B, ...] batch is split into k micro-batches
    scanned one after another; gradients of the *summed* loss are added up and
    divided by the token count of the whole batch, so k micro-batches of B/k rows
    give the same update as one batch of B rows.
    """
    k = int(config.grad_accum_steps)
    if k < 1:
        raise TrainingError(f"config.grad_accum_steps must be >= 1, got {k}")
    label_smoothing = float(config.label_smoothing)
    if not 0.0 <= label_smoothing < 1.0:
        raise TrainingError(f"config.label_smoothing must be in [0, 1), got {label_smoothing}")
    schedule = make_schedule(config)
    grad_fn = jax.value_and_grad(_forward_sums, argnums=1, has_aux=True)

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        if k == 1:
            (_, (sums, rngs)), grads = grad_fn(
                graphdef, state.params, state.rngs, batch, label_smoothing, False
            )
        else:
            micro = {name: _split_micro(x, k, mesh) for name, x in batch.items()}

            def body(carry, mb):
                grads, sums, rngs = carry
                (_, (s, rngs)), g = grad_fn(
                    graphdef, state.params, rngs, mb, label_smoothing, False
                )
                return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s), rngs), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            zero_sums = dict.fromkeys(("loss", "nll", "correct", "tokens"), jnp.zeros(()))
            (grads, sums, rngs), _ = jax.lax.scan(body, (zeros, zero_sums, state.rngs), micro)
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = summarize(sums)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["learning_rate"] = schedule(state.step)
        # A NaN/Inf loss or gradient never reaches the params or the Adam moments:
        # keep the old ones (a select on device, no host sync); the loop reads the
        # flag with the other metrics and counts or stops (config.nonfinite_policy).
        finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(metrics["grad_norm"])
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        metrics["nonfinite"] = 1 - finite.astype(jnp.int32)
        new_state = TrainState(state.step + 1, params, opt_state, rngs)
        return new_state, metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(train_step, donate_argnums=0, out_shardings=(shardings, replicated))


def make_eval_step(
    graphdef: nnx.GraphDef, config: Any, mesh: Mesh
) -> Callable[[nnx.State, nnx.State, dict[str, jax.Array]], dict[str, jax.Array]]:
    """The compiled `eval_step(params, rngs, batch) -> sums` (dropout off); add sums up, then
    `summarize`."""
    label_smoothing = float(config.label_smoothing)

    def eval_step(params, rngs, batch):
        _, (sums, _) = _forward_sums(graphdef, params, rngs, batch, label_smoothing, True)
        return sums

    return jax.jit(eval_step, out_shardings=NamedSharding(mesh, PartitionSpec()))

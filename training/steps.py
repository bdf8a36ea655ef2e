"""Train state, loss, and the jit-compiled train and eval steps (pure functions).

    setup = train_setup(config, mesh)          # graphdef, optimizer, abstract state, shardings
    state = init_train_state(setup)            # born sharded, no host copy
    train_step = make_train_step(setup)
    state, metrics = train_step(state, batch)  # donates `state`
    buffered = make_buffered_steps(setup, treedef, layout)  # train.py's: the state in buffers
    sums = make_eval_step(setup)(state.params, state.rngs, batch)

The model lives as `nnx.split` pieces: a static GraphDef plus two pytrees,
`params` (nnx.Param) and `rngs` (the dropout RNG streams, so that a resumed run
draws the same dropout masks as an uninterrupted one). The step merges them
into a Transformer, runs it, and splits it again.

The config is trusted here: `training.config.validate` has checked it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attention_jax import TransformerConfig
from attention_jax.training.config import build_model, model_config
from attention_jax.training.loss import chunked_loss_sums, loss_sums
from attention_jax.training.mesh import axis_rules, gathered, split_micro, state_shardings
from attention_jax.training.optim import make_optimizer, make_schedule
from attention_jax.training.state_buffers import BufferLayout

PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")


@struct.dataclass
class TrainState:
    """Everything a checkpoint holds besides the data position (a pytree of arrays)."""

    step: jax.Array  # [] int32: updates applied so far
    params: nnx.State  # nnx.Param leaves, float32
    opt_state: optax.OptState
    rngs: nnx.State  # dropout RNG streams (keys and counts)


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """What the steps and checkpoints know of the state before it exists (nothing allocated).

    abstract: a TrainState of ShapeDtypeStructs that carry their shardings (what
      `init_train_state` creates and what a checkpoint restores into).
    shardings: the same tree of NamedShardings.
    use_shardings: the parameters' shardings where the steps use them, FSDP shards
      gathered (`_forward_sums`).
    """

    config: Any
    mesh: Mesh
    model_config: TransformerConfig  # attention_impl resolved for where the steps run
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    abstract: TrainState
    shardings: TrainState
    use_shardings: nnx.State  # the parameters' shardings where used (`mesh.gathered`)


# --- Model and state ------------------------------------------------------------


def _init_fn(
    model: Callable[[], nnx.Module], tx: optax.GradientTransformation
) -> Callable[[], TrainState]:
    def init():
        _, params, rngs = nnx.split(model(), nnx.Param, ...)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rngs)

    return init


def train_setup(config: Any, mesh: Mesh, platform: str | None = None) -> TrainSetup:
    """The GraphDef, optimizer, and abstract state with its shardings on `mesh`.

    The model config is resolved here, before anything is traced, for `platform`
    (default: this machine; train.py --compile_for passes the target's).
    """
    model_cfg = model_config(config, platform)
    model = functools.partial(build_model, config, model_cfg)
    graphdef, _, _ = nnx.split(nnx.eval_shape(model), nnx.Param, ...)
    tx = make_optimizer(config)
    abstract = jax.eval_shape(_init_fn(model, tx))
    shardings = state_shardings(mesh, abstract, axis_rules(config))
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    use = gathered(shardings.params)
    return TrainSetup(config, mesh, model_cfg, graphdef, tx, abstract, shardings, use)


def init_train_state(setup: TrainSetup) -> TrainState:
    """Initialize params and optimizer state directly into their shardings (no host copy)."""
    model = functools.partial(build_model, setup.config, setup.model_config)
    return jax.jit(_init_fn(model, setup.tx), out_shardings=setup.shardings)()


# --- Loss ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """How `_forward_sums` computes a batch's loss.

    chunk_tokens > 0: over the vocabulary in chunks of that many tokens (training/loss.py),
      never holding the [B, T, V] logits; each chunk's logits stored as `logits_dtype`.
    use_shardings: the parameters' shardings where they are used (`mesh.gathered`: FSDP
      shards gathered). Without them XLA's partitioner may move activations instead of
      weights: a tiny FSDP step on 4 TPU chips had many all-to-alls and large
      all-gathers; with them, all-gathers of the parameters and reduce-scatters of their
      gradients (train.py --compile_for, docs/aot.md).
    """

    label_smoothing: float
    dropout: bool  # on in training, off in evaluation
    chunk_tokens: int = 0
    logits_dtype: str = "float32"
    use_shardings: Any = None

    @classmethod
    def of(cls, setup: TrainSetup, *, training: bool) -> LossOptions:
        """The config's: training's with dropout and its logits dtype, evaluation's
        without dropout and with float32 logits."""
        config = setup.config
        return cls(
            label_smoothing=float(config.label_smoothing),
            dropout=training,
            chunk_tokens=int(config.loss_chunk_tokens),
            logits_dtype=str(config.loss_logits_dtype) if training else "float32",
            use_shardings=setup.use_shardings,
        )


def _forward_sums(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rngs: nnx.State,
    batch: Mapping[str, jax.Array],
    options: LossOptions,
) -> tuple[jax.Array, tuple[dict[str, jax.Array], nnx.State]]:
    """(summed smoothed loss, (all sums, advanced RNG state)) of one (micro-)batch."""
    if options.use_shardings is not None:
        params = jax.lax.with_sharding_constraint(params, options.use_shardings)
    model = nnx.merge(graphdef, params, rngs, copy=True)
    packing = {k: batch[k] for k in PACKING_KEYS if k in batch}
    args = (batch["src"], batch["tgt_in"])
    deterministic, label_smoothing = not options.dropout, options.label_smoothing
    if options.chunk_tokens:
        y = model.hidden(*args, deterministic=deterministic, **packing)  # [B, T, D]
        w, b = model.output_matrix(), model.output_bias()  # [V, D], [V] or None
        if b is not None:  # logits = [y, 1] [w, b]^T: b's gradient comes with w's
            y = jnp.concatenate([y, jnp.ones_like(y[..., :1])], axis=-1)
            w = jnp.concatenate([w, b[:, None].astype(w.dtype)], axis=-1)
        sums = chunked_loss_sums(
            y,
            w,
            batch["tgt_out"],
            label_smoothing,
            chunk_tokens=options.chunk_tokens,
            logits_dtype=options.logits_dtype,
        )
    else:
        logits = model(*args, deterministic=deterministic, **packing)  # [B, T, V]
        sums = loss_sums(logits, batch["tgt_out"], label_smoothing)
    # Counted on device over the global batch, so every process logs the same totals.
    sums["src_tokens"] = (batch["src"] != 0).sum(dtype=jnp.float32)
    _, _, rngs = nnx.split(model, nnx.Param, ...)
    return sums["loss"], (sums, rngs)


def summarize(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums -> per-token means: loss, accuracy, perplexity (exp of the unsmoothed NLL).

    `tokens` (target) and, in training, `src_tokens` pass through as counts.
    """
    tokens = jnp.maximum(sums["tokens"], 1.0)
    out = {
        "loss": sums["loss"] / tokens,
        "accuracy": sums["correct"] / tokens,
        "perplexity": jnp.exp(sums["nll"] / tokens),
        "tokens": sums["tokens"],
    }
    if "src_tokens" in sums:
        out["src_tokens"] = sums["src_tokens"]
    return out


# --- Steps --------------------------------------------------------------------


def make_train_step(
    setup: TrainSetup,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled `train_step(state, batch) -> (state, metrics)`; `state` is donated.

    See `_train_step_fn` for what a step does.
    """
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    fn = _train_step_fn(setup)
    return jax.jit(fn, donate_argnums=0, out_shardings=(setup.shardings, replicated))


@dataclasses.dataclass(frozen=True)
class BufferedSteps:
    """`make_train_step`'s step on the state packed into a few buffers
    (training/state_buffers.py), with the compiled ways in and out (copies):

      buffers = steps.pack(state)
      buffers, metrics = steps.step(buffers, batch)   # buffers donated
      state = steps.unpack(buffers)                    # they stay valid
    """

    pack: Callable[[TrainState], list[jax.Array]]
    step: Callable[..., tuple[list[jax.Array], dict[str, jax.Array]]]
    unpack: Callable[[list[jax.Array]], TrainState]


def make_buffered_steps(setup: TrainSetup, treedef: Any, layout: BufferLayout) -> BufferedSteps:
    """The train step on packed buffers, `treedef` the state's structure.

    The same computation as `make_train_step`'s, called with a few arrays: a jitted
    call's host cost grows with the arrays it takes and returns (base's TrainState has
    608), and on a GPU the host's time per step bounds small-batch training
    (docs/PERFORMANCE.md). XLA fuses the optimizer's update with the copy into the buffers, so
    results agree with `make_train_step`'s to rounding (bit for bit when nothing is
    packed); a run and its resumption take the same path, so resuming stays exact.
    """
    fn = _train_step_fn(setup)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    leaf_shardings = treedef.flatten_up_to(setup.shardings)
    shardings = layout.shardings(leaf_shardings, replicated)

    def step(buffers, batch):
        state = jax.tree.unflatten(treedef, layout.unpack(buffers))
        state, metrics = fn(state, batch)
        return layout.pack(jax.tree.leaves(state)), metrics

    pack = jax.jit(layout.pack, out_shardings=shardings)
    unpack = jax.jit(layout.unpack, out_shardings=leaf_shardings)
    return BufferedSteps(
        pack=lambda state: pack(jax.tree.leaves(state)),
        step=jax.jit(step, donate_argnums=0, out_shardings=(shardings, replicated)),
        unpack=lambda buffers: jax.tree.unflatten(treedef, unpack(buffers)),
    )


def _train_step_fn(setup: TrainSetup):
    """`train_step(state, batch) -> (state, metrics)`, not yet compiled.

    A step whose loss or gradients are not finite leaves params and optimizer
    state unchanged (step and RNG streams still advance) and reports
    `metrics["nonfinite"] = 1`.

    With `grad_accum_steps = k`, the [B, ...] batch is split into k micro-batches
    scanned one after another; gradients of the *summed* loss are added up and
    divided by the token count of the whole batch, so k micro-batches of B/k rows
    give the same update as one batch of B rows.
    """
    graphdef, tx, mesh = setup.graphdef, setup.tx, setup.mesh
    k = int(setup.config.grad_accum_steps)
    loss = LossOptions.of(setup, training=True)
    schedule = make_schedule(setup.config)
    grad_fn = jax.value_and_grad(_forward_sums, argnums=1, has_aux=True)

    def accumulate(state: TrainState, batch: dict[str, jax.Array]):
        """(summed gradients, sums, advanced RNG state) over k micro-batches."""
        if k == 1:
            (_, (sums, rngs)), grads = grad_fn(graphdef, state.params, state.rngs, batch, loss)
            return grads, sums, rngs
        micro = {name: split_micro(x, k, mesh) for name, x in batch.items()}

        def body(carry, mb):
            grads, sums, rngs = carry
            (_, (s, rngs)), g = grad_fn(graphdef, state.params, rngs, mb, loss)
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s), rngs), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        names = ("loss", "nll", "correct", "tokens", "src_tokens")
        zero_sums = dict.fromkeys(names, jnp.zeros(()))
        (grads, sums, rngs), _ = jax.lax.scan(body, (zeros, zero_sums, state.rngs), micro)
        return grads, sums, rngs

    def train_step(state: TrainState, batch: dict[str, jax.Array]):
        grads, sums, rngs = accumulate(state, batch)
        # Gradients in the parameters' own shardings: FSDP reduce-scatters them (each
        # device sums only its shard) instead of all-reducing whole tensors.
        grads = jax.lax.with_sharding_constraint(grads, setup.shardings.params)
        grads = jax.tree.map(lambda g: g / jnp.maximum(sums["tokens"], 1.0), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = summarize(sums)
        metrics["grad_norm"] = optax.tree.norm(grads)
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

    return train_step


def make_eval_step(
    setup: TrainSetup,
) -> Callable[[nnx.State, nnx.State, dict[str, jax.Array]], dict[str, jax.Array]]:
    """The compiled `eval_step(params, rngs, batch) -> sums` (dropout off).

    Add the sums of all batches up, then `summarize` them.
    """
    graphdef, loss = setup.graphdef, LossOptions.of(setup, training=False)

    def eval_step(params, rngs, batch):
        _, (sums, _) = _forward_sums(graphdef, params, rngs, batch, loss)
        return sums

    return jax.jit(eval_step, out_shardings=NamedSharding(setup.mesh, PartitionSpec()))

"""Learning-rate schedules and the Optax optimizer (paper section 5.3).

    tx = make_optimizer(config)          # Adam(0.9, 0.98, 1e-9) + the paper's schedule
    lr = make_schedule(config)(step)     # the learning rate used for update number `step + 1`

Optax counts updates from 0; the paper counts from 1. `make_schedule` returns
a function of Optax's count, so `schedule(0)` is the paper's lrate(step=1).
The config is trusted here: `training.config.validate` has checked its names and ranges.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def paper_rsqrt(step: jax.Array, d_model: int, warmup_steps: int, scale: float = 1.0) -> jax.Array:
    """lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step >= 1 (eq. 3)."""
    step = jnp.maximum(jnp.asarray(step, jnp.float32), 1.0)
    return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)


def make_schedule(config: Any) -> optax.Schedule:
    """config.schedule -> a function of Optax's update count (0-based) giving the learning rate.

    'rsqrt':        the paper's formula times `learning_rate` (1.0 = the paper).
    'linear_rsqrt': linear warmup to `learning_rate`, then lr * sqrt(warmup / step).
    'cosine':       linear warmup to `learning_rate`, then cosine decay to 0 at num_train_steps.
    """
    kind, peak = config.schedule, float(config.learning_rate)
    warmup = max(int(config.warmup_steps), 1)
    if kind == "rsqrt":
        d_model = int(config.model.d_model)
        return lambda count: paper_rsqrt(count + 1, d_model, warmup, peak)
    if kind == "linear_rsqrt":

        def linear_rsqrt(count):
            step = jnp.asarray(count, jnp.float32) + 1.0
            return peak * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

        return linear_rsqrt
    assert kind == "cosine", kind  # training.config.SCHEDULES
    total = max(int(config.num_train_steps), warmup + 1)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, end_value=0.0)


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only; biases, LayerNorm scales stay undecayed."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def make_optimizer(config: Any) -> optax.GradientTransformation:
    """Gradient clipping (global norm) -> Adam/AdamW with the configured schedule.

    Gradient accumulation is done in the train step (the loss is normalized by
    the token count of the whole batch), not with `optax.MultiSteps`.
    """
    schedule = make_schedule(config)
    parts = []
    if config.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(float(config.grad_clip_norm)))
    b1, b2, eps = float(config.adam_b1), float(config.adam_b2), float(config.adam_eps)
    if config.optimizer == "adamw":
        parts.append(
            optax.adamw(schedule, b1, b2, eps, weight_decay=config.weight_decay, mask=_decay_mask)
        )
    else:
        parts.append(optax.adam(schedule, b1, b2, eps))
        if config.weight_decay > 0:  # L2 added to the gradient before Adam (coupled)
            parts.insert(-1, optax.add_decayed_weights(config.weight_decay, _decay_mask))
    return optax.chain(*parts)

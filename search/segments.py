"""The Transformer's beam search in segments, for a batch whose rows shrink as its
sources finish (search/rows.py runs the segments; this module holds their programs).

    state, report = start_segment(model, src, alpha=0.6, rule=rule, room=24, until=8)
    state = grow_segment(state, 58)
    state = select_segment(state, keep)                  # keep [B'] int32
    state, report = advance_segment(model, state, alpha=0.6, rule=rule, until=4)

Each is one program of its own (`_start`, `_grow`, `_select`, `_advance`), fixed by the
rows and room of the search it takes, and `prepare_segments` prepares every one a batch
shape may run. A segment's report says which sources are left and gives every source's
results so far (`segment_results`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attention_jax.search import beam, decoding
from attention_jax.search.constraints import Controls
from attention_jax.search.rows import row_ladder
from attention_jax.search.settings import Rule
from attention_jax.transformer import Transformer

# What a segment's program returns beside the state: left [B] bool (sources not finished),
# step [] int32, and the results so far (`segment_results`).
Segment = tuple[beam.BeamState, tuple[jax.Array, ...]]


def segment_results(s: beam.BeamState, alpha: jax.Array, rule: Rule) -> tuple[jax.Array, ...]:
    """(left [B] bool, step [], tokens [B, n, C], scores [B, n], met [B, n, Q], ended [B]):
    which sources are not finished, and every source's results so far with the steps it
    took (those of a finished source are final)."""
    tokens, scores = beam.results(s)  # [B, K, C], [B, K]
    n = rule.n_best
    left = ~beam.finished(s, alpha, rule)
    return left, s.step, tokens[:, :n], scores[:, :n], s.fin_met[:, :n], beam.steps_taken(s)


@functools.partial(jax.jit, static_argnames=("graphdef", "rule", "room", "length", "extra"))
def _start(graphdef, state, src, alpha, until, controls, *, rule, room, length, extra) -> Segment:
    """src [B, S]'s search from its first step until at most `until` sources are left
    or `room` tokens are decoded."""
    model = nnx.merge(graphdef, state)
    s = decoding.first_state(model, src, rule, room, length, extra, controls)
    s = decoding.step_until(model, s, alpha, rule, until)
    return s, segment_results(s, alpha, rule)


@functools.partial(jax.jit, static_argnames=("graphdef", "room"))
def _grow(graphdef, s, *, room) -> beam.BeamState:
    """The search `s` with room for `room` tokens (a program of its own, as `_select`:
    copies compile in no time, and the step loops stay one per rows and room)."""
    return beam.grow(s, room)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _select(graphdef, s, keep) -> beam.BeamState:
    """The search `s` of the sources `keep` [B'] alone."""
    return beam.select(s, keep)


@functools.partial(jax.jit, static_argnames=("graphdef", "rule"))
def _advance(graphdef, state, s, alpha, until, *, rule) -> Segment:
    """The search `s` until at most `until` sources are left or its room is full."""
    s = decoding.step_until(nnx.merge(graphdef, state), s, alpha, rule, until)
    return s, segment_results(s, alpha, rule)


def start_segment(
    model: Transformer | decoding.Parts,
    src: jax.Array,
    *,
    alpha: float,
    rule: Rule,
    room: int,
    until: int,
    controls: Controls | None = None,
    call: decoding.Call = decoding.jit_call,
) -> Segment | None:
    """The first segment of src [B, S]'s beam search (`_start`); a `ShapeDtypeStruct` src
    only prepares its program (None). Sources may produce min(n + 50, max_len) tokens."""
    length, extra = decoding.decode_shape(model, src, None)
    graphdef, state = decoding.split(model)
    if not isinstance(src, jax.ShapeDtypeStruct):
        src = jnp.asarray(src, jnp.int32)
    args = state, src, jnp.float32(alpha), jnp.int32(until), controls
    static = dict(rule=rule, room=min(room, length), length=length, extra=extra)
    return call(_start, graphdef, args, static)


def grow_segment(
    s: beam.BeamState, room: int, call: decoding.Call = decoding.jit_call
) -> beam.BeamState:
    """The search `s` (a state or its shapes) with room for `room` tokens (`_grow`)."""
    return call(_grow, None, (s,), dict(room=room))


def select_segment(
    s: beam.BeamState, keep: jax.Array, call: decoding.Call = decoding.jit_call
) -> beam.BeamState:
    """The search `s` of the sources `keep` [B'] int32 alone (`_select`)."""
    return call(_select, None, (s, keep), {})


def advance_segment(
    model: Transformer | decoding.Parts,
    s: beam.BeamState,
    *,
    alpha: float,
    rule: Rule,
    until: int,
    call: decoding.Call = decoding.jit_call,
) -> Segment:
    """The search `s` on until at most `until` sources are left or its room is full."""
    graphdef, state = decoding.split(model)
    args = state, s, jnp.float32(alpha), jnp.int32(until)
    return call(_advance, graphdef, args, dict(rule=rule))


def prepare_segments(
    model: Transformer | decoding.Parts,
    src: jax.ShapeDtypeStruct,
    *,
    alpha: float,
    rule: Rule,
    rooms: Sequence[int],
    controls: Any = None,
    call: decoding.Call,
    rarely: decoding.Call | None = None,
) -> None:
    """Prepare (`call`: search/programs.py `prepare`) every program a batch of src's shape
    [B, S] can run in segments down its ladder (search/rows.py `shrinking`): its start at
    rooms[0], its growth to rooms[-1], and per rung its steps and the selection of the
    next rung's rows. Their states' shapes are traced, not computed. `rarely` (default
    `call`) prepares the steps of the first rung after the growth: a batch runs them only
    when its first room fills before most of its sources are finished."""
    length, extra = decoding.decode_shape(model, src, None)
    first, last = min(rooms[0], length), rooms[-1]
    start_segment(model, src, alpha=alpha, rule=rule, room=first, until=0, controls=controls,
                  call=call)  # fmt: skip
    graphdef, state = decoding.split(model)
    shape = lambda state, src, controls: decoding.first_state(
        nnx.merge(graphdef, state), src, rule, first, length, extra, controls
    )  # the arrays traced as arguments (search/pool.py `decode_output_shape` says why)
    s = jax.eval_shape(shape, state, src, controls)
    if first < last:
        grow_segment(s, last, call)
        s = jax.eval_shape(functools.partial(beam.grow, capacity=last), s)
    for rung, fewer in enumerate([*row_ladder(src.shape[0])[1:], None]):
        steps = call if rung or rarely is None else rarely
        advance_segment(model, s, alpha=alpha, rule=rule, until=0, call=steps)
        if fewer is not None:
            keep = jax.ShapeDtypeStruct((fewer,), jnp.int32)
            select_segment(s, keep, call)
            s = jax.eval_shape(beam.select, s, keep)

"""Beam search of a queue of sources in a fixed number of slots: when a source's search
ends, the next source of the queue takes its slot at the next step (continuous batching).

    tokens, scores, met, steps, took = pool_search(
        model, src, alpha=0.6, rule=rule, slots=16, length=58, extra=50)
    # src [N, S] -> [N, n, C], [N, n], [N, n, Q]; [] steps run; [N] steps each source took

A batch searched whole (search/decoding.py) steps until its slowest source ends; its
rows shrink only as far as a few fixed row counts (search/rows.py). Here every step
feeds the B*K rows of B sources still searching, until the queue runs dry. A
source's search does not depend on its neighbours (search/beam.py), so its results
are the batch search's but at near-ties (a step's sums depend on the rows it holds):
its columns are its own (`beam.columns`), and it takes over its slot's self-attention
ring, seeing only its own tokens there (model/decode_cache.py `DecodeCache.take_over`;
an ensemble's cache takes over each member's). The room is `length` throughout: the
ring holds a source's tokens whatever step it joined at.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from attention_jax.ensemble import Ensemble
from attention_jax.search import beam
from attention_jax.search.constraints import Controls
from attention_jax.search.decoding import Call, Parts, jit_call, split
from attention_jax.search.scoring import NEG_INF, row_limits
from attention_jax.search.segments import segment_results
from attention_jax.search.settings import Rule
from attention_jax.transformer import Transformer

# The platforms whose live searches run pooled (search/translate.py `LiveSearch.slots`).
# On a CPU a step's time grows with its rows and with the caches they read, so a few
# slots kept busy beat a batch that shrinks; elsewhere batches search whole or in
# segments (search/rows.py). docs/searching.md has the measurements.
POOL_PLATFORMS = ("cpu",)
# A batch's slots: as many sources as hold this many source tokens (at least one): the
# batch is the queue, and a step's time is then spent on a few rows with small caches
# (docs/searching.md: fewer or more were slower).
SLOT_TOKENS = 64


def pool_slots(rows: int, width: int) -> int:
    """The slots of a batch of `rows` sources of width `width` searched pooled on this
    platform, or 0 where batches are not (`POOL_PLATFORMS`)."""
    if jax.default_backend() not in POOL_PLATFORMS:
        return 0
    return min(rows, max(1, SLOT_TOKENS // width))


class Queue(NamedTuple):
    """N sources waiting for a slot: real sources first, fillers (limit 0) last."""

    cache: Any  # the model's cache of the N sources, room 1: what a slot takes over
    limits: jax.Array  # [N] int32
    controls: Controls  # per source
    real: jax.Array  # [] int32, the sources before the fillers (never searched)


class Pool(NamedTuple):
    """The loop's state: the slots' searches, who is in them, what has ended (a pytree)."""

    s: beam.BeamState  # the B slots' searches
    who: jax.Array  # [B] int32, the queue index each slot searches (-1: none, the queue is dry)
    next: jax.Array  # [] int32, the first queue index not yet given a slot
    out: tuple[jax.Array, ...]  # tokens [N, n, C], scores [N, n], met [N, n, Q], took [N]


def _restart(
    s: beam.BeamState, b: jax.Array, limit: jax.Array, controls: Controls
) -> beam.BeamState:
    """Source slot b [] int32 begins a new source's search at the next step, as `beam.init`
    begins one: limit [] int32, controls its own (a `Controls` of one source, no batch
    axis). Its rows' cache is the caller's to replace."""
    k, capacity = s.live_seqs.shape[1:]
    fresh = beam.init(None, limit[None], k, capacity, jax.tree.map(lambda x: x[None], controls))
    put = lambda x, v: jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), b, 0)
    fields = [f for f in s._fields if f not in ("step", "cache", "start")]
    new = {f: jax.tree.map(put, getattr(s, f), getattr(fresh, f)) for f in fields}
    return s._replace(**new, start=put(s.start, s.step[None]))


def _harvest(p: Pool, q: Queue, alpha: jax.Array, rule: Rule) -> Pool:
    """Each slot whose source is finished: its results to `out`, and the next source of
    the queue in its place (none once the queue is dry). A finished source gains nothing
    more, so its results are final (search/beam.py)."""
    left, _, *ended = segment_results(p.s, alpha, rule)  # ended: as `out` holds them
    fin = ~left & (p.who >= 0)  # [B]
    order = jnp.argsort(~fin, stable=True)  # the finished slots first

    def one(j: jax.Array, p: Pool) -> Pool:
        b = order[j]
        put = lambda o, x: jax.lax.dynamic_update_index_in_dim(o, x[b], p.who[b], 0)
        out = tuple(put(o, x) for o, x in zip(p.out, ended, strict=True))
        refill = p.next < q.real
        i = jnp.minimum(p.next, q.limits.shape[0] - 1)

        # Once the queue is dry the slot searches its last source again, for no one: that
        # costs less than a conditional, whose operands (the whole state) XLA may copy.
        s = _restart(p.s, b, q.limits[i], jax.tree.map(lambda x: x[i], q.controls))
        s = s._replace(cache=s.cache.take_over(b, q.cache, i))
        who = p.who.at[b].set(jnp.where(refill, p.next, -1))
        return Pool(s, who, p.next + refill.astype(jnp.int32), out)

    return jax.lax.fori_loop(0, jnp.sum(fin, dtype=jnp.int32), one, p)


def pool_state(
    model: Transformer | Ensemble,
    src: jax.Array,
    alpha: jax.Array,
    rule: Rule,
    slots: int,
    length: int,
    extra: int | None,
    controls: Controls | None = None,
    output: Any = None,
) -> Pool:
    """src [N, S]'s searches (fillers last), `slots` at a time, once every one has ended
    (pure; `pool_search` runs it as one compiled program). output: the model's
    `decode_output()`, or None to make it here."""
    n_src, k = src.shape[0], rule.beam_size
    controls = Controls.none(n_src) if controls is None else controls
    limits = row_limits(src, length, extra)  # [N]
    real = jnp.sum(limits > 0, dtype=jnp.int32)
    queue = Queue(model.init_cache(src, 1, output=output), limits, controls, real)
    first = lambda x: x[:slots]
    cache = queue.cache.select(jnp.arange(slots), 1).grow(length)  # the first sources
    s = beam.init(cache, first(limits), k, length, jax.tree.map(first, controls))
    who = jnp.where(jnp.arange(slots) < real, jnp.arange(slots, dtype=jnp.int32), -1)
    n = rule.n_best
    out = (
        jnp.zeros((n_src, n, length), jnp.int32),
        jnp.full((n_src, n), NEG_INF, jnp.float32),
        jnp.zeros((n_src, n, controls.phrases.shape[1]), bool),
        jnp.zeros((n_src,), jnp.int32),
    )
    p = Pool(s, who, jnp.minimum(real, slots), out)

    def body(p: Pool) -> Pool:
        p = p._replace(s=beam.step(model.decode_step, p.s, alpha, rule))
        return _harvest(p, queue, alpha, rule)

    return jax.lax.while_loop(lambda p: jnp.any(p.who >= 0), body, p)


def decode_output(model: Transformer | Ensemble | Parts) -> Any:
    """The model's output projection as its searches read it (`Transformer.decode_output`),
    made once, to be passed to each `pool_search`."""
    graphdef, state = split(model)
    return _decode_output(graphdef, state)


def decode_output_shape(model: Transformer | Ensemble | Parts) -> Any:
    """`decode_output`'s shapes and dtypes (`jax.ShapeDtypeStruct`s), for a program
    prepared from shapes alone. The model's arrays enter the trace as its arguments: a
    jitted function called on concrete arrays inside a trace, by threads at once (jobs
    prepare their programs beside the running searches), can crash jaxlib while it
    compares the calls' static arguments."""
    graphdef, state = split(model)
    return jax.eval_shape(functools.partial(_merged_output, graphdef), state)


def _merged_output(graphdef, state):
    return nnx.merge(graphdef, state).decode_output()


_decode_output = jax.jit(_merged_output, static_argnames=("graphdef",))


@functools.partial(jax.jit, static_argnames=("graphdef", "rule", "slots", "length", "extra"))
def _pool(graphdef, state, src, alpha, controls, output, *, rule, slots, length, extra):
    model = nnx.merge(graphdef, state)
    p = pool_state(model, src, alpha, rule, slots, length, extra, controls, output)
    return *p.out[:3], p.s.step, p.out[3]


def pool_search(
    model: Transformer | Ensemble | Parts,
    src: jax.Array,
    *,
    alpha: float | jax.Array,
    rule: Rule,
    slots: int,
    length: int,
    extra: int | None,
    controls: Controls | None = None,
    output: Any = None,
    call: Call = jit_call,
) -> tuple[jax.Array, ...]:
    """The beam searches of src [N, S], `slots` sources at a time, in one program.

    Args:
      src: the queue, real sources first: filler rows (search/scoring.py `FILLER`) only
        after the last real one. N >= slots.
      length, extra: as search/decoding.py `decode_shape` gives them; C = length is
        also the room.
      controls: each source's prefix and phrases (search/constraints.py `Controls`).
      output: the model's `decode_output()` (`decode_output` here makes it once for
        many calls), or None: made in the program. Searches running side by side then
        read one copy of the output layer, which leaves more of the processor's
        cache to the rest of their steps.
      call: runs the compiled program, as search/decoding.py `search_batch`'s.
    Returns:
      tokens [N, n, C] and scores [N, n] as `search_batch`'s (n = rule.n_best), met
      [N, n, Q] bool, the steps run [] (each fed slots * K rows), and the steps each
      source's search took [N] (0 for a filler).
    """
    if not 0 < slots <= src.shape[0]:
        raise ValueError(f"slots must be in [1, {src.shape[0]}] (the sources), got {slots}")
    graphdef, state = split(model)
    if not isinstance(src, jax.ShapeDtypeStruct):
        src = jnp.asarray(src, jnp.int32)
    args = state, src, jnp.float32(alpha), controls, output
    return call(_pool, graphdef, args, dict(rule=rule, slots=slots, length=length, extra=extra))

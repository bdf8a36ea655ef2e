"""Beam search over any decoder's step function: the state between steps, one step, and
the loop (pure; jit-compiled by its caller).

    step_fn(tokens, cache) -> (logits, cache)     # tokens [R] -> logits [R, V], one position on
    tokens, scores = beam_search(step_fn, cache, length=20, beam_size=4)
    # cache for B sources -> [B, K, 20], [B, K]: each source's K best, best first

The search knows the decoder only by its step function (as Flax's examples/wmt and
T5X's searches do) and by the cache it threads through it: a pytree whose leaves
hold one row per source on axis 0, or a `BeamCache` that says itself how its rows
are repeated, gathered and grown (the Transformer's `DecodeCache` keeps one copy of
each source's cross-attention for its K beams). The Transformer's own searches,
compiled as one program per batch shape, are search/decoding.py's.

Search: K hypotheses per source, in B*K rows (rows b*K .. b*K + K-1 are source
b's). Each step takes the 2K best extensions; an EOS among the first K finishes
a hypothesis (so beam 1 with alpha 0 is greedy search); the K best others stay
live and carry on the cache of the beam they extend, in its row where they can
(`places`). A source is done by `Rule.stop` (by default once its result can no
longer change) and then gains no hypothesis, so stopping it earlier or later
(stages, batches) gives the same results. Scores are log P / lp(len), len
counting EOS (search/scoring.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from attention_jax.search import constraints
from attention_jax.search.constraints import Controls
from attention_jax.search.scoring import NEG_INF, normalized_score, restrict, top_k
from attention_jax.search.settings import Rule, SearchSettings
from attention_jax.tokens import BOS_ID, EOS_ID, PAD_ID

# step_fn(tokens [R], cache) -> (logits or log-probabilities [R, V], cache one position on)
StepFn = Callable[[jax.Array, Any], tuple[jax.Array, Any]]


@runtime_checkable
class BeamCache(Protocol):
    """A cache that handles its own rows (the Transformer's `DecodeCache`); any other
    pytree has its rows on axis 0 of every leaf, repeated and gathered as such.

    One may also have `map_rows(fn)`: itself with fn applied to each array that holds
    a row per beam on axis 0. A CPU's search then copies the rows that move one at a
    time, in place (`move_rows`); without it, it gathers every row with `reorder`.
    """

    def repeat(self, k: int) -> BeamCache: ...  # [B, ...] -> [B*K, ...]: K beams a source

    def reorder(self, rows: jax.Array) -> BeamCache: ...  # row r <- row rows[r], rows [B*K]

    def grow(self, capacity: int) -> BeamCache: ...  # room for `capacity` tokens

    def select(self, sources: jax.Array, k: int) -> BeamCache: ...  # sources [B'], K rows each


def repeat_rows(cache: Any, k: int) -> Any:
    """Each source's cache as its K beams' rows: [B, ...] -> [B*K, ...]."""
    if isinstance(cache, BeamCache):
        return cache.repeat(k)
    return jax.tree.map(lambda x: jnp.repeat(x, k, axis=0), cache)


def reorder_rows(cache: Any, rows: jax.Array) -> Any:
    """Row r of the new cache is row rows[r] of the old: rows [B*K] int32."""
    if isinstance(cache, BeamCache):
        return cache.reorder(rows)
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), cache)


class BeamState(NamedTuple):
    """One batch of B sources between steps (a pytree); C = the room for tokens."""

    step: jax.Array  # [] int32, steps taken (a source's next column: step - start)
    live_seqs: jax.Array  # [B, K, C] int32, hypotheses without EOS yet
    live_logp: jax.Array  # [B, K] float32, their log-probabilities (-inf = empty slot)
    fin_seqs: jax.Array  # [B, K, C] int32, EOS-terminated hypotheses, best first
    fin_scores: jax.Array  # [B, K] float32, log P / lp(length) (-inf = empty slot)
    limits: jax.Array  # [B] int32, the most tokens (EOS included) each source may produce
    cache: Any  # the decoder's, for B*K rows (the Transformer's: self-attention [B*K, N, C, H])
    controls: Controls  # per source: its prefix [B, P] and phrases [B, Q, T] (constraints.py)
    progress: jax.Array  # [B, K, Q] int32, tokens of each phrase each live beam has produced
    fin_met: jax.Array  # [B, K, Q] bool, the phrases each finished hypothesis has met
    ended: jax.Array  # [B] int32, the column at which each source was finished (-1: not yet)
    start: jax.Array  # [B] int32, the step at which each source's search began (search/pool.py)


def _gather_beams(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, M, ...], idx [B, K] -> [B, K, ...]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))  # [B, K] -> [B, K, 1, ...]
    return jnp.take_along_axis(x, idx, axis=1)


def init(
    cache: Any, limits: jax.Array, k: int, capacity: int, controls: Controls | None = None
) -> BeamState:
    """The search's start: K beams for each of the B sources whose decoder cache (one row
    a source, room for `capacity` tokens) is `cache`; limits [B] int32."""
    b = limits.shape[0]
    controls = Controls.none(b) if controls is None else controls
    q = controls.phrases.shape[1]
    return BeamState(
        step=jnp.zeros((), jnp.int32),
        live_seqs=jnp.zeros((b, k, capacity), jnp.int32),
        # [K] -> [B, K]: one live beam at first, so the first step does not pick K copies of it.
        live_logp=jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (b, 1)),
        fin_seqs=jnp.zeros((b, k, capacity), jnp.int32),
        fin_scores=jnp.full((b, k), NEG_INF, jnp.float32),
        limits=limits,
        cache=repeat_rows(cache, k),  # [B, ...] -> [B*K, ...]
        controls=jax.tree.map(jnp.asarray, controls),
        progress=jnp.zeros((b, k, q), jnp.int32),
        fin_met=jnp.zeros((b, k, q), bool),
        ended=jnp.full((b,), -1, jnp.int32),
        start=jnp.zeros((b,), jnp.int32),
    )


def columns(s: BeamState) -> jax.Array:
    """[B] int32: each source's next output column, the steps its search has taken."""
    return s.step - s.start


def done(s: BeamState, alpha: jax.Array, rule: Rule) -> jax.Array:
    """[B] bool: sources whose n_best best hypotheses are final, by `rule.stop`:

    "bound" (exact): once no live beam can reach the n_best-th finished score;
    "heuristic": once none would beat it if it ended at the next step (Hugging Face's
    default); "count": once K hypotheses have finished, the first K to end (CTranslate2's
    and OpenNMT's rule, patience 1; with K = 1, greedy search).
    """
    if rule.stop == "count":  # the K slots hold every hypothesis finished so far until full
        return jnp.isfinite(s.fin_scores[:, -1])
    # alpha >= 0: a live beam's best is log P (only falls) / lp(limit); see above.
    length = columns(s) + 1 if rule.stop == "heuristic" else s.limits
    best_live = normalized_score(jnp.max(s.live_logp, axis=1), length, alpha, rule.length_penalty)
    return s.fin_scores[:, rule.n_best - 1] >= best_live  # [B]


def places(origin: jax.Array) -> jax.Array:
    """origin [B, K] (each new beam's parent row, best first) -> held [B, K]: the new beam
    that row r holds. A parent's first child stays in the parent's row; the others take,
    best first, the rows (lowest first) of the beams that have no child. So no row whose
    cache another row takes is written, and most rows keep theirs."""
    k = origin.shape[1]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # [J, I]: i before j
    first = ~jnp.any((origin[:, :, None] == origin[:, None, :]) & earlier, axis=2)  # [B, J]
    rows = jnp.arange(k)
    parent = jnp.any(origin[:, None, :] == rows[None, :, None], axis=2)  # [B, R]
    free = jnp.cumsum(~parent, axis=1) - 1  # [B, R]: the rank of each childless row
    later = jnp.cumsum(~first, axis=1) - 1  # [B, J]: the rank of each other child
    taken = ~parent[:, None, :] & (free[:, None, :] == later[:, :, None])  # [B, J, R]
    row = jnp.where(first, origin, jnp.argmax(taken, axis=2))  # [B, J]: a permutation
    return jnp.argsort(row, axis=1).astype(jnp.int32)  # [B, R]


# The platforms on which the rows that move are copied one at a time, in place: on a CPU
# that costs less than a gather, which writes every row to a new buffer that a one-step
# loop then copies back; on a GPU or TPU each copy would be a kernel of its own.
ROW_COPY_PLATFORMS = ("cpu",)


def move_rows(cache: Any, origin: jax.Array, moving: jax.Array) -> Any:
    """The cache with row r of source b a copy of its row origin[b, r] [B, K] where
    moving[b, r] [B, K] (no such origin row is itself moving). Lowered for a platform of
    `ROW_COPY_PLATFORMS`, only the moving rows are copied, one at a time in place (a
    plain pytree, or a `BeamCache` with `map_rows`); elsewhere every row is gathered."""
    b, k = origin.shape
    src = (jnp.arange(b)[:, None] * k + origin).reshape(b * k)  # [B*K]
    moving = moving.reshape(b * k)
    gather = lambda c: reorder_rows(c, jnp.where(moving, src, jnp.arange(b * k)))
    if isinstance(cache, BeamCache) and not hasattr(cache, "map_rows"):
        return gather(cache)

    def copies(c: Any) -> Any:
        dst = jnp.argsort(~moving).astype(jnp.int32)  # the moving rows first (a stable sort)

        def one(i: jax.Array, c: Any) -> Any:
            row = lambda x: jax.lax.dynamic_slice_in_dim(x, src[dst[i]], 1, 0)
            copy = lambda x: jax.lax.dynamic_update_slice_in_dim(x, row(x), dst[i], 0)
            return c.map_rows(copy) if isinstance(c, BeamCache) else jax.tree.map(copy, c)

        return jax.lax.fori_loop(0, jnp.sum(moving, dtype=jnp.int32), one, c)

    # Chosen where the program is lowered: an export for several platforms holds both.
    by_platform = {p: copies for p in ROW_COPY_PLATFORMS}
    return jax.lax.platform_dependent(cache, **by_platform, default=gather)


def _extend(seqs: jax.Array, beam: jax.Array, token: jax.Array, t: jax.Array) -> jax.Array:
    """seqs [B, K, C] -> [B, M, C]: beam [B, M]'s sequence with token [B, M] at column
    t [B] (its source's)."""
    out = _gather_beams(seqs, beam)  # [B, K, C] -> [B, M, C]
    at = jnp.arange(seqs.shape[2]) == t[:, None, None]  # [B, 1, C]
    return jnp.where(at, token[:, :, None].astype(jnp.int32), out)


def _logp(step_fn: StepFn, s: BeamState, rule: Rule) -> tuple[jax.Array, Any]:
    """log P of every next token per live beam [B, K, V] (restricted as the rules say:
    the limit, the minimum length, the prefix's tokens, EOS before every phrase is met),
    and the decoder's cache one position on."""
    b, k, _ = s.live_seqs.shape
    t = columns(s)  # [B]
    # [B, K, C] -> [B, K]: the token each beam fed last (column t-1; BOS at t = 0).
    last = jnp.maximum(t - 1, 0)[:, None, None]  # [B, 1, 1]
    prev_col = jnp.take_along_axis(s.live_seqs, last, axis=2)[:, :, 0]
    prev = jnp.where((t == 0)[:, None], BOS_ID, prev_col).reshape(b * k)  # [B, K] -> [B*K]
    logits, cache = step_fn(prev, s.cache)  # [B*K] -> [B*K, V]
    v = logits.shape[-1]
    logp = jax.nn.log_softmax(logits).reshape(b, k, v)  # [B*K, V] -> [B, K, V]
    force_eos = jnp.broadcast_to((t >= s.limits - 1)[:, None], (b, k))  # [B] -> [B, K]
    prefix = s.controls.prefix  # [B, P]
    plen = jnp.sum(prefix != 0, axis=1, dtype=jnp.int32)  # [B]
    ban_eos = jnp.broadcast_to((t < rule.min_length)[:, None], (b, k))  # the prefix counts
    if s.progress.shape[2]:  # EOS only once every phrase is met
        ban_eos = ban_eos | jnp.any(s.progress < s.controls.lengths[:, None, :], axis=2)
    logp = restrict(logp, force_eos, rule.vocab_limit, ban_eos)
    if prefix.shape[1]:  # the prefix's token at no cost: the search ranks what follows it
        forced = jnp.take_along_axis(prefix, jnp.minimum(t, prefix.shape[1] - 1)[:, None], 1)
        pinned = jnp.where(jnp.arange(v) == forced, 0.0, NEG_INF)  # [B, V]
        logp = jnp.where((t < plen)[:, None, None], pinned[:, None, :], logp)
    return logp, cache


def step(step_fn: StepFn, s: BeamState, alpha: jax.Array, rule: Rule) -> BeamState:
    """Feed every live beam its last token and keep the best extensions: one position on.

    A new beam takes its parent's row where it is the parent's first child, else the row
    of a beam that has no child; the rows whose beam continues another row's cache take a
    copy of it (`move_rows`).
    """
    b, k, _ = s.live_seqs.shape
    t = columns(s)  # [B]
    stopped = done(s, alpha, rule)  # [B]: nothing is added to a done source's results
    ended = jnp.where((s.ended < 0) & (stopped | (t >= s.limits)), t, s.ended)  # [B]
    logp, cache = _logp(step_fn, s, rule)  # [B, K, V]
    v = logp.shape[-1]
    cand = (s.live_logp[:, :, None] + logp).reshape(b, k * v)  # [B, K, V] -> [B, K*V]
    # 2K candidates: at most K of them end in EOS, so K stay alive.
    top_logp, top_idx = top_k(cand, 2 * k)  # [B, 2K]
    top_beam, top_tok = top_idx // v, top_idx % v  # [B, 2K]
    is_eos = top_tok == EOS_ID  # [B, 2K]

    # Live: the K best candidates that did not end. Finished: an EOS candidate counts
    # only if it ranks among the K best (as in fairseq). With phrases, the candidates
    # also hold each beam's next phrase tokens and best token, and "best" is the order
    # of dynamic beam allocation (search/constraints.py).
    if s.progress.shape[2]:
        phrases, fail = s.controls.phrases[:, None], s.controls.fail[:, None]  # [B, 1, Q, T]
        top = (top_logp, top_beam, top_tok)
        cand_logp, cand_beam, cand_tok = constraints.candidates(
            top, s.live_logp, logp, s.progress, s.controls.phrases
        )  # [B, M]
        cand_progress = constraints.advance(
            _gather_beams(s.progress, cand_beam), cand_tok, phrases, fail
        )  # [B, M, Q]
        place = constraints.allocation_order(cand_logp, jnp.sum(cand_progress, -1))  # [B, M]
        cand_eos = cand_tok == EOS_ID
        _, pos = jax.lax.top_k(-(place + jnp.where(cand_eos, place.shape[1], 0)), k)  # [B, K]
        live_logp = jnp.where(
            jnp.take_along_axis(cand_eos, pos, 1), NEG_INF, jnp.take_along_axis(cand_logp, pos, 1)
        )
        progress = _gather_beams(cand_progress, pos)  # [B, M, Q] -> [B, K, Q]
        _, fin = jax.lax.top_k(-place, k)  # [B, K] the K first
        end_logp, end_beam = (jnp.take_along_axis(x, fin, 1) for x in (cand_logp, cand_beam))
        end_tok = jnp.take_along_axis(cand_tok, fin, 1)
    else:
        cand_beam, cand_tok, progress = top_beam, top_tok, s.progress
        live_logp, pos = jax.lax.top_k(jnp.where(is_eos, NEG_INF, top_logp), k)  # [B, K]
        end_logp, end_beam, end_tok = top_logp[:, :k], top_beam[:, :k], top_tok[:, :k]
    if rule.stop == "heuristic":  # lp(next length) grows: keep done sources done
        live_logp = jnp.where(stopped[:, None], NEG_INF, live_logp)
    origin = jnp.take_along_axis(cand_beam, pos, axis=1)  # [B, K] previous beam
    token = jnp.take_along_axis(cand_tok, pos, axis=1)  # [B, K]
    if k > 1:  # with one beam a source each row continues its own cache
        held = places(origin)  # [B, K]: the new beam each row holds
        origin, token, live_logp, progress = (
            _gather_beams(x, held) for x in (origin, token, live_logp, progress)
        )
        # A row whose beam is dead (-inf) needs no cache.
        moving = (origin != jnp.arange(k)) & jnp.isfinite(live_logp)  # [B, K]
        cache = move_rows(cache, origin, moving)
    live_seqs = _extend(s.live_seqs, origin, token, t)

    # Merge the newly finished with the K kept so far; with phrases, those that met them
    # all first (only the length limit ends one that has not).
    new_scores = normalized_score(end_logp, t[:, None] + 1, alpha, rule.length_penalty)
    ends = (end_tok == EOS_ID) & ~stopped[:, None]  # [B, K]
    if s.controls.prefix.shape[1]:  # right after a prefix only the best may end (as CTranslate2)
        plen = jnp.sum(s.controls.prefix != 0, axis=1)  # [B]
        after = (plen > 0) & (t == plen)  # [B]
        ends = ends & ~(after[:, None] & (jnp.arange(k) > 0)[None, :])
    new_scores = jnp.where(ends, new_scores, NEG_INF)
    new_met = _gather_beams(s.progress, end_beam) >= s.controls.lengths[:, None, :]
    all_scores = jnp.concatenate([s.fin_scores, new_scores], axis=1)  # [B, 2K]
    all_met = jnp.concatenate([s.fin_met, new_met], axis=1)  # [B, 2K, Q]
    rank = jnp.where(jnp.all(all_met, axis=2), all_scores, all_scores - _UNMET)
    _, fin_pos = jax.lax.top_k(rank, k)  # [B, K]
    all_seqs = jnp.concatenate([s.fin_seqs, _extend(s.live_seqs, end_beam, end_tok, t)], 1)
    return s._replace(
        step=s.step + 1,
        live_seqs=live_seqs,
        live_logp=live_logp,
        fin_seqs=_gather_beams(all_seqs, fin_pos),  # [B, 2K, C] -> [B, K, C]
        fin_scores=jnp.take_along_axis(all_scores, fin_pos, axis=1),
        cache=cache,
        progress=progress,
        fin_met=_gather_beams(all_met, fin_pos),
        ended=ended,
    )


# How far below every hypothesis that met all its phrases one that did not ranks.
_UNMET = 1e9


def finished(s: BeamState, alpha: jax.Array, rule: Rule) -> jax.Array:
    """[B] bool: sources whose results are final (done, or at their length limit)."""
    return done(s, alpha, rule) | (columns(s) >= s.limits)


def steps_taken(s: BeamState) -> jax.Array:
    """[B] int32: the steps each source's search ran (one still unfinished, or finished
    by the last step: all of them so far)."""
    return jnp.where(s.ended < 0, columns(s), s.ended)


def step_until(
    step_fn: StepFn,
    s: BeamState,
    alpha: jax.Array,
    rule: Rule,
    unroll: int = 1,
    until: jax.Array | int = 0,
) -> BeamState:
    """Steps until at most `until` sources are unfinished (by default: every source is
    finished) or the room (C) is full: a `while_loop`.

    With `unroll` 2 (a large search: search/decoding.py) the steps go two at a time,
    each iteration testing the condition once: a step's cache
    reorder is a gather, which cannot write the buffer it reads, so a one-step loop
    copies it back every step; with two, the first writes a fresh buffer and the second
    the loop's own. Single steps then fill what is left of the room. The loop may run a
    few steps more than needed: a done source gains nothing, and it never passes the
    room.
    """
    capacity = s.live_seqs.shape[2]

    def cond(s: BeamState) -> jax.Array:
        left = jnp.sum(~finished(s, alpha, rule), dtype=jnp.int32)
        return (s.step < capacity) & (left > until)

    def steps(n: int) -> Callable[[BeamState], BeamState]:
        def body(s: BeamState) -> BeamState:
            for _ in range(n):
                s = step(step_fn, s, alpha, rule)
            return s

        return body

    if unroll > 1:
        s = jax.lax.while_loop(lambda s: cond(s) & (s.step + unroll <= capacity), steps(unroll), s)
    return jax.lax.while_loop(cond, steps(1), s)


def select_rows(cache: Any, sources: jax.Array, k: int) -> Any:
    """The cache of the sources `sources` [B'] (indices) alone, their K beams' rows each."""
    if isinstance(cache, BeamCache):
        return cache.select(sources, k)
    return reorder_rows(cache, (sources[:, None] * k + jnp.arange(k)).reshape(-1))  # [B'*K]


def select(s: BeamState, sources: jax.Array) -> BeamState:
    """The search of the sources `sources` [B'] int32 (indices into the B) alone: the same
    step, so each one's search goes on as it would have in the whole batch (a source's
    results never depend on the others)."""
    k = s.live_seqs.shape[1]
    per_source = lambda x: jnp.take(x, sources, axis=0)  # [B, ...] -> [B', ...]
    fields = [f for f in s._fields if f not in ("step", "cache")]
    kept = {f: jax.tree.map(per_source, getattr(s, f)) for f in fields}
    return s._replace(cache=select_rows(s.cache, sources, k), **kept)


def grow(s: BeamState, capacity: int) -> BeamState:
    """Room for `capacity` tokens: sequences [B, K, C] padded, and the cache grown (a
    `BeamCache` only: the Transformer's self-attention [B*K, N, C, H])."""
    if not isinstance(s.cache, BeamCache):
        raise ValueError("only a BeamCache (with grow) can be searched in stages")
    extra = capacity - s.live_seqs.shape[2]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra)))  # [B, K, C] -> [B, K, capacity]
    return s._replace(
        live_seqs=pad(s.live_seqs), fin_seqs=pad(s.fin_seqs), cache=s.cache.grow(capacity)
    )


def results(s: BeamState) -> tuple[jax.Array, jax.Array]:
    """tokens [B, K, C] (no BOS, EOS-terminated, 0 after; all 0 in a slot never
    filled) and scores [B, K] (-inf in such a slot), best first."""
    tokens = jnp.where(jnp.isfinite(s.fin_scores)[:, :, None], s.fin_seqs, PAD_ID)
    return tokens, s.fin_scores


def uniform_limits(cache: Any, length: int) -> jax.Array:
    """[B] int32, all `length`: one limit for each of the cache's B rows (axis 0 of its
    first leaf)."""
    return jnp.full((jax.tree.leaves(cache)[0].shape[0],), length, jnp.int32)


def beam_search(
    step_fn: StepFn,
    cache: Any,
    *,
    length: int,
    limits: jax.Array | None = None,
    vocab_limit: int | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    **settings: Any,
) -> tuple[jax.Array, jax.Array]:
    """Beam search over a decoder's step function, with a length penalty, exact stopping,
    target prefixes and terminology constraints.

    Args:
      step_fn: (tokens [R], cache) -> (logits or log-probabilities [R, V], cache one
        position on); R = B*K rows, b*K .. b*K + K-1 source b's beams.
      cache: the decoder's cache for the B sources (one row each; the search repeats
        it for their beams: `repeat_rows`), with room for `length` tokens.
      length: output columns L.
      limits: [B] int32, the most tokens (EOS included) each source may produce, at
        most L; None: L for every source. EOS is forced at the limit.
      vocab_limit: never emit ids >= this (None = the whole vocabulary).
      prefixes: per source, the tokens its output must start with (forced; they count
        in the length, not in the score).
      constraints: per source, the phrases (token lists) its output must contain.
      settings: search/settings.py `SearchSettings` fields: beam_size (K), alpha,
        n_best (hypotheses returned per source), length_penalty, stop and min_length;
        the rest have no effect here.
    Returns:
      tokens [B, n, L] int32 (no BOS, EOS-terminated, 0 after EOS) and scores [B, n]
      float32 = log P / lp(len), best first; -inf for a slot never filled.

    Token ids follow the library's: 0 padding, 1 EOS, 2 BOS (never emitted).
    """
    search = SearchSettings(**settings)
    rule = search.rule(vocab_limit)
    limits = uniform_limits(cache, length) if limits is None else jnp.asarray(limits, jnp.int32)
    controls = None
    if prefixes is not None or constraints is not None:
        controls = Controls.fitted(prefixes or [], constraints or [], rows=limits.shape[0])
    s = init(cache, limits, rule.beam_size, length, controls)
    s = step_until(step_fn, s, jnp.float32(search.alpha), rule)
    tokens, scores = results(s)
    return tokens[:, : rule.n_best], scores[:, : rule.n_best]

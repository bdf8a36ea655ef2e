"""The Transformer's searches: its step function and cache under the searches of
search/beam.py and search/sampling.py, each compiled as one program per batch shape.

    tokens = translate(model, src)                              # [B, S] -> [B, L], beam 4
    tokens, scores = translate_beams(model, src, beam_size=4)   # [B, K, L], [B, K], best first
    tokens = translate_greedy(model, src)                       # [B, L]
    tokens = translate_sample(model, src, jax.random.key(0))    # [B, L]

(Many sources of different lengths, batched into static shapes: search/translate.py.)

The model supplies its step function, `Transformer.decode_step`, and its cache,
`Transformer.init_cache` (the source encoded once, every layer's cross-attention
keys/values projected once); the search feeds one token per step. A
`DecodeCache` repeats only the self-attention for a source's K beams and grows
its room in place, so a large beam search (`search_batch`) runs in stages of
growing room, in one program: attention and the cache reorder read caches of
about the length decoded so far. The jitted functions live at module level and
take the model as (graphdef, state), so a second call with the same shapes and
static arguments reuses the compiled program.

Length limit: by default a source of n tokens may produce at most n + 50 output
tokens (EOS included), and the output array has L = S + 50 columns (S the padded
source width), both capped at `config.max_len`. An explicit `max_decode_len`
sets L and the limit of every row. When a hypothesis reaches its limit, EOS is
forced (as fairseq does), so every returned hypothesis is a complete sentence
and scores are comparable.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from attention_jax.search import beam
from attention_jax.search.constraints import Controls
from attention_jax.search.sampling import sample_loop
from attention_jax.search.scoring import output_limit, rooms, row_limits
from attention_jax.search.settings import DEFAULTS, EXTRA_DECODE_LEN, Rule, SearchSettings
from attention_jax.transformer import Transformer


class Parts(NamedTuple):
    """A model split once (`nnx.split`) for the many programs of one job: a split walks
    the whole module graph on the host, at every call. It stands for the model wherever
    a search reads only its config."""

    graphdef: Any
    state: Any
    config: Any  # the model's TransformerConfig

    @classmethod
    def of(cls, model: Transformer) -> Parts:
        return cls(*nnx.split(model), model.config)


def split(model: Transformer | Parts) -> tuple[Any, Any]:
    """(graphdef, state) of a model, or of one split already."""
    return model[:2] if isinstance(model, Parts) else nnx.split(model)


def decode_shape(model: Transformer | Parts, src: jax.Array, max_decode_len: int | None):
    """(L, extra): output columns, and per-row extra length (None = every row gets L)."""
    max_len = model.config.max_len
    s = src.shape[1]
    if s > max_len:
        raise ValueError(f"source length {s} exceeds the model's max_len {max_len}")
    if max_decode_len is None:
        return output_limit(s, max_len), EXTRA_DECODE_LEN
    if not 0 < max_decode_len <= max_len:
        raise ValueError(f"max_decode_len must be in [1, {max_len}], got {max_decode_len}")
    return max_decode_len, None


# --- greedy search and sampling ---------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "length", "extra", "top_k", "greedy", "vocab_limit", "min_length"),
)
def _sample(
    graphdef, state, src, rng, temperature, *, length, extra, top_k, greedy, vocab_limit, min_length
):
    """search/sampling.py's loop over the model: src [B, S] -> tokens [B, L], log P [B]."""
    model = nnx.merge(graphdef, state)
    limits = row_limits(src, length, extra)  # [B]
    cache = model.init_cache(src, length)
    return sample_loop(
        model.decode_step,
        cache,
        limits,
        length,
        rng,
        temperature,
        greedy=greedy,
        top_k=top_k,
        vocab_limit=vocab_limit,
        min_length=min_length,
    )


def translate_greedy(
    model: Transformer,
    src: jax.Array,
    *,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    min_length: int = DEFAULTS.min_length,
    return_logprob: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Argmax decoding with the KV cache: src [B, S] int32 (0 = padding) -> [B, L] int32
    tokens (no BOS, EOS-terminated, 0 after EOS); with `return_logprob`, also [B]
    float32 log P(tokens | src), EOS included.

    max_decode_len: output columns L; default S + 50 (capped at `config.max_len`) with
    a per-row limit of (source length + 50). vocab_limit, min_length: as
    search/sampling.py `greedy_search`.
    """
    if min_length < 0:
        raise ValueError(f"min_length must be >= 0, got {min_length}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = decode_shape(model, src, max_decode_len)
    graphdef, state = nnx.split(model)
    static = dict(length=length, extra=extra, vocab_limit=vocab_limit, min_length=min_length)
    rng, one = jax.random.key(0), jnp.float32(1.0)
    tokens, logp = _sample(graphdef, state, src, rng, one, top_k=0, greedy=True, **static)
    return (tokens, logp) if return_logprob else tokens


def translate_sample(
    model: Transformer,
    src: jax.Array,
    rng: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    min_length: int = DEFAULTS.min_length,
) -> jax.Array:
    """Ancestral sampling from softmax(logits / temperature), optionally over the top_k
    tokens: src [B, S] -> [B, L] int32 tokens as `translate_greedy`."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0 or top_k > model.config.vocab_size:
        raise ValueError(f"top_k must be in [0, vocab_size], got {top_k}")
    if min_length < 0:
        raise ValueError(f"min_length must be >= 0, got {min_length}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = decode_shape(model, src, max_decode_len)
    graphdef, state = nnx.split(model)
    static = dict(length=length, extra=extra, vocab_limit=vocab_limit, min_length=min_length)
    args = (graphdef, state, src, rng, jnp.float32(temperature))
    tokens, _ = _sample(*args, top_k=top_k, greedy=False, **static)
    return tokens


# --- beam search: a batch's whole search, one program ------------------------

# A search whose self-attention caches (all layers, keys and values) hold at least
# this many bytes is large: it grows its room in stages, and on the platforms below
# its loop steps two positions per iteration. Two steps a loop iteration are faster
# on large caches but make each program compile longer, which below a few MB is
# rarely won back (docs/searching.md has the measurements).
LARGE_SEARCH_BYTES = 8 << 20
# Where a large search takes two steps per iteration (JAX's backend names and
# `jax.export`'s). Not on a CPU: there the second copy of the step doubles what a
# program takes to compile and to load, and the copy of the caches it spares costs
# little beside the step's matmuls.
TWO_STEP_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})
# The platforms searches are traced for when they are not JAX's default backend's: a
# program compiled ahead of time for another machine (aot/fit.py), or exported for
# several (backends/stablehlo.py); None: the default backend's.
_TARGET_PLATFORMS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "target_platforms", default=None
)


@contextlib.contextmanager
def tracing_for(*platforms: str) -> Iterator[None]:
    """Searches traced within step as they do on `platforms` ('cpu', 'gpu', 'cuda', 'tpu',
    ...; with several, each lowers its own loop). JAX keeps a trace per shape: a search
    this process traced before with the same shapes keeps the loop it had."""
    token = _TARGET_PLATFORMS.set(platforms)
    try:
        yield
    finally:
        _TARGET_PLATFORMS.reset(token)


def large_search(model: Transformer | Parts, rows: Any, room: Any) -> bool:
    """Whether a search of `rows` beam rows with room for `room` tokens is large; one of a
    symbolic batch size (an exported program, which serves batches of any size) is."""
    cfg = model.config
    per_token = 2 * cfg.num_decoder_layers * cfg.num_heads * cfg.head_dim  # keys and values
    nbytes = rows * room * per_token * cfg.dtype.itemsize
    return not isinstance(nbytes, int) or nbytes >= LARGE_SEARCH_BYTES


def first_state(
    model: Transformer,
    src: jax.Array,
    rule: Rule,
    room: int,
    length: int,
    extra: int | None,
    controls: Controls | None,
) -> beam.BeamState:
    """src [B, S]'s beam search before its first step, with room for `room` tokens."""
    limits = row_limits(src, length, extra)
    return beam.init(model.init_cache(src, room), limits, rule.beam_size, room, controls)


def step_until(
    model: Transformer, s: beam.BeamState, alpha: jax.Array, rule: Rule, until: Any = 0
) -> beam.BeamState:
    """search/beam.py `step_until` over the model's step: two steps a loop iteration in a large
    search on a GPU or TPU, until at most `until` sources are left or the room is full."""
    rows, room = s.live_seqs.shape[0] * rule.beam_size, s.live_seqs.shape[2]
    loop = lambda unroll: (
        lambda s: beam.step_until(model.decode_step, s, alpha, rule, unroll, until)
    )
    platforms = _TARGET_PLATFORMS.get() or (jax.default_backend(),)
    one = [p for p in platforms if p not in TWO_STEP_PLATFORMS]
    if not large_search(model, rows, room) or len(one) == len(platforms):
        return loop(1)(s)
    if not one:
        return loop(2)(s)
    # Lowered for several platforms (an export): each compiles only its own loop.
    return jax.lax.platform_dependent(s, **{p: loop(1) for p in one}, default=loop(2))


def search_state(
    model: Transformer,
    src: jax.Array,
    alpha: jax.Array,
    rule: Rule,
    rooms: Sequence[int],
    length: int,
    extra: int | None,
    controls: Controls | None = None,
) -> beam.BeamState:
    """The state of src [B, S]'s beam search once every source is finished, grown through
    `rooms` (pure; `search_batch` runs it as one compiled program)."""
    s = first_state(model, src, rule, rooms[0], length, extra, controls)
    s = step_until(model, s, alpha, rule)
    for room in rooms[1:]:  # a stage's loop ends at once if every source is finished
        s = step_until(model, beam.grow(s, room), alpha, rule)
    return s


@functools.partial(
    jax.jit, static_argnames=("graphdef", "rule", "rooms", "length", "extra", "counted")
)
def _search(graphdef, state, src, alpha, controls, *, rule, rooms, length, extra, counted):
    model = nnx.merge(graphdef, state)
    s = search_state(model, src, alpha, rule, rooms, length, extra, controls)
    tokens, scores = beam.results(s)  # [B, K, C], [B, K]
    n = rule.n_best
    out = tokens[:, :n], scores[:, :n], s.fin_met[:, :n]  # [B, K, ...] -> [B, n, ...]
    if not counted:
        return out
    return *out, s.step, beam.steps_taken(s)  # [], [B]


def search_rooms(model: Transformer | Parts, rows: int, width: int, length: int, beam_size: int):
    """The rooms `search_batch` grows a batch of `rows` sources of width `width` through:
    in stages (search/scoring.py `rooms`) for a large search, else all `length` at once."""
    if large_search(model, rows * beam_size, length):
        return tuple(rooms(width, length))
    return (length,)


# call(fn, graphdef, args, static) = fn(graphdef, *args, **static): how a program runs
Call = Callable[[Any, Any, tuple, dict], Any]


def jit_call(fn: Any, graphdef: Any, args: tuple, static: dict) -> Any:
    """Run the jitted `fn` as is (traced and lowered once per process)."""
    return fn(graphdef, *args, **static)


def search_batch(
    model: Transformer | Parts,
    src: jax.Array,
    *,
    alpha: float | jax.Array,
    rule: Rule,
    length: int,
    extra: int | None,
    rooms: Sequence[int] | None = None,
    controls: Controls | None = None,
    call: Call = jit_call,
    counted: bool = False,
) -> tuple[jax.Array, ...]:
    """A batch's whole beam search in one program: src [B, S] -> tokens [B, n, C] (no BOS,
    EOS-terminated, 0 after; all 0 in a slot never filled) and scores [B, n] (-inf in
    such a slot), best first, n = rule.n_best, C = `length`; with `controls`, also
    met [B, n, Q] bool, the phrases each hypothesis contains. counted: also met, then
    the steps the search ran [] and the step at which each source's search ended [B].

    length, extra: as `decode_shape` gives them (a source of n tokens may produce
      min(n + extra, length) tokens; extra None: length each).
    rooms: the room for tokens, stage by stage (increasing, the last `length`): each
      stage is a loop over the steps that fit, and the next one starts with the state
      grown to its room, so attention and the cache reorder read caches about as long
      as what was decoded. None: `search_rooms`. The results are the same for any.
    controls: each source's prefix and phrases (search/constraints.py `Controls`; the
      prefix's tokens count in the length but not in the score).
    call: runs the compiled program, call(fn, graphdef, args, static); the default
      calls it (search/programs.py keeps executables on disk instead, and its
      `prepare` compiles one ahead for src given as a `jax.ShapeDtypeStruct`).
    """
    if rooms is None:
        rooms = search_rooms(model, src.shape[0], src.shape[1], length, rule.beam_size)
    rooms = tuple(min(int(r), length) for r in rooms)
    if list(rooms) != sorted(set(rooms)) or rooms[-1] != length:
        raise ValueError(f"rooms must increase to the length {length}, got {rooms}")
    graphdef, state = split(model)
    if not isinstance(src, jax.ShapeDtypeStruct):  # a shape alone: the program is only prepared
        src = jnp.asarray(src, jnp.int32)
    args = state, src, jnp.float32(alpha), controls
    static = dict(rule=rule, rooms=rooms, length=length, extra=extra, counted=counted)
    out = call(_search, graphdef, args, static)
    return out if controls is not None or counted or out is None else out[:2]  # None: prepared


def translate_beams(
    model: Transformer,
    src: jax.Array,
    *,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    **settings: Any,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with a length penalty and early stopping (paper: K=4, alpha=0.6, GNMT's):
    src [B, S] int32 (0 = padding) -> tokens [B, n, L] int32 (no BOS, EOS-terminated, 0
    after EOS) and scores [B, n] float32 = log P / lp(len), best first (-inf: a slot
    that never held a hypothesis).

    max_decode_len: output columns L (see `translate_greedy`). settings:
    search/settings.py `SearchSettings` fields (beam_size, alpha, length_penalty, stop,
    min_length; n_best is K here unless given). The other arguments are search/beam.py
    `beam_search`'s.
    """
    settings.setdefault("n_best", settings.get("beam_size", DEFAULTS.beam_size))
    search = SearchSettings(**settings)
    vocab = vocab_limit or model.config.vocab_size
    if search.beam_size > vocab // 2:
        raise ValueError(f"beam_size {search.beam_size} too large for a vocabulary of {vocab}")
    src = jnp.asarray(src, jnp.int32)
    length, extra = decode_shape(model, src, max_decode_len)
    args = dict(alpha=search.alpha, rule=search.rule(vocab_limit), length=length, extra=extra)
    if prefixes is None and constraints is None:
        return search_batch(model, src, **args)
    controls = Controls.fitted(prefixes or [], constraints or [], rows=src.shape[0])
    tokens, scores, _ = search_batch(model, src, controls=controls, **args)
    return tokens, scores


def translate(
    model: Transformer,
    src: jax.Array,
    *,
    max_decode_len: int | None = None,
    vocab_limit: int | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    **settings: Any,
) -> jax.Array:
    """The best translation of each source: [B, S] -> [B, L] int32 (beam_size 1 = greedy;
    with prefixes or constraints, beam search's, as `translate_beams` takes them).

    Tokens exclude BOS, end with EOS and are 0 after it; `Tokenizer.decode` reads them.
    """
    search = SearchSettings(**settings)
    if search.beam_size == 1 and prefixes is None and constraints is None:
        return translate_greedy(
            model, src, max_decode_len=max_decode_len, vocab_limit=vocab_limit,
            min_length=search.min_length,
        )  # fmt: skip
    tokens, _ = translate_beams(
        model,
        src,
        max_decode_len=max_decode_len,
        vocab_limit=vocab_limit,
        prefixes=prefixes,
        constraints=constraints,
        **settings,
    )
    return tokens[:, 0]  # [B, K, L] -> [B, L]

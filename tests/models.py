"""Small random models for the tests and what a full forward pass says of them.

`make` builds the search tests' tiny Transformer (TINY: conftest's TEST_MODEL with a
12-token vocabulary and two decoder layers), `ragged_src` and `sources_of` their
sources; `full_logp` gives log P(next | prefix) from a full forward pass (no cache),
`PENALTIES` the length penalties of the reference searches, `as_list` a token row up to
its EOS. `MARIAN` holds the model options a Marian / OPUS-MT model needs. `forward`,
`cache_of` and `step_of` run any model's forward pass, cache set-up and decoding step as
one compiled program each.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_jax import BOS_ID, EOS_ID, PAD_ID, Transformer, TransformerConfig
from tests.conftest import model_fields

TINY = model_fields(vocab_size=12, num_decoder_layers=2)


def make(seed=0, **overrides) -> Transformer:
    return Transformer(TransformerConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(seed))


def ragged_src(seed, lengths, width=None, vocab=12):
    """[B, S] sources of the given lengths (ids 4..V-1, EOS-terminated as in training)."""
    rng = np.random.default_rng(seed)
    width = width or max(lengths)
    src = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = rng.integers(4, vocab, size=n - 1)
        src[i, n - 1] = EOS_ID
    return jnp.asarray(src)


def sources_of(lengths, seed=0, vocab=40):
    """Sources of the given lengths as lists (ids 4..vocab-1, then EOS)."""
    rng = np.random.default_rng(seed)
    return [[*rng.integers(4, vocab, size=n - 1).tolist(), EOS_ID] for n in lengths]


def forward(model: Transformer, src, tgt_in, **packing) -> jax.Array:
    """`model(src, tgt_in, **packing)` as one compiled program. Called eagerly, a model
    compiles each of its hundreds of operations for each new shape, several times the
    work of compiling the whole pass once."""
    return _forward(*nnx.split(model), src, tgt_in, packing)


@jax.jit
def _forward(graphdef, state, src, tgt_in, packing):
    return nnx.merge(graphdef, state)(src, tgt_in, **packing)


def cache_of(model: Transformer, src, max_decode_len: int):
    """`model.init_cache(src, max_decode_len)` as one compiled program (see `forward`)."""
    return _cache_of(*nnx.split(model), src, max_decode_len)


@functools.partial(jax.jit, static_argnums=3)
def _cache_of(graphdef, state, src, max_decode_len):
    return nnx.merge(graphdef, state).init_cache(src, max_decode_len=max_decode_len)


def step_of(model: Transformer, tokens, cache):
    """`model.decode_step(tokens, cache)` as one compiled program (see `forward`)."""
    return _step_of(*nnx.split(model), tokens, cache)


@jax.jit
def _step_of(graphdef, state, tokens, cache):
    return nnx.merge(graphdef, state).decode_step(tokens, cache)


def full_logp(model, src_row, prefix, width=32):
    """log P(next | prefix) from a full forward pass: src [S], prefix list -> [V] float64.

    The decoder input is padded to a fixed width so that one compiled program
    serves every prefix; causality keeps the padding from mattering.
    """
    tgt_in = np.zeros((1, width), np.int32)
    tgt_in[0, : len(prefix) + 1] = [BOS_ID, *prefix]
    logits = forward(model, src_row[None], jnp.asarray(tgt_in))[0, len(prefix)]
    logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
    logp[[PAD_ID, BOS_ID]] = -np.inf  # searches never emit these
    return logp


# lp(n) of a hypothesis of n tokens, EOS included: the paper's and CTranslate2's.
PENALTIES = {
    "gnmt": lambda n, alpha: ((5 + n) / 6) ** alpha,
    "average": lambda n, alpha: n**alpha,
}


def as_list(row):
    row = [int(t) for t in np.asarray(row)]
    return row[: row.index(EOS_ID) + 1] if EOS_ID in row else row


# The options of a Marian / OPUS-MT model (test_model_options, test_model).
MARIAN = dict(
    activation="swish",
    attention_bias=True,
    logits_bias=True,
    positions="sinusoid_halves",
    zero_start=True,
)

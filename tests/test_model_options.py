"""The model options Marian / OPUS-MT models need (attention and logit biases, swish,
Marian's sinusoid layout, a trained position table, a zero decoder start), against
independent references; off by default, where they add nothing to the paper's model.
(Their agreement with CTranslate2's Marian semantics: tests/test_ct2_export.py; cached
decoding with all of them equal to the full pass: tests/test_model.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attention_jax import BOS_ID, Transformer, TransformerConfig, shift_right
from attention_jax.positional import sinusoidal_positions
from tests.conftest import model_fields, perturbed_model
from tests.models import MARIAN


def tokens(seed: int, shape) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 4, 40)


def test_marians_layout_puts_the_sines_first_and_the_cosines_second():
    """CTranslate2's reading of Marian's table, in float64: timescale 10000^(2i/D) per
    pair of dimensions, sin(pos / timescale) in column i < D/2, cos in D/2 + i."""
    length, d = 50, 16
    pos = np.arange(length)[:, None]
    timescales = np.power(10000.0, 2 * (np.arange(d) // 2) / d)[None, :]
    angle = pos / timescales
    want = np.concatenate([np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])], axis=1)
    np.testing.assert_allclose(sinusoidal_positions(length, d, halves=True), want, atol=1e-6)
    # The same waves as the paper's, in another order.
    paper = sinusoidal_positions(length, d)
    np.testing.assert_array_equal(
        sinusoidal_positions(length, d, halves=True),
        np.concatenate([paper[:, 0::2], paper[:, 1::2]], 1),
    )


def test_each_option_computes_what_it_says():
    """Against the same model without the option, given its parameters by hand."""
    m = perturbed_model(4, **MARIAN)
    src, tgt = tokens(5, (2, 5)), shift_right(tokens(6, (2, 4)))
    # The logits' bias is added to the logits.
    plain = nnx.clone(m)
    object.__setattr__(plain, "logits_bias", None)
    np.testing.assert_allclose(
        m(src, tgt), plain(src, tgt) + np.asarray(m.logits_bias[...]), atol=1e-5
    )
    # A zero start is BOS's embedding set to zeros (a shared table: the decoder's only).
    no_start = Transformer(
        TransformerConfig(**model_fields(**dict(MARIAN, zero_start=False))), rngs=nnx.Rngs(4)
    )
    nnx.update(no_start, nnx.state(m, nnx.Param))
    row = no_start.tgt_embed.embedding[...]
    no_start.tgt_embed.embedding[...] = row.at[BOS_ID].set(0.0)
    np.testing.assert_allclose(m.hidden(src, tgt), no_start.hidden(src, tgt), atol=1e-5)
    # A position table starts as the paper's sinusoid (no random draw: the other
    # parameters of the same seed are the paper model's).
    table = Transformer(TransformerConfig(**model_fields(positions="table")), rngs=nnx.Rngs(7))
    paper = Transformer(TransformerConfig(**model_fields()), rngs=nnx.Rngs(7))
    np.testing.assert_array_equal(table(src, tgt), paper(src, tgt))


def test_swish_and_the_attention_biases_match_numpy():
    """One feed-forward and one attention layer against float64 NumPy."""
    m = perturbed_model(8, **MARIAN)
    ffn, mha = m.encoder_layers[0].ffn, m.encoder_layers[0].self_attn
    x = np.asarray(jax.random.normal(jax.random.key(9), (2, 5, 32)), np.float64)
    p = lambda v: np.asarray(v[...], np.float64)
    h = x @ p(ffn.wi) + p(ffn.bi)
    want = (h / (1 + np.exp(-h))) @ p(ffn.wo) + p(ffn.bo)
    np.testing.assert_allclose(ffn(jnp.asarray(x, jnp.float32)), want, atol=1e-4)
    q = np.einsum("btd,dnh->btnh", x, p(mha.query)) + p(mha.query_bias)
    k = np.einsum("btd,dnh->btnh", x, p(mha.key)) + p(mha.key_bias)
    v = np.einsum("btd,dnh->btnh", x, p(mha.value)) + p(mha.value_bias)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", w, v)
    want = np.einsum("bqnh,nhd->bqd", o, p(mha.out)) + p(mha.out_bias)
    got, _ = mha(jnp.asarray(x, jnp.float32), None)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_papers_model_has_none_of_them():
    """Off (the defaults), the options add no parameter: existing checkpoints restore."""
    m = Transformer(TransformerConfig(**model_fields()), rngs=nnx.Rngs(0))
    names = {"/".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert not [n for n in names if "bias" in n and "norm" not in n and "ffn" not in n], names
    assert not [n for n in names if "position" in n]
    assert m.output_bias() is None and m.position_table is None


def test_the_chunked_training_loss_counts_the_logits_bias():
    """training/steps.py's loss over vocabulary chunks (no [B, T, V] logits) against the
    whole logits of a model with a logits bias: the same sums and gradients."""
    from attention_jax.training.steps import LossOptions, _forward_sums

    m = perturbed_model(10, **MARIAN)
    graphdef, params, rngs = nnx.split(m, nnx.Param, ...)
    tgt = tokens(11, (2, 6)).at[1, 4:].set(0)
    batch = {"src": tokens(12, (2, 5)), "tgt_in": shift_right(tgt), "tgt_out": tgt}

    def loss(params, chunk):
        options = LossOptions(label_smoothing=0.1, dropout=False, chunk_tokens=chunk)
        return _forward_sums(graphdef, params, rngs, batch, options)

    both = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (whole, (sums, _)), g_whole = both(params, 0)
    (part, (parts, _)), g_part = both(params, 4)
    np.testing.assert_allclose(part, whole, rtol=1e-5)
    np.testing.assert_allclose(parts["correct"], sums["correct"])
    np.testing.assert_allclose(
        g_part["logits_bias"][...], g_whole["logits_bias"][...], rtol=1e-4, atol=1e-6
    )
    assert float(jnp.abs(g_whole["logits_bias"][...]).max()) > 0

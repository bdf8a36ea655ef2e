"""Transformer behaviour: causality, padding invariance, cache == full pass, sizes, configs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_jax import BOS_ID, KVCache, Transformer, TransformerConfig, shift_right
from attention_jax.sharding import partition_specs
from tests.conftest import model_fields, perturbed_model
from tests.models import MARIAN, cache_of, forward, step_of

SMALL = model_fields(num_heads=4, num_encoder_layers=2, num_decoder_layers=2, max_len=64)


def make(**overrides) -> Transformer:
    return Transformer(TransformerConfig(**{**SMALL, **overrides}), rngs=nnx.Rngs(0))


def random_tokens(seed, shape, low=4, high=40):
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, size=shape), jnp.int32)


@pytest.fixture(scope="module")
def model():
    return make()


def test_forward_shapes_and_dtype(model):
    src, tgt = random_tokens(0, (3, 7)), random_tokens(1, (3, 5))
    logits = model(src, tgt)  # eager, as decode below: the same operations, the same bits
    assert logits.shape == (3, 5, 40)
    assert logits.dtype == jnp.float32
    assert model.encode(src).shape == (3, 7, 32)
    np.testing.assert_allclose(model.decode(tgt, model.encode(src), src), logits, atol=1e-6)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_causality(norm):
    m = make(norm=norm)
    src, tgt = random_tokens(0, (2, 6)), random_tokens(1, (2, 8))
    base = forward(m, src, tgt)
    for t in (0, 3, 7):
        changed = tgt.at[:, t].set((tgt[:, t] + 1 - 4) % 36 + 4)
        out = forward(m, src, changed)
        np.testing.assert_allclose(out[:, :t], base[:, :t], atol=1e-5)
        assert not np.allclose(out[:, t:], base[:, t:], atol=1e-4)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_invariance(norm):
    m = make(norm=norm)
    src, tgt = random_tokens(2, (2, 6)), random_tokens(3, (2, 5))
    base = forward(m, src, tgt)
    src_padded = jnp.pad(src, ((0, 0), (0, 5)))
    tgt_padded = jnp.pad(tgt, ((0, 0), (0, 4)))
    out = forward(m, src_padded, tgt_padded)
    np.testing.assert_allclose(out[:, :5], base, atol=1e-5)
    # Padding in the middle of the batch: row 1 shorter than row 0.
    src_short = src.at[1, 4:].set(0)
    one = forward(m, src_short[1:2, :4], tgt[1:2])
    both = forward(m, src_short, tgt)
    np.testing.assert_allclose(both[1:2], one, atol=1e-5)


def test_padding_contents_do_not_leak(model):
    # Whatever sits in padded *embedding* positions must not matter: change the
    # ids after the first pad to other pads (still 0) vs. a different length.
    src = jnp.array([[5, 6, 7, 1, 0, 0, 0]])
    tgt = jnp.array([[BOS_ID, 9, 10]])
    a = forward(model, src, tgt)
    b = forward(model, src[:, :4], tgt)
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm": "pre"},
        {"tie_output": False, "share_embeddings": False},
        {"activation": "gelu"},
        {"remat": True},
        MARIAN,
        {**MARIAN, "positions": "table", "norm": "pre"},
    ],
)
def test_cached_decoding_equals_full_forward(overrides):
    m = perturbed_model(1, **{**SMALL, **overrides})  # every weight (biases too) in play
    src = random_tokens(4, (3, 6)).at[2, 3:].set(0)
    tgt = jnp.concatenate([jnp.full((3, 1), BOS_ID), random_tokens(5, (3, 6))], axis=1)
    full = forward(m, src, tgt)
    cache = cache_of(m, src, max_decode_len=10)
    for t in range(tgt.shape[1]):
        logits, cache = step_of(m, tgt[:, t], cache)
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5, rtol=1e-5)
    assert int(cache.index) == tgt.shape[1]


@pytest.mark.parametrize("overrides", [{}, {**MARIAN, "positions": "table", "norm": "pre"}])
def test_a_source_that_starts_late_in_a_wrapped_ring_sees_only_its_own_tokens(overrides):
    # Row 0's source starts at step 0; row 1's source takes over row 1 after 5 steps of
    # another source's tokens, in a room of 8 slots, so its tokens wrap around the ring
    # over slots that still hold the old ones; row 0 then takes a new source too. Each
    # must equal its own full pass.
    m = perturbed_model(2, **{**SMALL, **overrides})
    src = random_tokens(6, (2, 5)).at[1, 4:].set(0)
    tgt = jnp.concatenate([jnp.full((2, 1), BOS_ID), random_tokens(7, (2, 7))], axis=1)
    full = forward(m, src, tgt)  # [2, 8, V]
    cache = cache_of(m, src, max_decode_len=8)
    late = 5
    for g in range(late + tgt.shape[1]):
        t1 = g - late
        tok1 = tgt[1, t1] if t1 >= 0 else jnp.int32(4 + g)  # the old source's tokens
        if g in (late, tgt.shape[1]):
            start0 = 0 if g < tgt.shape[1] else g
            cache = cache.replace(start=jnp.array([start0, late], jnp.int32))
        tok0 = tgt[0, g] if g < tgt.shape[1] else jnp.int32(5)
        logits, cache = step_of(m, jnp.stack([tok0, tok1]).astype(jnp.int32), cache)
        if g < tgt.shape[1]:
            np.testing.assert_allclose(logits[0], full[0, g], atol=1e-5, rtol=1e-5)
        if t1 >= 0:
            np.testing.assert_allclose(logits[1], full[1, t1], atol=1e-5, rtol=1e-5)


def test_packed_rows_equal_separate_rows():
    m = make()
    s1, s2 = random_tokens(6, (1, 4)), random_tokens(7, (1, 3))
    t1, t2 = random_tokens(8, (1, 3)), random_tokens(9, (1, 5))
    t1, t2 = t1.at[:, 0].set(BOS_ID), t2.at[:, 0].set(BOS_ID)
    src = jnp.concatenate([s1, s2, jnp.zeros((1, 2), jnp.int32)], axis=1)
    tgt = jnp.concatenate([t1, t2], axis=1)
    packed = forward(
        m,
        src,
        tgt,
        src_segments=jnp.array([[1, 1, 1, 1, 2, 2, 2, 0, 0]]),
        tgt_segments=jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]]),
        src_positions=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0, 0]]),
        tgt_positions=jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]]),
    )
    np.testing.assert_allclose(packed[:, :3], forward(m, s1, t1), atol=1e-5)
    np.testing.assert_allclose(packed[:, 3:], forward(m, s2, t2), atol=1e-5)


@pytest.mark.slow  # ~17 s
def test_dropout_only_when_not_deterministic():
    m = make(dropout_rate=0.3, attention_dropout_rate=0.2)
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    np.testing.assert_array_equal(m(src, tgt), m(src, tgt))
    a = m(src, tgt, deterministic=False)
    b = m(src, tgt, deterministic=False)
    assert not np.allclose(a, b)


@pytest.mark.slow  # ~25 s: two gradients compiled
def test_remat_gives_same_gradients():
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    loss = lambda m: m(src, tgt).mean()
    g1 = nnx.state(nnx.grad(loss)(make()), nnx.Param)
    g2 = nnx.state(nnx.grad(loss)(make(remat=True)), nnx.Param)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_attention_implementations_agree_in_model():
    src = random_tokens(0, (2, 5)).at[1, 3:].set(0)
    tgt = random_tokens(1, (2, 4))
    xla, jax_impl = make(), make(attention_impl="jax")
    np.testing.assert_allclose(forward(xla, src, tgt), forward(jax_impl, src, tgt), atol=1e-5)


def test_bfloat16_computation_keeps_float32_params_and_logits():
    m = make(dtype="bfloat16")
    src, tgt = random_tokens(0, (2, 5)), random_tokens(1, (2, 4))
    logits = forward(m, src, tgt)
    assert logits.dtype == jnp.float32
    for p in jax.tree.leaves(nnx.state(m, nnx.Param)):
        assert p.dtype == jnp.float32
    np.testing.assert_allclose(logits, forward(make(), src, tgt), atol=0.15)


@pytest.mark.parametrize("positions", ["sinusoid", "sinusoid_halves", "table"])
def test_a_programs_position_rows_are_the_whole_tables_first_rows(positions):
    m = make(positions=positions)
    whole = np.asarray(m.position_table_values())  # [max_len, D]
    assert whole.shape == (64, 32)
    for length in (1, 7, 64, 80):  # 80: past max_len, the whole table
        np.testing.assert_array_equal(m.position_table_values(length), whole[: min(length, 64)])


def test_tied_embeddings_share_one_table():
    tied = make()
    assert tied.tgt_embed is tied.src_embed and tied.unembed is None
    untied = make(share_embeddings=False, tie_output=False)
    assert untied.tgt_embed is not untied.src_embed and untied.unembed is not None


def test_cross_attention_weights_are_distributions(model):
    src = random_tokens(0, (2, 6)).at[1, 4:].set(0)
    tgt = random_tokens(1, (2, 3))
    w = np.asarray(model.cross_attention_weights(src, tgt))
    assert w.shape == (2, 2, 4, 3, 6)  # [L, B, N, T, S]
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(w[:, 1, :, :, 4:], 0.0)  # never on source padding


@pytest.mark.slow  # ~24 s
def test_cross_attention_weights_rows_are_independent():
    # Word alignments for n-best lists run many (source, hypothesis) rows at once:
    # each row must get what it gets alone, whatever the others' lengths.
    m = make()
    src = random_tokens(2, (3, 6)).at[1, 4:].set(0).at[2, 2:].set(0)
    tgt = random_tokens(3, (3, 4)).at[0, 3:].set(0)
    w = np.asarray(m.cross_attention_weights(src, tgt))  # [L, B, N, T, S]
    for b, (s_len, t_len) in enumerate([(6, 3), (4, 4), (2, 4)]):
        alone = m.cross_attention_weights(src[b : b + 1, :s_len], tgt[b : b + 1, :t_len])
        np.testing.assert_allclose(w[:, b : b + 1, :, :t_len, :s_len], alone, atol=1e-6)
    # Remat (a training setting) changes nothing in a forward pass.
    np.testing.assert_allclose(make(remat=True).cross_attention_weights(src, tgt), w, atol=1e-6)


def test_decoder_layer_returns_the_cache_it_fills():
    layer = make().decoder_layers[0]
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)  # [B, T, D]
    cross_kv = layer.cross_attn.project_kv(jnp.asarray(rng.standard_normal((2, 6, 32))))
    causal = jnp.tril(jnp.ones((5, 5), bool))[None, None]  # [1, 1, T, T]
    cross_mask = jnp.ones((2, 1, 5, 6), bool)  # [B, 1, T, S]
    full, kv, weights = layer(y, cross_kv, causal, cross_mask)
    assert weights is None and kv.k.shape == kv.v.shape == (2, 5, 4, 8)  # [B, T, N, H]
    cache = KVCache.zeros((2, 4, 8, 8), jnp.float32)  # [B, N, L, H], as decoding stores it
    for t in range(5):
        mask = (jnp.arange(8) <= t)[None, None, None]  # [1, 1, 1, L]
        step_kv = cross_kv.heads_first()  # [B, N, S, H]
        out, cache, _ = layer(y[:, t : t + 1], step_kv, mask, cross_mask[:, :, :1], cache, t)
        np.testing.assert_allclose(out[:, 0], full[:, t], atol=1e-5)
    np.testing.assert_allclose(cache.k[:, :, :5], jnp.swapaxes(kv.k, 1, 2), atol=1e-6)
    np.testing.assert_allclose(cache.v[:, :, :5], jnp.swapaxes(kv.v, 1, 2), atol=1e-6)
    np.testing.assert_array_equal(cache.k[:, :, 5:], 0.0)
    _, _, weights = layer(y, cross_kv, causal, cross_mask, return_cross_weights=True)
    assert weights.shape == (2, 4, 5, 6)  # [B, N, T, S]


def test_decode_cache_repeat_and_reorder_match_numpy(model):
    src = random_tokens(0, (2, 5)).at[1, 3:].set(0)
    cache = model.init_cache(src, max_decode_len=6)
    # Distinct values in every self-attention slot, so that a wrong row shows.
    rng = np.random.default_rng(0)
    fill = lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    cache = cache.replace(self_kv=jax.tree.map(fill, cache.self_kv), index=jnp.int32(3))
    self_kv = lambda c: jax.tree.leaves(c.self_kv)
    beams = cache.repeat(3)  # [B, ...] -> [B*K, ...], rows b*K .. b*K+K-1 are source b's
    for old, new in zip(self_kv(cache), self_kv(beams), strict=True):
        np.testing.assert_array_equal(new, np.repeat(np.asarray(old), 3, axis=0))
    # A source's beams share one copy of its cross-attention keys/values and mask.
    per_source = lambda c: jax.tree.leaves((c.cross_kv, c.src_valid))
    for old, new in zip(per_source(cache), per_source(beams), strict=True):
        np.testing.assert_array_equal(new, old)
    assert int(beams.index) == 3 and beams.max_length == 6
    rows = np.array([2, 0, 0, 4, 5, 3])  # [B*K], each within its source's block
    moved = beams.reorder(jnp.asarray(rows))
    for old, new in zip(self_kv(beams), self_kv(moved), strict=True):
        np.testing.assert_array_equal(new, np.asarray(old)[rows])
    # Cross keys/values, source mask and index are the same for all of a source's beams.
    same = lambda c: jax.tree.leaves((c.cross_kv, c.src_valid, c.index))
    for old, new in zip(same(beams), same(moved), strict=True):
        np.testing.assert_array_equal(new, old)


def test_shift_right():
    tgt = jnp.array([[5, 6, 7, 1], [8, 1, 0, 0]])
    np.testing.assert_array_equal(shift_right(tgt), [[BOS_ID, 5, 6, 7], [BOS_ID, 8, 1, 0]])


def count_params(cfg: TransformerConfig) -> int:
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    "sizes,paper,ours",
    [
        (dict(), 65e6, 63_045_632),
        (dict(d_model=1024, num_heads=16, d_ff=4096, dropout_rate=0.3), 213e6, 214_171_648),
    ],
)
def test_parameter_counts_match_paper(sizes, paper, ours):
    n = count_params(TransformerConfig(vocab_size=37000, **sizes))
    # The paper rounds its counts (base 65M, big 213M); ours is within 4% of them ...
    assert abs(n - paper) / paper < 0.04, n
    # ... and exactly what this code builds, so a dropped bias or LayerNorm shows.
    assert n == ours


def test_every_param_has_logical_axes():
    m = nnx.eval_shape(lambda: make())
    params = nnx.state(m, nnx.Param)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for p in leaves:
        axes = p.logical_axes
        assert len(axes) == len(p.shape), (axes, p.shape)
    rules = [("embed", "fsdp"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]
    specs = jax.tree.leaves(partition_specs(params, rules))
    assert jax.sharding.PartitionSpec("fsdp", "tensor", None) in specs  # q/k/v [D, N, H]
    assert jax.sharding.PartitionSpec("tensor", "fsdp") in specs  # embedding [V, D]


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", 30),  # not divisible by 4 heads
        ("num_heads", 0),
        ("d_ff", -1),
        ("vocab_size", 3),
        ("num_encoder_layers", 0),
        ("dropout_rate", 1.0),
        ("attention_dropout_rate", -0.1),
        ("activation", "tanh"),
        ("norm", "sandwich"),
        ("dtype", "int8"),
        ("param_dtype", "float64"),
        ("dtype", "no-such-type"),
        ("attention_impl", "flash"),
        ("max_len", 0),
    ],
)
def test_invalid_configs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerConfig(**{**SMALL, field: value})


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="d_modle"):
        TransformerConfig.from_dict({**SMALL, "d_modle": 3})
    assert TransformerConfig.from_dict(SMALL) == TransformerConfig(**SMALL)


def test_dtypes_are_held_as_dtypes_and_written_as_names():
    import json

    given = [("bfloat16", "float32"), (jnp.bfloat16, np.float32), (np.dtype("float16"), "float32")]
    for dtype, param_dtype in given:
        cfg = TransformerConfig(**SMALL, dtype=dtype, param_dtype=param_dtype)
        assert isinstance(cfg.dtype, np.dtype) and isinstance(cfg.param_dtype, np.dtype)
        assert cfg.dtype == jnp.dtype(dtype) and cfg.param_dtype == jnp.dtype(param_dtype)
        written = json.loads(json.dumps(cfg.to_dict()))
        assert written["dtype"] == jnp.dtype(dtype).name and written["param_dtype"] == "float32"
        assert TransformerConfig.from_dict(written) == cfg
        assert hash(TransformerConfig.from_dict(written)) == hash(cfg)  # a static jit argument


def test_config_is_frozen():
    cfg = TransformerConfig(**SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 64  # type: ignore[misc]


def test_decode_cache_rejects_too_long(model):
    with pytest.raises(ValueError, match="max_len"):
        model.init_cache(random_tokens(0, (1, 3)), max_decode_len=65)


def test_bfloat16_embedding_gradient_accumulates_in_float32():
    # 4096 positions of one token scatter-add 4096 cotangents into one row of the
    # float32 table; summed in bfloat16 (8-bit mantissa) most of them would be lost.
    # D = 64 makes sqrt(D) = 8 exact, so each position's cotangent is exactly 8 w.
    embed = make(dtype="bfloat16", d_model=64).src_embed
    ids = jnp.full((4, 1024), 7, jnp.int32)  # [B, T]
    w = np.random.default_rng(0).uniform(0.5, 1.5, (4, 1024, 64))  # [B, T, D]
    w = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)  # exactly representable in bf16
    loss = lambda e: jnp.sum(e(ids).astype(jnp.float32) * jnp.asarray(w, jnp.float32))
    grad = np.asarray(nnx.grad(loss)(embed).embedding[...])  # [V, D]
    assert grad.dtype == np.float32
    np.testing.assert_allclose(grad[7], 8.0 * w.sum(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_array_equal(np.delete(grad, 7, axis=0), 0.0)

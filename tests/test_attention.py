"""Attention and masks against a NumPy float64 reference; what the cuDNN path relies on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attention_jax import Transformer, TransformerConfig, attention
from attention_jax.attention import (
    Mask,
    attention_weights,
    causal_mask,
    dot_product_attention,
    padding_mask,
    segment_mask,
)
from tests.conftest import model_fields
from tests.masks import dense_from_lengths, length_mask


def reference_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(H)) v per head in float64; fully masked rows -> 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    s = k.shape[1]
    mask = np.broadcast_to(np.asarray(mask), (b, n, t, s))
    out = np.zeros((b, t, n, h))
    for bi in range(b):
        for ni in range(n):
            logits = q[bi, :, ni] @ k[bi, :, ni].T / np.sqrt(h)  # [T, S]
            for ti in range(t):
                allowed = mask[bi, ni, ti]
                if not allowed.any():
                    continue
                x = np.where(allowed, logits[ti], -np.inf)
                w = np.exp(x - x.max())
                w /= w.sum()
                out[bi, ti, ni] = w @ v[bi, :, ni]
    return out


def _random_qkv(seed, b=2, t=5, s=7, n=3, h=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, n, h)).astype(np.float32)
    v = rng.normal(size=(b, s, n, h)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mask_shape", ["full", "broadcast_heads"])
def test_matches_numpy_reference(seed, mask_shape):
    q, k, v = _random_qkv(seed)
    rng = np.random.default_rng(100 + seed)
    shape = (2, 3, 5, 7) if mask_shape == "full" else (2, 1, 5, 7)
    mask = rng.random(shape) > 0.3
    mask[0, 0, 1] = False  # one fully masked row
    got = dot_product_attention(q, k, v, jnp.asarray(mask))
    np.testing.assert_allclose(got, reference_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_no_mask_equals_all_true_mask():
    q, k, v = _random_qkv(3)
    mask = np.ones((2, 1, 5, 7), bool)
    np.testing.assert_allclose(
        dot_product_attention(q, k, v), reference_attention(q, k, v, mask), atol=1e-5
    )


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _random_qkv(4)
    mask = jnp.zeros((2, 1, 5, 7), bool)
    for impl in ("xla", "jax"):
        out = dot_product_attention(q, k, v, mask, impl=impl)
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_array_equal(out, 0.0)
    w = attention_weights(q, k, mask)
    np.testing.assert_array_equal(w, 0.0)


def test_gradients_finite_with_fully_masked_rows():
    q, k, v = _random_qkv(5)
    mask = jnp.zeros((2, 1, 5, 7), bool).at[:, :, :2].set(True)
    grads = jax.grad(lambda q, k, v: dot_product_attention(q, k, v, mask).sum(), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_implementations_agree(seed):
    q, k, v = _random_qkv(seed)
    mask = np.random.default_rng(seed).random((2, 1, 5, 7)) > 0.4
    mask[1, 0, 2] = False
    a = dot_product_attention(q, k, v, jnp.asarray(mask), impl="xla")
    b = dot_product_attention(q, k, v, jnp.asarray(mask), impl="jax")
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_attention_dropout_is_inverted_and_deterministic_per_key():
    q, k, v = _random_qkv(6, t=4, s=4, n=1, h=4)
    v = np.ones_like(v)
    outs = [
        dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(i))
        for i in range(200)
    ]
    # Each weight is kept with p=0.5 and scaled by 2, so E[out] = 1 for all-ones values.
    np.testing.assert_allclose(np.mean(outs, axis=0), 1.0, atol=0.15)
    again = dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
    np.testing.assert_array_equal(outs[0], again)


def test_padding_and_causal_masks():
    tokens = jnp.array([[5, 6, 7, 0], [8, 0, 0, 0]])
    pad = np.asarray(padding_mask(tokens, tokens))
    assert pad.shape == (2, 1, 4, 4)
    valid = np.asarray(tokens) != 0
    np.testing.assert_array_equal(pad[:, 0], valid[:, :, None] & valid[:, None, :])
    causal = np.asarray(causal_mask(tokens))
    lower = np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(causal[:, 0], pad[:, 0] & lower)
    assert not causal[0, 0, 0, 1]  # no look-ahead
    assert not causal[0, 0, 3, 0]  # a padded query attends nowhere


def test_segment_mask():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    m = np.asarray(segment_mask(seg, seg))[0, 0]
    expected = np.array(
        [[a == b and a > 0 for b in [1, 1, 2, 2, 2, 0]] for a in [1, 1, 2, 2, 2, 0]]
    )
    np.testing.assert_array_equal(m, expected)


# --- What the cuDNN path relies on: lengths instead of dense masks ------------------------
#
# attention_impl='cudnn' (and 'auto' on GPUs in bf16) hands cuDNN the compact form of
# each mask: per-row query and key lengths plus a causal flag. These tests pin, on
# CPU, that (1) the lengths our Transformer derives from real batches describe
# exactly its dense masks, (2) jax.nn.dot_product_attention(implementation='xla')
# given those lengths (the semantics cuDNN implements) equals our dense reference,
# and (3) whatever a fused kernel leaves in padded query rows (forward) and in the
# gradients of padded rows (backward) never reaches real outputs or gradients.

SEAM_MODEL = model_fields(d_model=16, d_ff=32)
KINDS = ("encoder", "decoder", "cross")


@pytest.fixture(autouse=True)
def _fresh_cudnn_probe():
    """Each test sees 'auto' decide afresh (the probe's verdict is cached per process)."""
    attention._cudnn_works.cache_clear()
    yield
    attention._cudnn_works.cache_clear()


def pipeline_batch() -> dict[str, np.ndarray]:
    """A bucketed batch as data.pipeline assembles it, with every length cuDNN must handle.

    Bucket length 11. Sources (EOS included) of 1, 5, 8, 11 tokens; decoder inputs
    (BOS included) of 3, 1, 10, 11; then two all-padding filler rows (length 0 on
    every side), which the pipeline emits to give every process the same number of
    batches.
    """
    from attention_jax.data.batches import assemble_bucketed
    from attention_jax.data.tokenized import TokenizedCorpus

    rng = np.random.default_rng(0)
    src_len = np.array([0, 4, 7, 10], np.int32)
    tgt_len = np.array([2, 0, 9, 10], np.int32)

    def flat(lens):
        starts = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int64)
        return rng.integers(4, 40, int(lens.sum())).astype(np.int32), starts

    (sf, ss), (tf, ts) = flat(src_len), flat(tgt_len)
    tc = TokenizedCorpus(sf, ss, src_len, tf, ts, tgt_len, np.arange(4, dtype=np.int64))
    return assemble_bucketed(tc, np.arange(4), num_rows=6, length=11)


def xla_by_lengths(q, k, v, mask: Mask) -> jax.Array:
    """The semantics cuDNN implements, computed by XLA: jax.nn with lengths and is_causal."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=mask.causal,
        query_seq_lengths=jnp.asarray(mask.q_lengths, jnp.int32),
        key_value_seq_lengths=jnp.asarray(mask.kv_lengths, jnp.int32),
        implementation="xla",
    )


def nan_kernel(q, k, v, mask: Mask):
    """CPU stand-in for cuDNN: exact at real rows, NaN wherever a fused kernel may leave junk.

    Forward: NaN in padded query rows (t >= q_length; all rows of a length-0 row).
    Backward: NaN in dq at those rows and in dk, dv at padded key rows (a flash
    kernel may leave gradient rows it skips unwritten). Like JAX's cuDNN wrapper in
    training, it refuses odd sequence lengths (bucket 11 here: `_fused_attention` pads).
    """
    for x in (q, k):
        if x.shape[1] % 2:
            raise NotImplementedError(f"Unsupported sequence length {x.shape[1]} (odd)")
    q_pad = jnp.arange(q.shape[1])[None, :] >= mask.q_lengths[:, None]  # [B, T]
    kv_pad = jnp.arange(k.shape[1])[None, :] >= mask.kv_lengths[:, None]  # [B, S]
    q_pad, kv_pad = q_pad[:, :, None, None], kv_pad[:, :, None, None]

    @jax.custom_vjp
    def kernel(q, k, v):
        return jnp.where(q_pad, jnp.nan, xla_by_lengths(q, k, v, mask)).astype(q.dtype)

    def fwd(q, k, v):
        out, vjp = jax.vjp(lambda *a: xla_by_lengths(*a, mask), q, k, v)
        return jnp.where(q_pad, jnp.nan, out).astype(out.dtype), vjp

    def bwd(vjp, g):
        dq, dk, dv = vjp(g)
        return (
            jnp.where(q_pad, jnp.nan, dq).astype(dq.dtype),
            jnp.where(kv_pad, jnp.nan, dk).astype(dk.dtype),
            jnp.where(kv_pad, jnp.nan, dv).astype(dv.dtype),
        )

    kernel.defvjp(fwd, bwd)
    return kernel(q, k, v)


@pytest.fixture(scope="module")
def model_masks() -> dict[str, Mask]:
    """The Masks a Transformer hands to attention for `pipeline_batch()`, by kind.

    Captured at the cuDNN kernel seam of a one-layer-each Transformer with
    attention_impl='cudnn' (calls: encoder self, decoder self, cross).
    """
    seen = []

    def record(q, k, v, mask):
        seen.append(mask)
        return xla_by_lengths(q, k, v, mask)

    @nnx.jit
    def masks(model, src, tgt_in):
        model(src, tgt_in)
        return seen  # Masks are pytrees: traced inside, concrete once returned

    batch = pipeline_batch()
    model = Transformer(TransformerConfig(**SEAM_MODEL, attention_impl="cudnn"), rngs=nnx.Rngs(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_cudnn_kernel", record)
        got = masks(model, jnp.asarray(batch["src"]), jnp.asarray(batch["tgt_in"]))
    assert [m.causal for m in got] == [False, True, False]
    return dict(zip(KINDS, got, strict=True))


def test_lengths_from_real_batches_describe_the_dense_masks(model_masks):
    expected = {  # (query lengths, key lengths) per row; rows 4, 5 are filler rows
        "encoder": ([1, 5, 8, 11, 0, 0], [1, 5, 8, 11, 0, 0]),
        "decoder": ([3, 1, 10, 11, 0, 0], [3, 1, 10, 11, 0, 0]),
        "cross": ([3, 1, 10, 11, 0, 0], [1, 5, 8, 11, 0, 0]),
    }
    for kind, mask in model_masks.items():
        np.testing.assert_array_equal(mask.q_lengths, expected[kind][0])
        np.testing.assert_array_equal(mask.kv_lengths, expected[kind][1])
        t, s = mask.dense.shape[-2:]
        dense = dense_from_lengths(mask.q_lengths, mask.kv_lengths, t, s, mask.causal)
        np.testing.assert_array_equal(np.asarray(mask.dense), dense)


def _qkv_for(mask: Mask, seed: int, n: int = 2, h: int = 8, dtype=np.float32):
    b, _, t, s = mask.dense.shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, n, h)).astype(dtype)
    k = rng.normal(size=(b, s, n, h)).astype(dtype)
    v = rng.normal(size=(b, s, n, h)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("kind", KINDS)
def test_xla_with_lengths_matches_dense_reference(model_masks, kind):
    """jax.nn's length semantics (cuDNN's) == float64 softmax under our dense mask, every row.

    Padded query rows and filler rows are zeros on both sides.
    """
    mask = model_masks[kind]
    q, k, v = _qkv_for(mask, seed=KINDS.index(kind))
    ref = reference_attention(q, k, v, mask.dense)
    np.testing.assert_allclose(xla_by_lengths(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(dot_product_attention(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)


def _with_empty_source_row(mask: Mask) -> Mask:
    """The cross mask plus a row with 3 queries and no key (batches never make one)."""
    q_len = np.append(np.asarray(mask.q_lengths), 3)
    kv_len = np.append(np.asarray(mask.kv_lengths), 0)
    t, s = mask.dense.shape[-2:]
    return length_mask(q_len, kv_len, t, s, mask.causal)


@pytest.mark.parametrize("kind", [*KINDS, "cross+empty_source"])
def test_fused_path_ignores_junk_in_padded_rows(model_masks, monkeypatch, kind):
    """impl='cudnn' over a kernel that writes NaN into padded rows, forward and backward:

    outputs equal the float64 reference at every row (zeros at padded rows), and
    dq, dk, dv equal the 'xla' path's, finite everywhere.
    """
    monkeypatch.setattr(attention, "_cudnn_kernel", nan_kernel)
    if kind in model_masks:
        mask = model_masks[kind]
    else:
        mask = _with_empty_source_row(model_masks["cross"])
    q, k, v = _qkv_for(mask, seed=7)
    got = dot_product_attention(q, k, v, mask, impl="cudnn")
    np.testing.assert_allclose(got, reference_attention(q, k, v, mask.dense), atol=1e-5)

    g = np.random.default_rng(8).normal(size=q.shape).astype(np.float32)

    def grads(impl):
        loss = lambda q, k, v: jnp.vdot(dot_product_attention(q, k, v, mask, impl=impl), g)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)  # one program, not per op

    for fused, plain in zip(grads("cudnn"), grads("xla"), strict=True):
        assert np.isfinite(np.asarray(fused)).all()
        np.testing.assert_allclose(fused, plain, atol=1e-5)


def _masked_loss(model, batch):
    """Mean NLL over real targets; padded targets are excluded with a select, not a product."""
    logits = model(batch["src"], batch["tgt_in"])  # [B, T, V]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["tgt_out"][..., None], axis=-1)[..., 0]  # [B, T]
    real = batch["tgt_out"] != 0
    return jnp.where(real, nll, 0.0).sum() / real.sum(), logits


def _loss_and_grads(impl: str):
    model = Transformer(TransformerConfig(**SEAM_MODEL, attention_impl=impl), rngs=nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in pipeline_batch().items()}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params):
        return _masked_loss(nnx.merge(graphdef, params, rest), batch)

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return loss, logits, jax.tree.leaves(grads)


# ~12 s each: the working kernel in make test, each guard removed in make test-slow.
@pytest.mark.parametrize(
    "guards",
    [
        "both",
        pytest.param("no_output_select", marks=pytest.mark.slow),
        pytest.param("no_gradient_select", marks=pytest.mark.slow),
    ],
)
def test_transformer_trains_through_a_kernel_with_junk_in_padded_rows(monkeypatch, guards):
    """A Transformer on attention_impl='cudnn' over `nan_kernel`, forward and backward.

    With both guards of `_fused_attention`, logits at real positions, the loss and
    every gradient match attention_impl='xla' on the same padded batch (with
    filler rows). Each guard is needed on its own: without the output select,
    NaN in padded rows reaches real rows through the next attention (P @ V with
    P = 0 at padded keys gives 0 * NaN) and the weight gradients (dW = x^T dy sums
    over padded positions too); without the gradient select, NaN in dq, dk, dv at
    padded rows reaches every weight gradient though the forward pass is exact.
    """
    ref_loss, ref_logits, ref_grads = _loss_and_grads("xla")
    monkeypatch.setattr(attention, "_cudnn_kernel", nan_kernel)
    if guards == "no_output_select":
        monkeypatch.setattr(attention, "_zero_invalid", lambda x, valid: x)
    if guards == "no_gradient_select":
        monkeypatch.setattr(attention, "_grad_only_where", lambda x, valid: x)
    loss, logits, grads = _loss_and_grads("cudnn")
    finite = all(np.isfinite(np.asarray(g)).all() for g in grads)
    if guards == "no_output_select":
        assert not finite and not np.isfinite(float(loss))
        return
    if guards == "no_gradient_select":
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # the forward pass is exact
        assert not finite
        return
    assert finite and np.isfinite(float(loss))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    real = pipeline_batch()["tgt_in"] != 0  # [B, T]
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real], atol=1e-5)
    for g, ref in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=1e-6, rtol=1e-4)


# --- attention_impl='auto': cuDNN only where it works -------------------------------------


def _raise_at_trace(q, k, v, mask):
    raise RuntimeError("cuDNN: no kernel for this configuration\n(second line)")


def _raise_at_run(q, k, v, mask):
    """Traces and compiles, then fails when the program runs, as cuDNN errors from XLA do."""

    def boom(x):
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    @jax.custom_vjp
    def kernel(q):
        return jax.pure_callback(boom, jax.ShapeDtypeStruct(q.shape, q.dtype), q)

    kernel.defvjp(lambda q: (kernel(q), None), lambda _, g: (kernel(g),))
    return kernel(q)


@pytest.mark.parametrize("failure", [_raise_at_trace, _raise_at_run], ids=["trace", "run"])
def test_auto_falls_back_to_xla_with_one_warning(monkeypatch, caplog, failure):
    """'auto' on a (pretend) GPU in bf16 whose cuDNN fails: XLA results, one log line, no crash."""
    monkeypatch.setattr(attention, "_on_gpu", lambda: True)
    monkeypatch.setattr(attention, "_cudnn_kernel", failure)
    mask = length_mask([5, 2, 0], [5, 3, 0], 5, 5, causal=False)
    # Head dim 8, as in the model below: one (dtype, head dim), one probe, one warning.
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv_for(mask, seed=3, h=8))
    want = dot_product_attention(q, k, v, mask, impl="xla")
    attend = lambda q, k, v: dot_product_attention(q, k, v, mask, impl="auto")
    with caplog.at_level("WARNING", logger="attention_jax.attention"):
        np.testing.assert_array_equal(attend(q, k, v), want)
        np.testing.assert_array_equal(jax.jit(attend)(q, k, v), want)
        jax.grad(lambda q: attend(q, k, v).astype(jnp.float32).sum())(q)
        cfg = TransformerConfig(**{**SEAM_MODEL, "dtype": "bfloat16", "attention_impl": "auto"})
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        batch = {k: jnp.asarray(v) for k, v in pipeline_batch().items()}
        assert np.isfinite(np.asarray(nnx.jit(lambda m: _masked_loss(m, batch)[0])(model)))
    warnings = [r for r in caplog.records if r.name == "attention_jax.attention"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "\n" not in message and "RuntimeError" in message and "'xla'" in message
    with pytest.raises(Exception, match=r"cuDNN|CUDNN"):  # an explicit 'cudnn' still raises
        np.asarray(dot_product_attention(q, k, v, mask, impl="cudnn"))


@pytest.mark.slow  # ~28 s: the probe compiles every case
def test_auto_uses_the_fused_path_where_the_probe_passes(monkeypatch, caplog):
    calls = []

    def counting(q, k, v, mask):
        calls.append(q.dtype)
        return nan_kernel(q, k, v, mask)

    monkeypatch.setattr(attention, "_on_gpu", lambda: True)
    monkeypatch.setattr(attention, "_cudnn_kernel", counting)
    mask = length_mask([5, 2, 0], [5, 5, 0], 5, 5, causal=True)
    q, k, v = _qkv_for(mask, seed=4, h=16)
    with caplog.at_level("WARNING", logger="attention_jax.attention"):
        for dtype, fused in [(jnp.bfloat16, True), (jnp.float32, False)]:
            calls.clear()
            qd, kd, vd = (jnp.asarray(x, dtype) for x in (q, k, v))
            got = dot_product_attention(qd, kd, vd, mask, impl="auto")
            assert bool(calls) == fused, dtype
            want = dot_product_attention(qd, kd, vd, mask, impl="xla")
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32))
        calls.clear()  # a plain dense mask has no lengths: never fused
        qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
        dot_product_attention(qb, kb, vb, mask.dense, impl="auto")
        assert not calls
    assert not [r for r in caplog.records if r.name == "attention_jax.attention"]
    assert attention._cudnn_works.cache_info().misses == 1  # one probe per (dtype, head dim)

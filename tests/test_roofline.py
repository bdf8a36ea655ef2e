"""aot/roofline.py: the per-kernel roofline of a GPU program, on a hand-written module.

Every expected number is computed here from the shapes, by the formulas the
module's docstring states, not read from the code under test.
"""

import pytest

from attention_jax.aot.roofline import kernel_roofline

# A loop of 13 chunks: slice a [64, 512] chunk out of x, multiply it by w (cuBLAS), write
# the product into a [13, 64, 1024] buffer in place; before it, causal cuDNN attention and
# an all-reduce (left to the caller), bitcasts and tuples (no kernels).
HLO = """HloModule m, entry_computation_layout={()->()}

%fused_slice (param_0: bf16[13,64,512], param_1: s32[]) -> bf16[64,512] {
  %param_0 = bf16[13,64,512]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = bf16[1,64,512]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), @SIZES@
  ROOT %b = bf16[64,512]{1,0} bitcast(%ds)
}

%fused_dus (param_0.1: bf16[13,64,1024], param_1.1: bf16[64,1024], param_2.1: s32[]) -> @Y@ {
  %param_0.1 = bf16[13,64,1024]{2,1,0} parameter(0)
  %param_1.1 = bf16[64,1024]{1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %c.1 = s32[] constant(0)
  %b.1 = bf16[1,64,1024]{2,1,0} bitcast(%param_1.1)
  ROOT %dus = bf16[13,64,1024]{2,1,0} dynamic-update-slice(%param_0.1, %b.1, %param_2.1, %c.1, %c.1)
}

%fused_norm (param_0.2: f32[4096,512]) -> bf16[4096,512] {
  %param_0.2 = f32[4096,512]{1,0} parameter(0)
  ROOT %cv = bf16[4096,512]{1,0} convert(%param_0.2)
}

%body (arg: @TUPLE@) -> @TUPLE@ {
  %arg = @TUPLE@ parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[13,64,512]{2,1,0} get-tuple-element(%arg), index=1
  %w = bf16[512,1024]{1,0} get-tuple-element(%arg), index=2
  %y = bf16[13,64,1024]{2,1,0} get-tuple-element(%arg), index=3
  %chunk = bf16[64,512]{1,0} fusion(%x, %i), kind=kLoop, calls=%fused_slice
  %gemm = (bf16[64,1024]{1,0}, s8[4194304]{0}) custom-call(%chunk, %w), @GEMM@
  %prod = bf16[64,1024]{1,0} get-tuple-element(%gemm), index=0
  %y2 = bf16[13,64,1024]{2,1,0} fusion(%y, %prod, %i), kind=kLoop, calls=%fused_dus
  ROOT %t = @TUPLE@ tuple(%i, %x, %w, %y2)
}

%cond (arg.1: @TUPLE@) -> pred[] {
  %arg.1 = @TUPLE@ parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x.1: @X@, w.1: bf16[512,1024], y.1: @Y@, q.1: @Q@, h.1: f32[4096,512]) -> @Y@ {
  %x.1 = bf16[13,64,512]{2,1,0} parameter(0)
  %w.1 = bf16[512,1024]{1,0} parameter(1)
  %y.1 = bf16[13,64,1024]{2,1,0} parameter(2)
  %q.1 = bf16[2,128,4,64]{3,2,1,0} parameter(3)
  %h.1 = f32[4096,512]{1,0} parameter(4)
  %len = s32[2]{0} constant({128, 100})
  %attn = @OUT@ custom-call(%q.1, %q.1, %q.1, %len, %len), @ATTENTION@
  %norm = bf16[4096,512]{1,0} fusion(%h.1), kind=kLoop, calls=%fused_norm
  %sum = bf16[4096,512]{1,0} all-reduce(%norm), replica_groups={}, to_apply=%cond
  %zero = s32[] constant(0)
  %init = @TUPLE@ tuple(%zero, %x.1, %w.1, %y.1)
  %loop = @TUPLE@ while(%init), condition=%cond, body=%body, @TRIPS@
  ROOT %out = bf16[13,64,1024]{2,1,0} get-tuple-element(%loop), index=3
}
"""
# One instruction a line, as XLA prints them; the long attributes spelled out here.
_DIMENSIONS = (
    '"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],'
    '"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]'
)
for _key, _text in {
    "OUT": "(bf16[2,4,128,64]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[0]{0})",
    "TUPLE": "(s32[], bf16[13,64,512]{2,1,0}, bf16[512,1024]{1,0}, bf16[13,64,1024]{2,1,0})",
    "GEMM": 'custom_call_target="__cublas$lt$matmul", backend_config='
    '{"gemm_backend_config":{"dot_dimension_numbers":{' + _DIMENSIONS + "}}}",
    "ATTENTION": 'custom_call_target="__cudnn$fmhaSoftmax", backend_config='
    '{"cudnn_fmha_backend_config": {"mask_type": "PADDING_CAUSAL"}}',
    "TRIPS": 'backend_config={"known_trip_count":{"n":"13"}}',
    "SIZES": "dynamic_slice_sizes={1,64,512}",
    "X": "bf16[13,64,512]",
    "Y": "bf16[13,64,1024]",
    "Q": "bf16[2,128,4,64]",
}.items():
    HLO = HLO.replace(f"@{_key}@", _text)

PEAK, BW = 1e15, 4e12  # FLOP/s, bytes/s


def test_each_kernel_is_a_roofline_and_the_step_their_sum():
    est = kernel_roofline(HLO, PEAK, BW)
    # Per chunk: the slice fusion reads its chunk (not all of x) and the index, writes it.
    chunk = 64 * 512 * 2
    slice_bytes = chunk + 4 + chunk
    # The GEMM: 2 x output x contracted; bytes: both factors and the product (no workspace).
    gemm_flops = 2 * 64 * 1024 * 512
    gemm_bytes = chunk + 512 * 1024 * 2 + 64 * 1024 * 2
    # The in-place update reads the product and the index, writes only the product.
    dus_bytes = 64 * 1024 * 2 + 4 + 64 * 1024 * 2
    # Causal attention, B=2, T=S=128, N=4, H=64: half of 4 B N T S H.
    attn_flops = 4 * 2 * 4 * 128 * 128 * 64 / 2
    attn_bytes = 3 * 2 * 128 * 4 * 64 * 2 + 2 * 2 * 4 + (2 * 4 * 128 * 64 * 2 + 2 * 4 * 128 * 4)
    norm_bytes = 4096 * 512 * (4 + 2)

    per_chunk = max(slice_bytes / BW, 0) + max(gemm_flops / PEAK, gemm_bytes / BW) + dus_bytes / BW
    expected = 13 * per_chunk + max(attn_flops / PEAK, attn_bytes / BW) + norm_bytes / BW
    assert est["seconds"] == pytest.approx(expected)
    assert est["kernels"] == 13 * 3 + 2  # the all-reduce is not a kernel of this sum
    assert est["flops"] == pytest.approx(13 * gemm_flops + attn_flops)
    assert est["bytes"] == 13 * (slice_bytes + gemm_bytes + dus_bytes) + attn_bytes + norm_bytes
    assert est["gemm_s"] == pytest.approx(13 * max(gemm_flops / PEAK, gemm_bytes / BW))
    assert est["attention_s"] == pytest.approx(max(attn_flops / PEAK, attn_bytes / BW))


def test_the_sum_of_maxima_is_at_least_the_single_roofline():
    """Summing per kernel never predicts less than max(all FLOPs / peak, all bytes / bw)."""
    for peak, bw in ((1e12, 1e15), (1e15, 1e9), (PEAK, BW)):
        est = kernel_roofline(HLO, peak, bw)
        single = max(est["flops"] / peak, est["bytes"] / bw)
        assert est["seconds"] >= single * (1 - 1e-12)
        assert est["seconds"] <= est["flops"] / peak + est["bytes"] / bw + 1e-15


def test_backward_attention_counts_five_products():
    backward = HLO.replace("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    fwd = kernel_roofline(HLO, PEAK, BW)["flops"]
    bwd = kernel_roofline(backward, PEAK, BW)["flops"]
    assert bwd - fwd == pytest.approx(1.5 * 4 * 2 * 4 * 128 * 128 * 64 / 2)

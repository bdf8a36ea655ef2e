"""tools/trace_summary.py: kernel kinds from names seen in real H100 and CPU traces, busy
and idle time as the union of kernel intervals and an operation's own time without the
ones it runs (checked by hand), a CPU trace summed by XLA operation, and a clear error
for a folder without a trace."""

import jax
import jax.numpy as jnp
import pytest

from tools import trace_summary


@pytest.mark.parametrize(
    "name, want",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)", "attention"),
        ("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_splitK_NTT", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
        ("input_reduce_fusion_1", "reduction"),
        ("input_reduce_select_fusion_6", "reduction"),
        ("input_concatenate_fusion_15", "copy"),
        ("Memset 0", "copy"),
        ("memcpy32_post", "copy"),
        ("loop_pad_fusion", "elementwise"),
        ("fusion_5031", "elementwise"),
        ("wrapped_add", "elementwise"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collective"),
        ("some_new_kernel", "other"),
        ("ynn_fusion.4", "ynnpack"),
        ("dot.184", "gemm"),
        ("dynamic_update_slice.8", "copy"),
        ("select_dynamic-slice_fusion.3", "copy"),
        ("add_bitcast_fusion.1", "elementwise"),
    ],
)
def test_kernel_kinds(name, want):
    assert trace_summary.kind(name) == want


def test_busy_is_the_union_of_kernel_intervals_and_idle_the_rest():
    ms = 1_000_000  # ns
    events = [
        ("nvjet_gemm_a", 0, 4 * ms),  # [0, 4)
        ("loop_add_fusion", 2 * ms, 4 * ms),  # [2, 6): overlaps the GEMM by 2
        ("input_reduce_fusion", 10 * ms, 1 * ms),  # [10, 11): 4 ms idle before it
        ("nvjet_gemm_a", 11 * ms, 2 * ms),  # [11, 13)
    ]
    s = trace_summary.summarize(list(reversed(events)), top=2)  # order does not matter
    assert s["span_ms"] == pytest.approx(13.0)
    assert s["busy_ms"] == pytest.approx(9.0)  # [0, 6) + [10, 13)
    assert s["idle_ms"] == pytest.approx(4.0)
    assert s["kernels"] == 4
    kinds = {k["kind"]: k for k in s["kinds"]}
    assert kinds["gemm"]["ms"] == pytest.approx(6.0) and kinds["gemm"]["count"] == 2
    assert kinds["elementwise"]["ms"] == pytest.approx(4.0)
    assert sum(k["share"] for k in s["kinds"]) == pytest.approx(1.0)
    assert [k["kind"] for k in s["kinds"]] == ["gemm", "elementwise", "reduction"]
    assert [t["kernel"] for t in s["top"]] == ["nvjet_gemm_a", "loop_add_fusion"]


def test_no_kernels_is_an_error():
    with pytest.raises(ValueError, match="no device kernels"):
        trace_summary.summarize([])


def test_an_operation_counts_its_own_time_without_those_it_runs():
    ms = 1_000_000  # ns
    events = [
        ("while.1", 0, 10 * ms),  # [0, 10) runs a [1, 3) and b [4, 8), which runs c [5, 6)
        ("a", 1 * ms, 2 * ms),
        ("b", 4 * ms, 4 * ms),
        ("c", 5 * ms, 1 * ms),
        ("d", 12 * ms, 1 * ms),  # after the loop: its own
    ]
    own = {name: t / ms for name, _, t in trace_summary.own_times(reversed(events))}
    assert own == {"while.1": 4, "a": 2, "b": 3, "c": 1, "d": 1}


def test_an_empty_folder_gives_one_clear_message(tmp_path):
    with pytest.raises(SystemExit, match=r"no \*\.xplane\.pb under"):
        trace_summary.main([str(tmp_path)])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU trace's host plane")
def test_a_cpu_trace_is_summed_by_xla_operation(tmp_path):
    body = lambda _, x: jnp.tanh(x @ x)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 8, body, x))
    x = jnp.eye(64) / 2
    jax.block_until_ready(loop(x))
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(loop(x))
    plane, events = trace_summary.device_events(str(tmp_path))
    assert plane == "/host:CPU"
    names = [name for name, _, _ in events]
    assert all(trace_summary._XLA_OP.fullmatch(n) for n in names)
    loops = [t for name, _, t in events if name.startswith("while")]
    inside = sum(t for name, _, t in events if not name.startswith("while"))
    assert loops and inside > 0  # the loop's body ran as operations of their own
    summary = trace_summary.summarize(events)
    assert summary["busy_ms"] <= summary["span_ms"]

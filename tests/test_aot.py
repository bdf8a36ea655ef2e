"""train.py --compile_for without a compiler: targets, chip facts, shapes, HLO reading, the CLI.

The compiles themselves (libtpu, the CUDA plugin) are in tests/test_aot_compile.py
(`make test-aot`, which builds .venv-aot with both compilers).
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from attention_jax.aot import fit, hardware, hlo
from attention_jax.data.plans import rows_per_batch
from attention_jax.runtime.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- Targets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "devices", "per_host", "topology"),
    [
        ("tpu:v5e-1", 1, 1, "v5e:1x1"),
        ("tpu:v5e-4", 4, 4, "v5e:2x2"),
        ("tpu:v5e-8", 8, 8, "v5e:2x4"),
        ("tpu:v5e-256", 256, 4, "v5e:16x16"),
        ("tpu:v6e-64", 64, 4, "v6e:8x8"),
        ("tpu:v4-8", 4, 4, "v4:2x2x1"),  # v4-N counts TensorCores: 2 per chip
        ("tpu:v4-16", 8, 4, "v4:2x2x2"),
        ("tpu:v5p-128", 64, 4, "v5:4x4x4"),
        ("tpu:v5p-256", 128, 4, "v5:4x4x8"),
        ("tpu:v5p:4x8x12", 384, 4, "v5:4x8x12"),
        ("gpu:h100", 1, 1, "1x1x1"),
        ("gpu:h100x8", 8, 8, "1x1x8"),
        ("gpu:a100x16", 16, 8, "1x2x8"),
        ("GPU:H200x8", 8, 8, "1x1x8"),
    ],
)
def test_targets_name_slices_as_cloud_tpu_and_gpu_boxes_do(name, devices, per_host, topology):
    t = hardware.parse_target(name)
    assert (t.num_devices, t.devices_per_host, t.topology) == (devices, per_host, topology)
    assert t.num_hosts == max(1, devices // per_host)


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("tpu:v5e-3", "v5e-4"),  # not a slice: the valid sizes are listed
        ("tpu:v4-4", "v4-8"),
        ("tpu:v9-8", "tpu:v5e-8"),
        ("tpu:v5e:2x2x2", "2 dimensions"),
        ("gpu:h100x12", "multiple of 8"),
        ("gpu:rtx4090", "h100"),
        ("cpu:8", "tpu:"),
    ],
)
def test_unknown_targets_say_what_is_valid(name, hint):
    with pytest.raises(UserError, match=hint):
        hardware.parse_target(name)


def test_torus_shapes_double_the_last_of_the_smallest_dimensions():
    assert [hardware.torus_shape(2**k, 3) for k in range(2, 10)] == [
        (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 8),
    ]  # fmt: skip
    assert [hardware.torus_shape(2**k, 2) for k in (4, 5, 6, 7, 8)] == [
        (4, 4), (4, 8), (8, 8), (8, 16), (16, 16),
    ]  # fmt: skip


def test_hbm_table_and_usable_memory(monkeypatch):
    """Datasheet HBM per chip; XLA takes 75% of a GPU's memory unless told otherwise."""
    gib, gb = 2**30, 10**9
    names = ("tpu:v4-8", "tpu:v5e-8", "tpu:v5p-8", "tpu:v6e-8", "gpu:h100", "gpu:h200", "gpu:a100")
    hbm = {n: hardware.parse_target(n).chip.hbm_bytes for n in names}
    assert hbm == {
        "tpu:v4-8": 32 * gib, "tpu:v5e-8": 16 * gib, "tpu:v5p-8": 95 * gib,
        "tpu:v6e-8": 32 * gib, "gpu:h100": 80 * gb, "gpu:h200": 141 * gb, "gpu:a100": 80 * gb,
    }  # fmt: skip
    assert hardware.parse_target("tpu:v5e-8").usable_bytes == 16 * gib
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert hardware.parse_target("gpu:h100").usable_bytes == int(0.75 * 80 * gb)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert hardware.parse_target("gpu:h100").usable_bytes == int(0.9 * 80 * gb)


def test_every_gpu_target_has_its_description_file():
    for name in hardware.GPUS:
        path = hardware.parse_target(f"gpu:{name}").spec_file
        with open(path) as f:
            text = f.read()
        assert "cuda_compute_capability" in text and "device_memory_size" in text, path


def test_a_missing_compiler_is_one_message_with_the_pip_command(monkeypatch):
    monkeypatch.setattr(hardware.importlib.util, "find_spec", lambda name: None)
    for name, extra in (("tpu:v5e-8", "tpu"), ("gpu:h100", "cuda13")):
        pip = rf'pip install "jax\[{extra}\]=={jax.__version__}"'
        with pytest.raises(UserError, match=pip):
            hardware.check_compiler(hardware.parse_target(name))


# --- Batch shapes ------------------------------------------------------------------------


def _mesh(data, fsdp=1, tensor=1):
    """An abstract mesh (no devices needed for shapes)."""
    return jax.sharding.AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"))


def test_batch_shapes_follow_the_input_pipeline():
    from attention_jax.configs import base, tiny
    from attention_jax.data.plans import length_buckets

    c = base.get_config()  # 25k tokens, max_length 256, 34 fitted widths
    shapes, others = fit.batch_shapes(c, _mesh(8), num_processes=1, all_buckets=False)
    assert shapes == [(rows_per_batch(25_000, 256, 8), 256)] and others == 33
    assert shapes[0][0] % 8 == 0 and shapes[0][0] * 256 <= 25_000
    shapes, _ = fit.batch_shapes(c, _mesh(8), num_processes=1, all_buckets=True)
    assert [w for _, w in shapes] == sorted(length_buckets(256).tolist(), reverse=True)
    # 4 processes (hosts): each plans rows for a quarter of the budget.
    shapes, _ = fit.batch_shapes(c, _mesh(16), num_processes=4, all_buckets=False)
    assert shapes[0] == (4 * rows_per_batch(25_000 // 4, 256, 4), 256)
    # Gradient accumulation: rows a multiple of devices x micro-batches.
    c.grad_accum_steps = 3
    shapes, _ = fit.batch_shapes(c, _mesh(8), num_processes=1, all_buckets=False)
    assert shapes[0][0] % 24 == 0
    t = tiny.get_config()  # packed rows of max_length
    shapes, others = fit.batch_shapes(t, _mesh(4), num_processes=1, all_buckets=True)
    assert shapes == [(rows_per_batch(1024, 64, 4), 64)] and others == 0


def test_eval_rows_are_shared_by_the_processes():
    from attention_jax.configs import base

    c = base.get_config()
    assert fit.eval_rows(c, _mesh(8), 1, 256) == rows_per_batch(25_000, 256, 8)
    # A v5e-256 pod, FSDP over every chip, 64 hosts: each host reads 1024 of the
    # 65536 tokens, 4 rows of 256 (the global 256 rows, one per chip).
    c.batch_tokens = 65536
    assert fit.eval_rows(c, _mesh(1, 256), 64, 256) == 256
    # More hosts than the batch axes hold rows: a host's share may be a single row.
    c.batch_tokens = 16384
    assert fit.eval_rows(c, _mesh(4, 1, 64), 64, 256) == 64


def test_per_device_bytes_divides_by_the_sharding():
    devices = np.array(jax.devices()[:1])
    mesh = jax.sharding.Mesh(devices.reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    spec = jax.sharding.PartitionSpec(("data", "fsdp"), None)
    x = jax.ShapeDtypeStruct((8, 16), np.float32, sharding=jax.NamedSharding(mesh, spec))
    key = jax.eval_shape(lambda: jax.random.key(0))
    assert fit.per_device_bytes({"x": x}) == 8 * 16 * 4
    assert fit.per_device_bytes([key]) == 8  # a threefry key: two uint32 words


# --- HLO reading -------------------------------------------------------------------------

HLO = """
HloModule jit_step
%fused (param_0.1: bf16[8,512]) -> bf16[8,512] {
  %param_0.1 = bf16[8,512]{1,0} parameter(0)
  %p1 = bf16[512,512]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,512]{1,0} dot(%param_0.1, %p1), lhs_contracting_dims={1}
}
ENTRY %main {
  %a = f32[1024,512]{1,0} parameter(0)
  %ar = f32[1024,512]{1,0} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add
  %ag-start = (bf16[256,512]{1,0}, bf16[1024,512]{1,0}) all-gather-start(%b), GROUPS_AG
  %ag-done = bf16[1024,512]{1,0} all-gather-done(%ag-start)
  %rs = bf16[128,512]{1,0} reduce-scatter(%c), dimensions={0}, GROUPS_RS
  %a2a = s32[4,1,512]{2,1,0} all-to-all(%d), replica_groups={}, dimensions={0}
  %tup = (f32[512]{0}, bf16[2048]{0}) all-reduce(%e, %f), replica_groups={{0,1},{2,3}}
  %mm = f32[8,512]{1,0} custom-call(%x, %w), custom_call_target="__cublas$lt$matmul"
  %att = bf16[8,4,64]{2,1,0} custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"
}
""".replace("GROUPS_AG", "replica_groups=[2,4]<=[8], dimensions={0}").replace(
    "GROUPS_RS", "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}"
)  # one instruction a line, as XLA prints them


def test_collectives_sizes_and_ring_traffic():
    out = hlo.collectives(HLO, num_devices=8)
    mib = 2**20
    ar = out["all-reduce"]
    assert ar["count"] == 2 and ar["bytes"] == 1024 * 512 * 4 + 512 * 4 + 2048 * 2
    # p = 4 for the first, 2 for the tuple: 2 (p - 1) / p of each.
    assert ar["wire_bytes"] == pytest.approx(1.5 * 2 * mib + 1.0 * (512 * 4 + 2048 * 2))
    ag = out["all-gather"]  # the async pair counts once, with the -start's groups (p = 4)
    assert ag["count"] == 1 and ag["bytes"] == mib and ag["wire_bytes"] == 0.75 * mib
    rs = out["reduce-scatter"]  # p = 4 along the named axis
    assert rs["bytes"] == 128 * 512 * 2 and rs["wire_bytes"] == 3 * 128 * 512 * 2
    a2a = out["all-to-all"]  # no groups: every device
    assert a2a["count"] == 1 and a2a["wire_bytes"] == 7 / 8 * 4 * 512 * 4
    assert a2a["dtypes"] == ["s32"] and ar["dtypes"] == ["bf16", "f32"]


def test_matmul_dtypes_and_custom_calls():
    assert hlo.matmul_dtypes(HLO) == {"bf16": 1, "f32": 1}
    assert hlo.custom_calls(HLO, "__cudnn") == 1


# --- The command -------------------------------------------------------------------------


def _train(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--compile_for=tpu:v5e-3"], "not a v5e slice; valid: v5e-1, v5e-4"),
        (["--compile_for=tpu:v5e-8", "--compile_for_slices=0"], "compile_for_slices"),
        (["--compile_for=gpu:h100", "--config.mesh_fsdp=3"], "mesh sizes"),
    ],
)
def test_compile_for_errors_are_one_line(args, message):
    """Bad targets and configs that cannot run there: one error line, exit 1, no traceback;
    the config is checked against the target before its compiler is needed."""
    proc = _train("--config=configs/tiny.py", *args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors[0]


def test_training_still_needs_a_workdir():
    proc = _train("--config=configs/tiny.py")
    assert proc.returncode == 1 and "--workdir is required" in proc.stderr

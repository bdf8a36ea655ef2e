"""train.py --compile_for with the real compilers: what the HLO of each parallelism holds.

Run by `make test-aot` (and `make test-slow`), in .venv-aot, which holds libtpu and
the CUDA plugin (kept out of .venv: there every `import jax` would probe for a TPU).
Compiles run one at a time (`-p no:xdist`): each takes a core for up to minutes.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.aot,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="needs jax[tpu] (make test-aot)"
    ),
]


def compile_for(tmp_path, config, target, *overrides):
    """(report, {program file: HLO text}) of `train.py --compile_for`."""
    dump = tmp_path / "hlo"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(
        [sys.executable, "train.py", f"--config={config}", f"--compile_for={target}",
         f"--compile_dump={dump}", *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    texts = {p.name: p.read_text() for p in dump.iterdir()}
    return report, texts


def program(report, name):
    return next(p for p in report["programs"] if p["program"] == name)


def train_hlo(texts):
    return next(t for name, t in texts.items() if name.startswith("train_step"))


TINY = "configs/tiny.py"


def test_tiny_data_parallel_on_v5e_4(tmp_path):
    report, texts = compile_for(tmp_path, TINY, "tpu:v5e-4", "--config.mesh_data=-1")
    assert report["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1} and report["fits"]
    train = program(report, "train_step")
    # Data parallelism: gradients all-reduced, nothing else moves between chips.
    assert set(train["collectives"]) == {"all-reduce"}, train["collectives"]
    assert "all-to-all" not in train_hlo(texts)
    assert program(report, "beam_search")["fits"]  # decode.py's search compiles


def test_tiny_fsdp_shards_parameters_and_gathers_them(tmp_path):
    dp, _ = compile_for(tmp_path / "dp", TINY, "tpu:v5e-4", "--config.mesh_data=-1")
    fsdp, _ = compile_for(
        tmp_path / "fsdp", TINY, "tpu:v5e-4", "--config.mesh_data=1", "--config.mesh_fsdp=-1"
    )
    train = program(fsdp, "train_step")
    # Parameters are gathered where they are used and gradients summed over the batch's
    # devices; activations never move (before steps.gathered: 53 all-to-alls here).
    # libtpu keeps the gradient reduction an all-reduce (the GPU compiler's is a
    # reduce-scatter: test_fsdp_on_gpus_reduce_scatters_gradients).
    kinds = set(train["collectives"])
    assert "all-gather" in kinds and kinds & {"reduce-scatter", "all-reduce"}, kinds
    assert "all-to-all" not in kinds
    # Parameters + Adam moments per chip: about a quarter of the replicated ones (biases
    # and LayerNorm vectors whose axis is not sharded stay whole).
    ratio = train["bytes"]["state"] / program(dp, "train_step")["bytes"]["state"]
    assert 0.25 <= ratio < 0.3, ratio


def test_tiny_tensor_parallel_compiles(tmp_path):
    report, _ = compile_for(
        tmp_path, TINY, "tpu:v5e-4", "--config.mesh_data=1", "--config.mesh_tensor=-1"
    )
    train = program(report, "train_step")
    assert report["mesh"]["tensor"] == 4 and "all-reduce" in train["collectives"]
    assert "all-to-all" not in train["collectives"]


def test_base_data_parallel_has_no_all_to_all(tmp_path):
    """The shared source/target embedding once gave 6 all-to-alls per step here (XLA
    merged its two lookups' scatter-adds over indices concatenated along the batch)."""
    report, texts = compile_for(
        tmp_path, "configs/base.py", "tpu:v5e-4", "--config.batch_tokens=8192",
        "--config.max_length=64",
    )  # fmt: skip
    train = program(report, "train_step")
    assert set(train["collectives"]) == {"all-reduce"}, train["collectives"]
    assert "all-to-all" not in train_hlo(texts)
    assert train["matmul_dtypes"].get("f32", 0) == 0, train["matmul_dtypes"]


@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda13_plugin") is None, reason="needs jax[cuda13]"
)
def test_base_on_an_h100_uses_cudnn_attention_and_bf16_matmuls(tmp_path):
    report, _ = compile_for(tmp_path, "configs/base.py", "gpu:h100")
    assert report["attention_impl"] == "cudnn" and report["fits"]
    train = program(report, "train_step")
    # 18 attention calls (6 encoder self, 6 decoder self, 6 cross), forward and backward.
    assert train["cudnn_calls"] == 36
    assert set(train["matmul_dtypes"]) == {"bf16"}, train["matmul_dtypes"]
    # Packed rows and one-token decoding steps use XLA attention; the encoder runs cuDNN.
    assert program(report, "beam_search")["cudnn_calls"] == 6
    # The per-kernel roofline counts the GEMMs' and cuDNN's FLOPs from the HLO alone;
    # the model's formula (training/metrics.py) counts them from the config.
    est = train["estimate"]
    assert est["kernels"]["flops"] == pytest.approx(train["model_flops"], rel=0.02)
    assert est["step_s"] >= max(est["compute_s"], est["hbm_s"])


@pytest.mark.skipif(
    importlib.util.find_spec("jax_cuda13_plugin") is None, reason="needs jax[cuda13]"
)
def test_fsdp_on_gpus_reduce_scatters_gradients(tmp_path):
    report, _ = compile_for(
        tmp_path, TINY, "gpu:h100x8", "--config.mesh_data=1", "--config.mesh_fsdp=-1"
    )
    kinds = set(program(report, "train_step")["collectives"])
    assert {"all-gather", "reduce-scatter"} <= kinds and "all-to-all" not in kinds, kinds

"""Accelerators we compile for without owning one: names, chip facts, abstract devices.

    target = parse_target("tpu:v5e-256")            # or tpu:v5p-128, tpu:v4-8, gpu:h100x8, ...
    devices = abstract_devices(target, slices=1)    # compile-only jax devices, no chip needed

TPU slices follow Cloud TPU's names: v5e-N and v6e-N count chips (one core
each); v4-N and v5p-N count TensorCores, two per chip, and JAX sees one device
per chip (megacore). A slice is a torus of chips: 2-D for v5e/v6e (16x16 at
256), 3-D for v4/v5p (4x4x4 at 64 chips), hosts of 4 chips (8 for the
single-host v5e-8/v6e-8). A shape can also be given directly:
`tpu:v5p:4x8x12`. libtpu compiles for any of them on a CPU machine.

GPUs: `gpu:h100` is one GPU, `gpu:h100x8` one host of 8, `gpu:h100x16` two
such hosts. XLA compiles for a GPU from a description of it (a text proto of
its GpuTargetConfig) through the CUDA plugin, which runs without a GPU. Ours are
in aot/gpu_targets/<name>.txtpb, written from the vendors' datasheets;
adding a GPU is adding a file there and a row to `GPUS` (docs/aot.md says how).

The numbers below are the vendors' datasheet figures per chip: HBM, dense
bf16 peak FLOP/s, HBM bandwidth, and the interconnect bandwidth the estimate
charges collectives to (ICI for TPUs, NVLink for GPUs; one direction).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax

from attention_jax.runtime.errors import UserError

GIB = 1024**3
GB = 1000**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet facts of one accelerator chip (one JAX device), and measured ceilings."""

    name: str  # e.g. 'TPU v5e', 'NVIDIA H100 SXM 80GB'
    hbm_bytes: int
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s one way, what a collective moves per chip
    # Measured ceilings, where this project has them (None: the datasheet's): an 8192^3
    # bf16 matmul on random data, and a device-to-device copy (read + written bytes).
    matmul_flops: float | None = None
    copy_bandwidth: float | None = None


# TPU generation -> (chip, dimensions of its torus, devices per name unit, libtpu name).
TPUS = {
    "v4": (Chip("TPU v4", 32 * GIB, 275e12, 1228e9, 270e9), 3, 2, "v4"),
    "v5e": (Chip("TPU v5e", 16 * GIB, 197e12, 819e9, 200e9), 2, 1, "v5e"),
    "v5p": (Chip("TPU v5p", 95 * GIB, 459e12, 2765e9, 600e9), 3, 2, "v5"),
    "v6e": (Chip("TPU v6e", 32 * GIB, 918e12, 1640e9, 448e9), 2, 1, "v6e"),
}
# GPU -> (chip, file in gpu_targets/). H100/H200 SXM: NVLink 4, 900 GB/s both ways. The
# measured ceilings (bf16 matmul FLOP/s, copy bandwidth) are from bench/ runs on one GPU each.
_H100 = Chip("NVIDIA H100 SXM 80GB", 80 * GB, 989e12, 3.35e12, 450e9, 798e12, 3.0e12)
_H200 = Chip("NVIDIA H200 SXM 141GB", 141 * GB, 989e12, 4.8e12, 450e9, 780e12, 4.3e12)
GPUS = {
    "h100": (_H100, "h100_sxm.txtpb"),
    "h200": (_H200, "h200_sxm.txtpb"),
    "a100": (Chip("NVIDIA A100 SXM 80GB", 80 * GB, 312e12, 2.039e12, 300e9), "a100_sxm_80.txtpb"),
}
GPUS_PER_HOST = 8
# XLA on GPU takes this fraction of memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
GPU_MEMORY_FRACTION = 0.75
SPECS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")

EXAMPLES = (
    "tpu:v5e-8, tpu:v5e-256, tpu:v4-8, tpu:v5p-128, tpu:v6e-64, tpu:v5p:4x8x12, "
    "gpu:h100, gpu:h100x8, gpu:h200x8, gpu:a100x8"
)


@dataclasses.dataclass(frozen=True)
class Target:
    """One slice or GPU box: what to compile for and what the chips can do."""

    name: str  # as given, e.g. 'tpu:v5e-256'
    platform: str  # 'tpu' or 'gpu'
    chip: Chip
    num_devices: int
    devices_per_host: int
    topology: str  # 'v5e:16x16' (TPU) or '1x2x8' (GPU: slices x hosts x per host)
    spec_file: str = ""  # GPU: the target config text proto

    @property
    def num_hosts(self) -> int:
        return max(1, self.num_devices // self.devices_per_host)

    @property
    def usable_bytes(self) -> int:
        """HBM a program may use: all of it on TPU, XLA's default 75% share on GPU."""
        if self.platform == "gpu":
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION))
            return int(self.chip.hbm_bytes * fraction)
        return self.chip.hbm_bytes


def torus_shape(chips: int, dims: int) -> tuple[int, ...]:
    """Cloud TPU's slice shape for `chips` (a power of two): 2-D 2x2, 2x4, 4x4, 4x8, ...;
    3-D 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ... (from 2x2, each step doubles the
    last of the smallest dimensions)."""
    shape = [2, 2] + [1] * (dims - 2) if chips >= 4 else [1] * dims
    while math.prod(shape) < chips:
        low = min(shape)
        last = max(i for i, s in enumerate(shape) if s == low)
        shape[last] *= 2
    return tuple(shape)


def _tpu_chip_counts(dims: int) -> list[int]:
    """Slice sizes in chips: 2-D 1, 4, 8, 16, ..., 256; 3-D 4, 8, ..., 4096 (powers of two)."""
    return [1, 4, 8, *(2**k for k in range(4, 9))] if dims == 2 else [2**k for k in range(2, 13)]


def _tpu_target(name: str, spec: str) -> Target:
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)(?:-(\d+)|:(\d+(?:x\d+){1,2}))", spec)
    if not m:
        raise UserError(f"unknown TPU target {name!r}; valid: {EXAMPLES}")
    generation, count, shape_text = m.groups()
    chip, dims, per_chip, libtpu_name = TPUS[generation]
    if shape_text:
        shape = tuple(int(x) for x in shape_text.split("x"))
        if len(shape) != dims:
            raise UserError(f"{name}: a {generation} slice shape has {dims} dimensions")
    else:
        n = int(count)
        if n % per_chip or n // per_chip not in _tpu_chip_counts(dims):
            valid = ", ".join(f"{generation}-{c * per_chip}" for c in _tpu_chip_counts(dims))
            raise UserError(
                f"{name} is not a {generation} slice; valid: {valid}, or a shape such as "
                f"tpu:{generation}:{'x'.join(['4'] * dims)}"
            )
        shape = torus_shape(n // per_chip, dims)
    chips = math.prod(shape)
    per_host = 8 if (dims == 2 and chips == 8) else min(4, chips)
    topology = f"{libtpu_name}:{'x'.join(map(str, shape))}"
    return Target(name, "tpu", chip, chips, per_host, topology)


def _gpu_target(name: str, spec: str) -> Target:
    m = re.fullmatch(r"([a-z]\d+)(?:x(\d+))?", spec)
    if not m or m.group(1) not in GPUS:
        raise UserError(
            f"unknown GPU target {name!r}; valid: gpu:{{{','.join(GPUS)}}}[xN], e.g. gpu:h100, "
            "gpu:h100x8 (one host), gpu:h100x16 (two hosts of 8)"
        )
    chip, spec_file = GPUS[m.group(1)]
    n = int(m.group(2) or 1)
    if n < 1 or (n > GPUS_PER_HOST and n % GPUS_PER_HOST):
        raise UserError(f"{name}: use 1..{GPUS_PER_HOST} GPUs or a multiple of 8 (hosts of 8)")
    per_host = min(n, GPUS_PER_HOST)
    topology = f"1x{n // per_host}x{per_host}"
    return Target(name, "gpu", chip, n, per_host, topology, os.path.join(SPECS_DIR, spec_file))


def parse_target(name: str) -> Target:
    """'tpu:v5e-256' / 'gpu:h100x8' -> Target (UserError listing valid names if unknown)."""
    platform, _, spec = name.strip().lower().partition(":")
    if platform == "tpu":
        return _tpu_target(name, spec)
    if platform == "gpu":
        return _gpu_target(name, spec)
    raise UserError(f"unknown target {name!r}: use tpu:... or gpu:..., e.g. {EXAMPLES}")


def check_compiler(target: Target) -> None:
    """UserError with the pip command if this Python lacks the target's compiler."""
    if target.platform == "tpu":
        ok, extra = importlib.util.find_spec("libtpu") is not None, "tpu"
    else:
        plugins = ("jax_cuda13_plugin", "jax_cuda12_plugin")
        ok, extra = any(importlib.util.find_spec(p) for p in plugins), "cuda13"
    if not ok:
        raise UserError(
            f"compiling for {target.name} needs the {target.platform.upper()} compiler, which "
            f'this Python lacks: pip install "jax[{extra}]=={jax.__version__}" (no chip needed; '
            "`make test-aot` builds .venv-aot with both compilers)"
        )


def prepare_environment(target: Target) -> None:
    """Environment for a compile-only run, set before JAX loads a backend: JAX itself runs
    on the CPU, and libtpu neither looks for a TPU nor prints warnings about not finding one."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])  # if jax read it already
    if target.platform == "tpu":
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # a second compile beside
        generation = target.topology.split(":")[0]  # Cloud TPU's accelerator type name
        kind, cores = {"v5e": ("v5litepod", 1), "v5": ("v5p", 2), "v4": ("v4", 2)}.get(
            generation, (generation, 1)
        )
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{kind}-{target.num_devices * cores}")


def abstract_devices(target: Target, slices: int = 1) -> list[jax.Device]:
    """Compile-only devices of `target` (times `slices` for multislice TPU)."""
    from jax.experimental import topologies

    check_compiler(target)
    try:
        if target.platform == "tpu":
            megacore = target.topology.startswith(("v4:", "v5:"))
            bounds = {1: (1, 1, 1), 8: (2, 4, 1)}.get(target.devices_per_host, (2, 2, 1))
            topo = topologies.get_topology_desc(
                platform="tpu",
                topology_name=target.topology,
                chip_config_name="megacore" if megacore else "default",
                chips_per_host_bounds=bounds,
                num_slices=slices,
            )
        else:
            with open(target.spec_file) as f:
                spec = f.read()
            topology = target.topology
            if slices > 1:
                topology = f"{slices}x" + topology.split("x", 1)[1]
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=spec, topology=topology
            )
    except Exception as e:  # libtpu / the CUDA plugin reject a topology with their own errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot make the devices of {target.name}: {first[:300]}") from e
    return list(topo.devices)

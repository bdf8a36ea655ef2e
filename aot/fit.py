"""train.py --compile_for=TARGET: compile the real steps for a TPU slice or GPU box here.

    report = compile_for(config, "tpu:v5e-256")   # no chip, no data, no workdir
    print(json.dumps(report)); print(table(report), file=sys.stderr)
    best = find_batch(config, "gpu:h100")         # the largest batch_tokens that fits

What is compiled is what train.py would run on the target: `training.steps`'
train and eval steps with the config's mesh, shardings, dtype, remat and
gradient accumulation, and the attention implementation the target resolves
('cudnn' on GPUs in bf16/fp16, whose start-up probe runs there), at the batch
shapes the input pipeline makes (`batch_shapes`); plus decode.py's beam search
for its default batch on one chip. For each program the report gives, per
chip: parameter + optimizer, batch, temporary and total bytes against the
chip's HBM (`fits`, headroom), FLOPs and bytes accessed (XLA's cost analysis),
collectives by kind with their sizes (aot/hlo.py), matmul element types,
compile time, and a step-time *estimate*: on GPUs a roofline per kernel, summed
(aot/roofline.py), on TPUs max(FLOPs / peak, bytes / HBM bandwidth); plus
the collectives' ring traffic over the chip's interconnect, not overlapped.
Chip facts: aot/hardware.py.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from attention_jax.aot import hlo
from attention_jax.aot.hardware import Target, abstract_devices, parse_target
from attention_jax.aot.roofline import kernel_roofline
from attention_jax.data import length_buckets, rows_per_batch
from attention_jax.runtime.errors import UserError
from attention_jax.search.decoding import tracing_for, translate_beams
from attention_jax.search.settings import default_batch_tokens
from attention_jax.training import config as config_lib
from attention_jax.training import steps
from attention_jax.training.input import shard_multiple
from attention_jax.training.mesh import AXES, batch_divisor, batch_sharding, make_mesh, mesh_shape
from attention_jax.training.metrics import train_flops

PACKING_KEYS = steps.PACKING_KEYS


# --- Devices, mesh and shapes ----------------------------------------------------------


def _mesh(config: Any, devices: list, slices: int) -> Mesh:
    """The config's mesh over the target's devices; with several slices, `data` spans them
    (data-parallel across the slower data-center network, everything else within a slice)."""
    if slices == 1:
        return make_mesh(config, devices)
    from jax.experimental import mesh_utils

    sizes = (config.mesh_data, config.mesh_fsdp, config.mesh_tensor)
    shape = mesh_shape(sizes, len(devices))
    if shape[0] % slices:
        raise UserError(
            f"{slices} slices need mesh_data divisible by {slices} (data parallelism spans "
            f"the slices); the mesh is {dict(zip(AXES, shape, strict=True))}"
        )
    ici = (shape[0] // slices, *shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (slices, 1, 1), devices=devices)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def batch_shapes(
    config: Any, mesh: Mesh, num_processes: int, all_buckets: bool
) -> tuple[list[tuple[int, int]], int]:
    """([(global rows, width)] to compile, how many other widths the run will have).

    As training.input.ShardedInput makes them: each of config.data_shards (one per
    process) shards plans rows for batch_tokens / shards, a multiple of the batch
    axes times grad_accum_steps. Packed rows are max_length wide. Bucketed widths
    are fitted to the corpus at start (at most num_length_buckets), which is not
    here: the widest, max_length, holds the most memory and is compiled; with
    `all_buckets`, the default rule's widths (or config.length_buckets) all are.
    """
    shards = config.data_shards or num_processes
    wanted = batch_divisor(mesh) * config.grad_accum_steps
    multiple = shard_multiple(wanted, shards)
    budget = config.batch_tokens // shards
    max_length = int(config.max_length)
    if config.packing:
        widths, others = [max_length], 0
    else:
        rule = length_buckets(max_length, tuple(config.length_buckets)).tolist()
        count = len(rule) if config.length_buckets else int(config.num_length_buckets)
        widths = rule if all_buckets else [max_length]
        others = max(0, count - len(widths))
    shapes = [(rows_per_batch(budget, w, multiple) * shards, w) for w in sorted(widths)[::-1]]
    return shapes, others


def eval_rows(config: Any, mesh: Mesh, num_processes: int, width: int) -> int:
    """Global rows of a dev-loss batch `width` wide, as training.input.process_eval_batches plans:
    each process a share of batch_tokens, the global rows a multiple of the batch axes."""
    multiple = shard_multiple(batch_divisor(mesh), num_processes)
    return rows_per_batch(config.batch_tokens // num_processes, width, multiple) * num_processes


def abstract_batch(config: Any, mesh: Mesh, rows: int, width: int) -> dict[str, Any]:
    """ShapeDtypeStructs of one global batch, rows sharded over the batch axes."""
    keys = ["src", "tgt_in", "tgt_out", *(PACKING_KEYS if config.packing else ())]
    sharding = batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=sharding) for k in keys}


def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its largest share)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            itemsize = 8  # a threefry key: two uint32 words
        else:
            itemsize = jnp.dtype(x.dtype).itemsize
        total += math.prod(shard) * itemsize
    return total


# --- One compiled program ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    """A config set up on a target's compile-only devices."""

    config: Any
    target: Target
    devices: list
    processes: int
    mesh: Mesh
    setup: steps.TrainSetup
    dump_dir: str | None = None  # write each program's optimized HLO here


def _setup(config: Any, target: Target, slices: int, dump_dir: str | None = None) -> Context:
    """`config` on the target (UserError if it cannot run there: mesh, batch, shards;
    checked before the target's compiler is needed)."""
    if slices < 1 or (slices > 1 and target.platform != "tpu"):
        raise UserError("--compile_for_slices must be >= 1, and > 1 only for TPU slices")
    num_devices, hosts = target.num_devices * slices, target.num_hosts * slices
    config_lib.validate(config, num_devices=num_devices, num_processes=hosts)
    devices = abstract_devices(target, slices)
    processes = len({d.process_index for d in devices})
    mesh = _mesh(config, devices, slices)
    setup = steps.train_setup(config, mesh, platform=target.platform)
    return Context(config, target, devices, processes, mesh, setup, dump_dir)


@dataclasses.dataclass
class Program:
    name: str
    shape: tuple[int, int]  # (rows, width) of the batch
    lowered: Any
    compiled: Any
    compile_seconds: float


def _say(msg: str) -> None:
    print(f"compile_for: {msg}", file=sys.stderr, flush=True)


def _compile(ctx: Context, name: str, fn: Any, args: tuple, shape: tuple[int, int]) -> Program:
    """Lower and compile fn(*args) (UserError if the target's compiler refuses)."""
    _say(f"{name} {shape[0]}x{shape[1]} ...")
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    try:
        compiled = lowered.compile()
    except Exception as e:  # e.g. an allocation the compiler already knows cannot succeed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the {name} at {shape} does not compile: {first[:400]}") from e
    if ctx.dump_dir:
        os.makedirs(ctx.dump_dir, exist_ok=True)
        path = os.path.join(ctx.dump_dir, f"{name}_{shape[0]}x{shape[1]}.hlo.txt")
        with open(path, "w") as f:
            f.write(compiled.as_text())
    return Program(name, shape, lowered, compiled, time.perf_counter() - t0)


def _xla_cost(program: Program) -> dict[str, float] | None:
    """XLA's {flops, bytes_accessed} per device of the compiled (partitioned) program.

    TPU compilers report it. GPU compile-only executables report none, so XLA's
    generic HLO cost analysis is run on their optimized module (a private JAX
    entry point: None if this JAX lacks it); it does not see into cuBLAS and
    cuDNN calls, so on GPUs the estimate takes its FLOPs from the model.
    """
    cost = program.compiled.cost_analysis()
    if not cost:
        try:
            from jax._src import xla_bridge
            from jax._src.lib import _jax

            module = program.compiled.runtime_executable().hlo_modules()[0]
            cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
        except Exception:  # a JAX without it
            return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if not cost or "flops" not in cost:
        return None
    return {"flops": float(cost["flops"]), "bytes_accessed": float(cost.get("bytes accessed", 0))}


def _memory(program: Program, state_bytes: int, batch_bytes: int) -> dict[str, int]:
    """Per-device bytes: what XLA allocates for arguments, outputs and temporaries."""
    m = program.compiled.memory_analysis()
    outputs = m.output_size_in_bytes - m.alias_size_in_bytes  # donated state is reused
    return {
        "state": state_bytes,  # params + optimizer state + RNG, this device's shards
        "batch": batch_bytes,
        "arguments": m.argument_size_in_bytes,
        "outputs_not_aliased": outputs,
        "temporaries": m.temp_size_in_bytes,
        "code": m.generated_code_size_in_bytes,  # TPU programs live in HBM too
        "total": m.argument_size_in_bytes + outputs + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes,
    }  # fmt: skip


def analyse(
    ctx: Context,
    program: Program,
    *,
    state_bytes: int,
    batch_bytes: int,
    model_flops: float | None,
    num_devices: int,
) -> dict[str, Any]:
    """The report of one compiled program (see the module docstring).

    model_flops: the model's FLOPs per device for this program (None: unknown).
    """
    text = program.compiled.as_text()
    memory = _memory(program, state_bytes, batch_bytes)
    usable = ctx.target.usable_bytes
    comms = hlo.collectives(text, num_devices)
    cost = _xla_cost(program)
    use_xla = cost is not None and (ctx.target.platform == "tpu" or model_flops is None)
    flops = cost["flops"] if use_xla else model_flops
    chip = ctx.target.chip
    report = {
        "program": program.name,
        "shape": list(program.shape),
        "bytes": memory,
        "fits": memory["total"] <= usable,
        "headroom_bytes": usable - memory["total"],
        "flops": flops,
        "flops_source": "xla" if use_xla else "model",
        "model_flops": model_flops,
        "xla_flops": cost["flops"] if cost else None,
        "bytes_accessed": cost["bytes_accessed"] if cost else None,
        "collectives": comms,
        "matmul_dtypes": hlo.matmul_dtypes(text),
        "cudnn_calls": hlo.custom_calls(text, "__cudnn"),
        "compile_seconds": round(program.compile_seconds, 2),
        "estimate": None,
    }
    if flops is not None and program.name != "beam_search":  # not a loop: estimable
        compute_s = flops / chip.peak_flops
        hbm_s = cost["bytes_accessed"] / chip.hbm_bandwidth if cost else 0.0
        comm_s = sum(c["wire_bytes"] for c in comms.values()) / chip.link_bandwidth
        step_s = max(compute_s, hbm_s) + comm_s
        kernels = None
        if ctx.target.platform == "gpu":  # kernels run one after another: sum their rooflines
            rate = chip.matmul_flops or chip.peak_flops
            kernels = kernel_roofline(text, rate, chip.copy_bandwidth or chip.hbm_bandwidth)
            step_s = kernels["seconds"] + comm_s
        report["estimate"] = {
            "compute_s": compute_s,
            "hbm_s": hbm_s,
            "collectives_s": comm_s,
            "kernels": kernels,
            "step_s": step_s,
            "padded_target_tokens_per_s": program.shape[0] * program.shape[1] / step_s,
        }
    return report


# --- The programs -----------------------------------------------------------------------


def _train_and_eval(ctx: Context, all_buckets: bool) -> tuple[list[dict[str, Any]], int]:
    """Reports of the train step at each shape to compile and of the eval step at the widest."""
    config, mesh, setup, n = ctx.config, ctx.mesh, ctx.setup, len(ctx.devices)
    shapes, others = batch_shapes(config, mesh, ctx.processes, all_buckets)
    state_bytes = per_device_bytes(setup.abstract)
    train_step, eval_step = steps.make_train_step(setup), steps.make_eval_step(setup)
    reports = []
    for rows, width in shapes:
        batch = abstract_batch(config, mesh, rows, width)
        program = _compile(ctx, "train_step", train_step, (setup.abstract, batch), (rows, width))
        tokens = rows * width
        flops = train_flops(setup.model_config, tokens, tokens, width, width) / n
        reports.append(
            analyse(
                ctx, program, state_bytes=state_bytes, batch_bytes=per_device_bytes(batch),
                model_flops=flops, num_devices=n,
            )
        )  # fmt: skip
    # Evaluation batches: the default rule's widths, rows for batch_tokens per process.
    width = shapes[0][1]
    rows = eval_rows(config, mesh, ctx.processes, width)
    batch = abstract_batch(config, mesh, rows, width)
    args = (setup.abstract.params, setup.abstract.rngs, batch)
    program = _compile(ctx, "eval_step", eval_step, args, (rows, width))
    flops = train_flops(setup.model_config, rows * width, rows * width, width, width) / 3 / n
    reports.append(
        analyse(
            ctx, program, state_bytes=per_device_bytes(args[:2]),
            batch_bytes=per_device_bytes(batch), model_flops=flops, num_devices=n,
        )
    )  # fmt: skip
    return reports, others


def _decode(ctx: Context) -> dict[str, Any]:
    """decode.py's beam search (its default beam and alpha) for its default batch on the
    target's platform, on one chip."""
    width = int(ctx.config.max_length)
    tokens = default_batch_tokens(ctx.target.platform)
    rows = 1 << (max(tokens // width, 1).bit_length() - 1)  # as decode.py plans
    one = jax.sharding.SingleDeviceSharding(ctx.devices[0])
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
    params = jax.tree.map(place, ctx.setup.abstract.params)
    rngs = jax.tree.map(place, ctx.setup.abstract.rngs)
    src = jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=one)
    graphdef = ctx.setup.graphdef

    def search(params, rngs, src):
        model = nnx.merge(graphdef, params, rngs)
        return translate_beams(model, src)  # the search's defaults: beam 4, alpha 0.6

    with tracing_for(ctx.target.platform):  # the steps the target's decode.py takes
        program = _compile(ctx, "beam_search", jax.jit(search), (params, rngs, src), (rows, width))
    return analyse(
        ctx, program, state_bytes=per_device_bytes((params, rngs)),
        batch_bytes=per_device_bytes(src), model_flops=None, num_devices=1,
    )  # fmt: skip


def _compiler_version(target: Target) -> str:
    names = ("libtpu",) if target.platform == "tpu" else ("jax-cuda13-plugin", "jax-cuda12-plugin")
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def compile_for(
    config: Any,
    target_name: str,
    *,
    slices: int = 1,
    all_buckets: bool = False,
    label: str = "",
    dump_dir: str | None = None,
) -> dict[str, Any]:
    """Compile the train, eval and decode steps of `config` for `target_name`; the report.

    Raises UserError for an unknown target, a missing compiler, or a config
    that cannot run there (the message says what is valid).
    """
    t0 = time.perf_counter()
    target = parse_target(target_name)
    ctx = _setup(config, target, slices, dump_dir)
    programs, others = _train_and_eval(ctx, all_buckets)
    programs.append(_decode(ctx))
    model_cfg = ctx.setup.model_config
    report = {
        "target": target.name,
        "platform": target.platform,
        "chip": target.chip.name,
        "devices": len(ctx.devices),
        "hosts": ctx.processes,
        "slices": slices,
        "hbm_bytes_per_chip": target.chip.hbm_bytes,
        "usable_bytes_per_chip": target.usable_bytes,
        "config": label,
        "mesh": {k: int(v) for k, v in ctx.mesh.shape.items()},
        "params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(ctx.setup.abstract.params))),
        "dtype": model_cfg.dtype.name,
        "attention_impl": model_cfg.attention_impl,
        "batch_tokens": int(config.batch_tokens),
        "grad_accum_steps": int(config.grad_accum_steps),
        "remat": bool(model_cfg.remat),
        "jax": jax.__version__,
        "compiler": _compiler_version(target),
        "programs": programs,
        "other_train_widths": others,
        "fits": all(p["fits"] for p in programs),
    }
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def find_batch(config: Any, target_name: str, *, slices: int = 1, cap: int = 64) -> dict[str, Any]:
    """The largest batch_tokens whose widest train step fits the target, by compiling.

    Batches grow in steps of one row per data shard and batch-axis device
    (times grad_accum_steps): an exponential search from the config's batch
    (at most `cap` times it), then bisection, each probe one compile of the
    train step at max_length. Returns {batch_tokens, rows, width, probes:
    [{rows, total_bytes, fits}]} (batch_tokens 0 if not even one step fits).
    """
    ctx = _setup(config, parse_target(target_name), slices)
    shards = config.data_shards or ctx.processes
    wanted = batch_divisor(ctx.mesh) * config.grad_accum_steps
    unit = shard_multiple(wanted, shards) * shards  # global rows per step of the search
    width = int(config.max_length)
    train_step = steps.make_train_step(ctx.setup)
    probes: list[dict[str, Any]] = []

    def fits(k: int) -> bool:
        rows = k * unit
        batch = abstract_batch(config, ctx.mesh, rows, width)
        args = (ctx.setup.abstract, batch)
        total = _memory(_compile(ctx, "train_step", train_step, args, (rows, width)), 0, 0)
        ok = total["total"] <= ctx.target.usable_bytes
        probes.append({"rows": rows, "total_bytes": total["total"], "fits": ok})
        return ok

    k = max(1, batch_shapes(config, ctx.mesh, ctx.processes, False)[0][0][0] // unit)
    good, bad = (k, None) if fits(k) else (0, k)
    while bad is None and 2 * good <= cap * k:  # it fits: double until it does not
        if fits(2 * good):
            good *= 2
        else:
            bad = 2 * good
    while good == 0 and bad > 1:  # it does not fit: halve until it does
        if fits(bad // 2):
            good = bad // 2
        else:
            bad //= 2
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    rows = good * unit
    return {"batch_tokens": rows * width, "rows": rows, "width": width, "probes": probes}

"""Where a train step's time goes: nested pieces timed separately, plus an optional trace;
with --host, the host's share (the batch's copy and the step's call).

    python bench/profile.py --config=tiny [--batch_tokens=2048] [--length=32] [--trace_dir=DIR]
    python bench/profile.py --host --config=base [--batch_tokens=8192] [--length=256] [--iters=20]

Times, on one fixed batch shape: the encoder forward; the whole forward with
the loss; the output projection + loss alone (forward and backward); forward
+ backward; and the full train step (+ optimizer update). The loss is the
train step's (`training/loss.py`, in chunks of `loss_chunk_tokens`), so
differences between nested pieces give each part's share. --step_only times
the train step alone (a quick A/B). XLA's own FLOP count of the compiled step
is printed beside `training.metrics.train_flops` (on a GPU it leaves out the
cuBLAS and cuDNN calls, so it is far lower). With --trace_dir, one step is
also recorded with `jax.profiler.trace` and summarized by `tools/trace_summary.py`
(kernel time by kind; on a CPU, by XLA operation; open the trace itself in
TensorBoard's profile plugin or Perfetto). Prints JSON objects and tables.

--host times the host's work per train step, outside the device's: copying the batch
to the device, and calling the compiled step until it returns (dispatch). Each call
waits for the step before the next one, so the device is idle while the host works and
the two are measured apart. The step is called three ways: on the `TrainState` pytree
(`steps.make_train_step`), on its leaves in a list, and on the state packed into a few
buffers (`steps.make_buffered_steps`, what train.py's loop calls; training/state_buffers.py).
When the host's time per step (this, plus the input pipeline's next batch) exceeds the
device's, the device waits: small batches on a GPU. The call's time does not grow with
the batch: on a CPU, where a base step of 8,192 tokens computes for ~30 s, use
`--batch_tokens=256 --length=32`. Its defaults are --config=base --batch_tokens=8192
--length=256. Prints one JSON object ("benchmark": "host_step", the name of the script
it was), then a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness

# Defaults of the two modes: the pieces of a tiny step; the host's time at base's shape.
DEFAULTS = {
    False: {"config": "tiny", "batch_tokens": 0, "length": 32},
    True: {"config": "base", "batch_tokens": 8192, "length": 256},
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", action="store_true", help="the host's time per step instead")
    p.add_argument("--config", default=None, help="tiny (--host: base)")
    p.add_argument("--batch_tokens", type=int, default=None, help="0 = the config's (--host: 8192)")
    p.add_argument(
        "--length", type=int, default=None, help="both sides' padded length: 32 (--host: 256)"
    )
    p.add_argument("--dtype", default="", help="'' = bfloat16 on accelerators, float32 on CPU")
    p.add_argument("--trace_dir", default="")
    p.add_argument("--step_only", action="store_true", help="time the train step alone")
    p.add_argument("--iters", type=int, default=20, help="--host: calls timed")
    args = p.parse_args(argv)
    if args.host and (args.trace_dir or args.step_only):
        p.error("--trace_dir and --step_only time the pieces, not --host")
    for flag, value in DEFAULTS[args.host].items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    harness.set_gpu_flags()
    (host if args.host else pieces)(args)


def pieces(args: argparse.Namespace) -> None:
    """Times the nested pieces of a train step and the step; prints the "profile" report."""
    import jax
    from flax import nnx

    from attention_jax.training import config as config_lib
    from attention_jax.training import metrics, steps
    from attention_jax.training.loss import chunked_loss_sums

    config = importlib.import_module(f"attention_jax.configs.{args.config}").get_config()
    config.batch_tokens = args.batch_tokens or config.batch_tokens
    config.model.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    config.mesh_data, config.mesh_fsdp, config.mesh_tensor = -1, 1, 1
    cfg = config_lib.model_config(config)
    mesh, setup, state, train_step = harness.build_train_step(config)

    b, batch = _random_batch(mesh, cfg.vocab_size, config.batch_tokens, args.length)
    model = nnx.merge(setup.graphdef, state.params, state.rngs)

    def head_loss(model, y, batch):  # the train step's loss (training.steps._forward_sums)
        tgt, eps = batch["tgt_out"], config.label_smoothing
        if chunk:  # in chunks, the gradient computed in the same pass
            return chunked_loss_sums(y, model.output_matrix(), tgt, eps, chunk_tokens=chunk)["loss"]
        return steps.loss_sums(model.project(y), tgt, eps)["loss"]

    def loss(model, batch):
        y = model.hidden(batch["src"], batch["tgt_in"], deterministic=False)
        return head_loss(model, y, batch)

    chunk = int(config.loss_chunk_tokens)
    y = jax.random.normal(jax.random.key(0), (b, args.length, cfg.d_model), cfg.dtype)
    pieces = {
        "encoder_fwd": nnx.jit(lambda m, bt: m.encode(bt["src"])),
        "fwd_loss": nnx.jit(loss),
        "head_loss_fwd_bwd": nnx.jit(nnx.value_and_grad(head_loss)),
        "fwd_bwd": nnx.jit(nnx.value_and_grad(loss)),
    }
    times = {}
    for name, fn in ({} if args.step_only else pieces).items():
        args_ = (model, y, batch) if name.startswith("head") else (model, batch)
        times[name] = harness.time_fn(lambda fn=fn, a=args_: fn(*a), warmup=2, iters=5)

    box = {"state": state}

    def full_step():
        box["state"], m = train_step(box["state"], batch)
        return m

    times["train_step"] = harness.time_fn(full_step, warmup=2, iters=5)
    if args.trace_dir:
        with jax.profiler.trace(args.trace_dir):
            harness.block(full_step())

    xla_flops = _xla_flops(train_step, box["state"], batch)
    model_flops = metrics.train_flops(
        cfg, b * args.length, b * args.length, args.length, args.length
    )
    step = times["train_step"]
    rows = [{"piece": name, "ms": 1e3 * t, "share_of_step": t / step} for name, t in times.items()]
    if not args.step_only:
        rows += _differences(times)
    meta = {
        "device": harness.device_info(),
        "config": args.config,
        "batch": [b, args.length],
        "dtype": config.model.dtype,
        "loss_chunk_tokens": config.loss_chunk_tokens,
        "model_flops_per_step": model_flops,
        "xla_flops_per_step": xla_flops,
        "model_tflops_per_s": model_flops / step / 1e12,
    }
    harness.report("profile", meta, rows, ["piece", "ms", "share_of_step"])
    if args.trace_dir:
        from tools import trace_summary

        trace_summary.main([args.trace_dir, "--top=15"])


def _random_batch(mesh, vocab_size: int, batch_tokens: int, length: int) -> tuple[int, dict]:
    """A train batch of random ids, [B, length] each, sharded over `mesh` (B rows: as many
    as `batch_tokens` holds, a multiple of the mesh's batch divisor); returns (B, batch)."""
    import numpy as np

    from attention_jax import BOS_ID
    from attention_jax.training import mesh as mesh_lib

    divisor = mesh_lib.batch_divisor(mesh)
    rows = batch_tokens // length
    b = max(divisor, rows - rows % divisor)
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(4, vocab_size, (b, length), dtype=np.int32)
    host = {"src": ids(), "tgt_in": ids(), "tgt_out": ids()}
    host["tgt_in"][:, 0] = BOS_ID
    return b, mesh_lib.shard_batch(host, mesh)


def _xla_flops(train_step, state, batch) -> float | None:
    """The compiled step's FLOPs as XLA counts them (None where it does not say)."""
    cost = train_step.lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)) if cost else None


def _differences(times: dict[str, float]) -> list[dict[str, float | str]]:
    """The backward pass and the optimizer update, as differences of nested pieces."""
    step = times["train_step"]
    rows = []
    rows.append(
        {
            "piece": "backward (fwd_bwd - fwd_loss)",
            "ms": 1e3 * (times["fwd_bwd"] - times["fwd_loss"]),
            "share_of_step": (times["fwd_bwd"] - times["fwd_loss"]) / step,
        }
    )
    rows.append(
        {
            "piece": "optimizer (train_step - fwd_bwd)",
            "ms": 1e3 * (step - times["fwd_bwd"]),
            "share_of_step": (step - times["fwd_bwd"]) / step,
        }
    )
    return rows


def _host_ms(call, block, iters: int) -> float:
    """Mean ms from calling `call()` to its return, the device idle at each call."""
    block(call())  # compiled
    total = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        out = call()
        total += time.perf_counter() - t0
        block(out)
    return 1e3 * total / iters


def host(args: argparse.Namespace) -> None:
    """Times the batch's copy and the step's call three ways; prints the "host_step" report."""
    import jax
    import numpy as np

    from attention_jax.training import mesh as mesh_lib
    from attention_jax.training import steps
    from attention_jax.training.state_buffers import BufferLayout

    config = importlib.import_module(f"attention_jax.configs.{args.config}").get_config()
    config.batch_tokens = args.batch_tokens or config.batch_tokens
    if args.dtype or jax.default_backend() == "cpu":
        config.model.dtype = args.dtype or "float32"
    mesh, setup, state, tree_step = harness.build_train_step(config)
    per, div = config.batch_tokens // args.length, mesh_lib.batch_divisor(mesh)
    rows = max(div, per - per % div)
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(4, 1000, (rows, args.length), dtype=np.int32)
    on_host = {"src": ids(), "tgt_in": ids(), "tgt_out": ids()}
    batch = mesh_lib.shard_batch(on_host, mesh)

    box = {"state": state}

    def on_tree():
        box["state"], m = tree_step(box["state"], batch)
        return m

    calls = {}
    for name, pack in (("leaves", False), ("packed", True)):
        start = steps.init_train_state(setup)
        leaves, treedef = jax.tree.flatten(start)
        layout = BufferLayout.of(leaves, pack=pack)
        packed = steps.make_buffered_steps(setup, treedef, layout)
        box[name] = packed.pack(start)
        del start, leaves
        step_fn = packed.step

        def call(name=name, step_fn=step_fn):
            box[name], m = step_fn(box[name], batch)
            return m

        calls[name] = call, layout.num_buffers

    copy = lambda: mesh_lib.shard_batch(on_host, mesh)
    rows_out = [
        {"part": "batch to device (shard_batch)", "ms": _host_ms(copy, harness.block, args.iters)},
        {"part": "step call, TrainState", "ms": _host_ms(on_tree, harness.block, args.iters)},
    ]
    for name, (call, buffers) in calls.items():
        part = f"step call, {name} ({buffers} arrays)"
        rows_out.append({"part": part, "ms": _host_ms(call, harness.block, args.iters)})
    meta = {
        "device": harness.device_info(),
        "config": args.config,
        "batch": [rows, args.length],
        "state_arrays": len(jax.tree.leaves(state)),
        "iters": args.iters,
    }
    harness.report("host_step", meta, rows_out, ["part", "ms"])


if __name__ == "__main__":
    main()

"""Where a train step's time goes: nested pieces timed separately, plus an optional trace.

    python bench/profile.py --config=tiny [--batch_tokens=2048] [--length=32] [--trace_dir=DIR]

Times, on one fixed batch shape: the encoder forward; the whole forward with
the loss; the output projection + loss alone (forward and backward); forward
+ backward; and the full train step (+ optimizer update). The loss is the
train step's (`training/loss.py`, in chunks of `loss_chunk_tokens`), so
differences between nested pieces give each part's share. --step_only times
the train step alone (a quick A/B). XLA's own FLOP count of the compiled step
is printed beside `training.metrics.train_flops` (on a GPU it leaves out the
cuBLAS and cuDNN calls, so it is far lower). With --trace_dir, one step is
also recorded with `jax.profiler.trace` and, on a GPU or TPU, summarized by
`tools/trace_summary.py` (kernel time by kind; open the trace itself in
TensorBoard's profile plugin or Perfetto). Prints JSON objects and tables.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch_tokens", type=int, default=0, help="0 = the config's")
    p.add_argument("--length", type=int, default=32, help="padded length of both sides")
    p.add_argument("--dtype", default="", help="'' = bfloat16 on accelerators, float32 on CPU")
    p.add_argument("--trace_dir", default="")
    p.add_argument("--step_only", action="store_true", help="time the train step alone")
    args = p.parse_args(argv)
    common.set_gpu_flags()

    import jax
    import numpy as np
    from flax import nnx

    from training import config as config_lib
    from training import mesh as mesh_lib
    from training import metrics, steps
    from training.loss import chunked_loss_sums

    config = importlib.import_module(f"configs.{args.config}").get_config()
    config.batch_tokens = args.batch_tokens or config.batch_tokens
    config.model.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    config.mesh_data, config.mesh_fsdp, config.mesh_tensor = -1, 1, 1
    cfg = config_lib.model_config(config)
    mesh, setup, state, train_step = common.build_train_step(config)

    rows_per = config.batch_tokens // args.length
    b = max(mesh_lib.batch_divisor(mesh), rows_per - rows_per % mesh_lib.batch_divisor(mesh))
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(4, cfg.vocab_size, (b, args.length), dtype=np.int32)
    host = {"src": ids(), "tgt_in": ids(), "tgt_out": ids()}
    host["tgt_in"][:, 0] = 2
    batch = mesh_lib.shard_batch(host, mesh)
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
    y = jax.random.normal(jax.random.key(0), (b, args.length, cfg.d_model), cfg.compute_dtype)
    pieces = {
        "encoder_fwd": nnx.jit(lambda m, bt: m.encode(bt["src"])),
        "fwd_loss": nnx.jit(loss),
        "head_loss_fwd_bwd": nnx.jit(nnx.value_and_grad(head_loss)),
        "fwd_bwd": nnx.jit(nnx.value_and_grad(loss)),
    }
    times = {}
    for name, fn in ({} if args.step_only else pieces).items():
        args_ = (model, y, batch) if name.startswith("head") else (model, batch)
        times[name] = common.time_fn(lambda fn=fn, a=args_: fn(*a), warmup=2, iters=5)

    box = {"state": state}

    def full_step():
        box["state"], m = train_step(box["state"], batch)
        return m

    times["train_step"] = common.time_fn(full_step, warmup=2, iters=5)
    if args.trace_dir:
        with jax.profiler.trace(args.trace_dir):
            common.block(full_step())

    compiled = train_step.lower(box["state"], batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float(cost.get("flops", 0.0)) if cost else None
    model_flops = metrics.train_flops(
        cfg, b * args.length, b * args.length, args.length, args.length
    )
    step = times["train_step"]
    rows = [{"piece": name, "ms": 1e3 * t, "share_of_step": t / step} for name, t in times.items()]
    if not args.step_only:
        rows += _differences(times)
    meta = {
        "device": common.device_info(),
        "config": args.config,
        "batch": [b, args.length],
        "dtype": config.model.dtype,
        "loss_chunk_tokens": config.loss_chunk_tokens,
        "model_flops_per_step": model_flops,
        "xla_flops_per_step": xla_flops,
        "model_tflops_per_s": model_flops / step / 1e12,
    }
    common.report("profile", meta, rows, ["piece", "ms", "share_of_step"])
    if args.trace_dir and jax.default_backend() != "cpu":
        from tools import trace_summary

        trace_summary.main([args.trace_dir, "--top=15"])


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


if __name__ == "__main__":
    main()

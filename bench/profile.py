"""Where a train step's time goes: nested pieces timed separately, plus an optional trace.

    python bench/profile.py --config=tiny [--batch_tokens=2048] [--length=32] [--trace_dir=DIR]

Times, on one fixed batch shape: the encoder forward; the whole forward with
the loss; the output projection + loss alone (forward and backward); forward
+ backward; and the full train step (+ optimizer update). Differences between
nested pieces give each part's share. XLA's own FLOP count of the compiled step
is printed beside `training.metrics.train_flops`. With --trace_dir, one step
is also recorded with `jax.profiler.trace` (open it in TensorBoard's profile
plugin or Perfetto). Prints one JSON object, then a table.
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
    args = p.parse_args(argv)
    common.set_gpu_flags()

    import jax
    import numpy as np
    from flax import nnx

    from training import config as config_lib
    from training import mesh as mesh_lib
    from training import metrics, steps

    config = importlib.import_module(f"configs.{args.config}").get_config()
    config.batch_tokens = args.batch_tokens or config.batch_tokens
    config.model.dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    config.mesh_data, config.mesh_fsdp, config.mesh_tensor = -1, 1, 1
    cfg = config_lib.model_config(config)
    mesh, graphdef, state, train_step = common.build_train_step(config)

    rows_per = config.batch_tokens // args.length
    b = max(mesh_lib.batch_divisor(mesh), rows_per - rows_per % mesh_lib.batch_divisor(mesh))
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(4, cfg.vocab_size, (b, args.length), dtype=np.int32)
    host = {"src": ids(), "tgt_in": ids(), "tgt_out": ids()}
    host["tgt_in"][:, 0] = 2
    batch = mesh_lib.shard_batch(host, mesh)
    model = nnx.merge(graphdef, state.params, state.rngs)

    def loss(model, batch):
        logits = model(batch["src"], batch["tgt_in"], deterministic=False)
        return steps.loss_sums(logits, batch["tgt_out"], config.label_smoothing)["loss"]

    def head_loss(model, y, batch):
        return steps.loss_sums(model.tgt_embed.attend(y), batch["tgt_out"], 0.1)["loss"]

    y = jax.random.normal(jax.random.key(0), (b, args.length, cfg.d_model), cfg.compute_dtype)
    pieces = {
        "encoder_fwd": nnx.jit(lambda m, bt: m.encode(bt["src"])),
        "fwd_loss": nnx.jit(loss),
        "head_loss_fwd_bwd": nnx.jit(nnx.value_and_grad(head_loss)),
        "fwd_bwd": nnx.jit(nnx.value_and_grad(loss)),
    }
    times = {}
    for name, fn in pieces.items():
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
    meta = {
        "device": common.device_info(),
        "config": args.config,
        "batch": [b, args.length],
        "dtype": config.model.dtype,
        "model_flops_per_step": model_flops,
        "xla_flops_per_step": xla_flops,
        "model_tflops_per_s": model_flops / step / 1e12,
    }
    common.report("profile", meta, rows, ["piece", "ms", "share_of_step"])


if __name__ == "__main__":
    main()

"""The host's time per train step, outside the device's work: copying the batch to the
device, and calling the compiled step until it returns (dispatch).

    python bench/host_step.py --config=base [--batch_tokens=8192] [--length=256] [--iters=20]

Each call waits for the step before the next one, so the device is idle while the
host works and the two are measured apart. The step is called three ways: on the
`TrainState` pytree (`steps.make_train_step`), on its leaves in a list, and on
the state packed into a few buffers (`steps.make_packed_train_step`, what
train.py's loop calls; training/packed.py). When the host's time per
step (this, plus the input pipeline's next batch) exceeds the device's, the device
waits: small batches on a GPU. The call's time does not grow with the batch: on a
CPU, where a base step of 8,192 tokens computes for ~30 s, use
`--batch_tokens=256 --length=32`. Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="base")
    p.add_argument("--batch_tokens", type=int, default=8192)
    p.add_argument("--length", type=int, default=256, help="padded length of both sides")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    common.set_gpu_flags()

    import jax
    import numpy as np

    from training import mesh as mesh_lib
    from training import steps
    from training.packed import Packing

    config = importlib.import_module(f"configs.{args.config}").get_config()
    config.batch_tokens = args.batch_tokens
    if jax.default_backend() == "cpu":
        config.model.dtype = "float32"
    mesh, setup, state, tree_step = common.build_train_step(config)
    per, div = args.batch_tokens // args.length, mesh_lib.batch_divisor(mesh)
    rows = max(div, per - per % div)
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(4, 1000, (rows, args.length), dtype=np.int32)
    host = {"src": ids(), "tgt_in": ids(), "tgt_out": ids()}
    batch = mesh_lib.shard_batch(host, mesh)

    box = {"state": state}

    def on_tree():
        box["state"], m = tree_step(box["state"], batch)
        return m

    calls = {}
    for name, pack in (("leaves", False), ("packed", True)):
        start = steps.init_train_state(setup)
        leaves, treedef = jax.tree.flatten(start)
        packing = Packing.of(leaves, pack=pack)
        box[name] = steps.make_pack(setup, treedef, packing)(start)
        del start, leaves
        step_fn = steps.make_packed_train_step(setup, treedef, packing)

        def call(name=name, step_fn=step_fn):
            box[name], m = step_fn(box[name], batch)
            return m

        calls[name] = call, packing.num_buffers

    copy = lambda: mesh_lib.shard_batch(host, mesh)
    rows_out = [
        {"part": "batch to device (shard_batch)", "ms": _host_ms(copy, common.block, args.iters)},
        {"part": "step call, TrainState", "ms": _host_ms(on_tree, common.block, args.iters)},
    ]
    for name, (call, buffers) in calls.items():
        part = f"step call, {name} ({buffers} arrays)"
        rows_out.append({"part": part, "ms": _host_ms(call, common.block, args.iters)})
    meta = {
        "device": common.device_info(),
        "config": args.config,
        "batch": [rows, args.length],
        "state_arrays": len(jax.tree.leaves(state)),
        "iters": args.iters,
    }
    common.report("host_step", meta, rows_out, ["part", "ms"])


if __name__ == "__main__":
    main()

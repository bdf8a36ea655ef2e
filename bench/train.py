"""Training throughput: target tokens/s, step time, MFU, peak memory, compile time.

    python bench/train.py --configs=tiny                  # CPU (make bench)
    python bench/train.py --configs=base,big --packing=both --batch_tokens=25000   # GPU/TPU

Runs the real `training.steps` train step (jit, donated state, the config's
optimizer) on synthetic batches laid out by the real input pipeline: a corpus
of random ids with WMT-like lengths (log-normal, median ~25 tokens), bucketed
by length or packed into rows of `max_length`. Batches are placed on the
devices ahead of time, so host input is not timed. MFU counts the model FLOPs of
`training.metrics.train_flops` (non-padding tokens only) against both the
datasheet peak and a bf16 matmul measured on the same machine in the same run.
Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness

PASSES = 3  # timed passes over the batches; the median is reported


def synthetic_corpus(n: int, vocab: int, max_length: int, seed: int = 0):
    """A TokenizedCorpus of random ids whose lengths look like WMT sentence pairs."""
    import numpy as np

    from attention_jax.data.tokenized import TokenizedCorpus

    rng = np.random.default_rng(seed)
    src_len = np.clip(rng.lognormal(np.log(25), 0.6, n), 1, max_length - 1).astype(np.int32)
    ratio = rng.normal(1.1, 0.15, n)
    tgt_len = np.clip(np.round(src_len * ratio), 1, max_length - 1).astype(np.int32)

    def flat(lens):
        starts = np.concatenate([[0], np.cumsum(lens[:-1])]).astype(np.int64)
        ids = rng.integers(4, vocab, int(lens.sum()), dtype=np.int32)
        return ids, starts

    src_flat, src_start = flat(src_len)
    tgt_flat, tgt_start = flat(tgt_len)
    return TokenizedCorpus(
        src_flat, src_start, src_len, tgt_flat, tgt_start, tgt_len, np.arange(n, dtype=np.int64)
    )


def _draw_batches(it, steps: int, max_shapes: int) -> list:
    """`steps` batches in the iterator's order; with max_shapes > 0, only batches of the
    max_shapes most frequent [B, S] shapes among the first 4 * steps (bounds compiles)."""
    if max_shapes <= 0:
        return [next(it) for _ in range(steps)]
    from collections import Counter

    pool = [next(it) for _ in range(4 * steps)]
    common = {s for s, _ in Counter(b["src"].shape for b in pool).most_common(max_shapes)}
    kept = [b for b in pool if b["src"].shape in common]
    while len(kept) < steps:
        b = next(it)
        if b["src"].shape in common:
            kept.append(b)
    return kept[:steps]


def peak_memory_bytes() -> tuple[int | None, str]:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host_rss"


def _config(name: str, args):
    """configs/NAME.py with the benchmark's layout, lengths, batch, dtype and kernel, on
    a data-parallel mesh of every device."""
    import jax

    config = importlib.import_module(f"attention_jax.configs.{name}").get_config()
    on_cpu = jax.default_backend() == "cpu"
    config.packing = args.packing == "packed"
    config.max_length = args.max_length or config.max_length
    config.batch_tokens = args.batch_tokens or config.batch_tokens
    config.model.dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    config.model.remat = args.remat
    config.model.attention_impl = args.attention_impl
    config.loss_logits_dtype = args.loss_logits_dtype
    config.mesh_data, config.mesh_fsdp, config.mesh_tensor = -1, 1, 1
    return config


def bench_config(name: str, args, matmul_peak: float) -> dict:
    import jax
    import numpy as np

    from attention_jax.data.pipeline import TrainIterator
    from attention_jax.training import config as config_lib
    from attention_jax.training import mesh as mesh_lib
    from attention_jax.training import metrics

    config = _config(name, args)
    mesh, _, state, train_step = harness.build_train_step(config)

    corpus = synthetic_corpus(args.corpus_pairs, config.vocab_size, config.max_length)
    it = TrainIterator(
        config, None, None, batch_multiple=mesh_lib.batch_divisor(mesh), tokenized=corpus
    )
    host = _draw_batches(it, args.steps, args.max_shapes)
    batches = [mesh_lib.shard_batch(b, mesh) for b in host]
    cfg = config_lib.model_config(config)
    flops = [
        metrics.train_flops(
            cfg,
            int(np.count_nonzero(b["src"])),
            int(np.count_nonzero(b["tgt_out"])),
            b["src"].shape[1],
            b["tgt_in"].shape[1],
        )
        for b in host
    ]

    # Compile every distinct shape once (what a real run pays up front).
    t0 = time.perf_counter()
    seen = set()
    for b in batches:
        shape = (b["src"].shape, b["tgt_in"].shape)
        if shape not in seen:
            seen.add(shape)
            state, m = train_step(state, b)
    harness.block(m)
    compile_s = time.perf_counter() - t0

    passes = []  # the same batches timed PASSES times: their spread is the noise
    for _ in range(PASSES):
        t0 = time.perf_counter()
        for b in batches:
            state, m = train_step(state, b)
        harness.block((state.step, m))
        passes.append(time.perf_counter() - t0)
    seconds = sorted(passes)[len(passes) // 2]

    tgt_tokens = sum(int(np.count_nonzero(b["tgt_out"])) for b in host)
    src_tokens = sum(int(np.count_nonzero(b["src"])) for b in host)
    slots = sum(b["src"].size + b["tgt_out"].size for b in host)
    n_dev = jax.device_count()
    achieved = sum(flops) / seconds / n_dev
    datasheet = metrics.peak_flops_per_device(config)
    mem, mem_kind = peak_memory_bytes()
    return {
        "config": name,
        "layout": args.packing,
        "dtype": config.model.dtype,
        "batch_tokens": config.batch_tokens,
        "max_length": config.max_length,
        "shapes": len(seen),
        "steps": len(batches),
        "step_ms": 1e3 * seconds / len(batches),
        "step_ms_passes": [round(1e3 * t / len(batches), 3) for t in passes],
        "prng_impl": str(jax.config.jax_default_prng_impl),
        "loss_logits_dtype": config.loss_logits_dtype,
        "tgt_tokens_per_s": tgt_tokens / seconds,
        "src_tokens_per_s": src_tokens / seconds,
        "padding": 1.0 - (src_tokens + tgt_tokens) / slots,
        "model_tflops_per_device": achieved / 1e12,
        "mfu_datasheet": achieved / datasheet if datasheet else None,
        "mfu_measured": achieved / matmul_peak,
        "compile_s": compile_s,
        "peak_mem_gb": mem / 2**30 if mem else None,
        "mem_kind": mem_kind,
        "final_loss": float(m["loss"]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny")
    p.add_argument("--packing", default="bucketed", choices=["bucketed", "packed", "both"])
    p.add_argument("--batch_tokens", type=int, default=0, help="0 = the config's")
    p.add_argument("--max_length", type=int, default=0, help="0 = the config's")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--max_shapes",
        type=int,
        default=0,
        help="time only batches of the N most frequent bucket shapes (0 = all): bounds "
        "the compiles of a big model with many buckets",
    )
    p.add_argument("--corpus_pairs", type=int, default=20000)
    p.add_argument("--dtype", default="", help="'' = bfloat16 on accelerators, float32 on CPU")
    p.add_argument("--attention_impl", default="auto")
    p.add_argument("--remat", action="store_true")
    p.add_argument(
        "--prng_impl",
        default="",
        help="jax_default_prng_impl for the dropout keys (e.g. unsafe_rbg; '' = JAX's)",
    )
    p.add_argument("--loss_logits_dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    harness.set_gpu_flags()
    if args.prng_impl:
        import jax

        jax.config.update("jax_default_prng_impl", args.prng_impl)

    matmul_peak = harness.measure_matmul_peak()
    rows = []
    layouts = ["bucketed", "packed"] if args.packing == "both" else [args.packing]
    for name in args.configs.split(","):
        for layout in layouts:
            args.packing = layout
            rows.append(bench_config(name, args, matmul_peak))
    meta = {"device": harness.device_info(), "matmul_peak_tflops": matmul_peak / 1e12}
    cols = [
        "config",
        "layout",
        "dtype",
        "batch_tokens",
        "shapes",
        "step_ms",
        "tgt_tokens_per_s",
        "padding",
        "mfu_datasheet",
        "mfu_measured",
        "compile_s",
        "peak_mem_gb",
    ]
    harness.report("train", meta, rows, cols)


if __name__ == "__main__":
    main()

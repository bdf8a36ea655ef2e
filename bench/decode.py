"""Decoding throughput: target tokens/s and sentences/s, beam 4 and greedy, per batch size.

    python bench/decode.py [--configs=tiny,base,big] [--batch_sizes=8,32,128] [--src_len=32]

Random-weight models of the configs' sizes (no training needed for speed).
Sources have 10..src_len tokens (bucket width src_len); the output limit is the
paper's source length + 50, so a random model that rarely emits EOS measures
close to the longest decode. Tokens counted: the returned translation's tokens
up to and including EOS. Computation dtype: the config's on GPU/TPU, float32 on
CPU. Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness


def _bench_one(model, src, beam_size: int, iters: int) -> dict:
    import jax
    import numpy as np

    from attention_jax import EOS_ID
    from attention_jax.search.decoding import translate

    run = lambda: translate(model, src, beam_size=beam_size)
    t0 = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(run()))
    compile_s = time.perf_counter() - t0
    seconds = harness.time_fn(run, warmup=0, iters=iters)
    has_eos = (tokens == EOS_ID).any(axis=1)
    lengths = np.where(has_eos, (tokens == EOS_ID).argmax(axis=1) + 1, tokens.shape[1])
    b = src.shape[0]
    return {
        "first_call_s": compile_s,
        "seconds": seconds,
        "sentences_per_s": b / seconds,
        "tokens_per_s": float(lengths.sum()) / seconds,
        "mean_out_len": float(lengths.mean()),
        "ms_per_step": 1e3 * seconds / float(lengths.max()),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny")
    p.add_argument("--batch_sizes", default="")
    p.add_argument("--beam_sizes", default="4,1")
    p.add_argument("--src_len", type=int, default=32)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--vocab_size", type=int, default=0, help="0 = the config's")
    args = p.parse_args(argv)
    harness.set_gpu_flags()

    import importlib

    import jax
    import numpy as np
    from flax import nnx

    from attention_jax import EOS_ID, Transformer, TransformerConfig

    on_cpu = jax.default_backend() == "cpu"
    default_batches = "8,32,128" if on_cpu else "32,128,512"
    batch_sizes = [int(b) for b in (args.batch_sizes or default_batches).split(",")]
    rows, meta_configs = [], {}
    for name in args.configs.split(","):
        cfg = importlib.import_module(f"attention_jax.configs.{name}").get_config()
        fields = {**cfg.model.to_dict(), "vocab_size": args.vocab_size or cfg.vocab_size}
        fields.update(dropout_rate=0.0, max_len=max(cfg.model.max_len, args.src_len + 50))
        if on_cpu:
            fields["dtype"] = "float32"
        tc = TransformerConfig.from_dict(fields)
        meta_configs[name] = {k: fields[k] for k in ("d_model", "num_heads", "d_ff", "dtype")}
        meta_configs[name]["layers"] = f"{tc.num_encoder_layers}+{tc.num_decoder_layers}"
        model = Transformer(tc, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(0)
        for b in batch_sizes:
            lengths = rng.integers(10, args.src_len + 1, size=b)
            src = np.zeros((b, args.src_len), np.int32)  # [B, S]
            for i, n in enumerate(lengths):
                src[i, : n - 1] = rng.integers(4, tc.vocab_size, size=n - 1)
                src[i, n - 1] = EOS_ID
            for k in (int(x) for x in args.beam_sizes.split(",")):
                r = _bench_one(model, src, k, args.iters)
                rows.append({"config": name, "beam": k, "batch": b, **r})
                note = f"# {name} beam={k} batch={b}: {r['tokens_per_s']:.0f} tok/s"
                print(note, file=sys.stderr)
    meta = {
        **harness.device_info(),
        "src_len": args.src_len,
        "max_decode_len": f"source length + 50 (<= {args.src_len + 50})",
        "configs": meta_configs,
    }
    columns = ["config", "beam", "batch", "sentences_per_s", "tokens_per_s"]
    columns += ["mean_out_len"]
    harness.report("decode", meta, rows, [*columns, "ms_per_step", "seconds", "first_call_s"])


if __name__ == "__main__":
    main()

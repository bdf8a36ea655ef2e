"""Attention micro-benchmark: forward + backward of each implementation.

    python bench/attention.py [--lengths=64,128,256] [--tokens=32768] [--dtype=bfloat16]

Batches hold `--tokens` query tokens (B = tokens / length), with 10-30% padding
per row. Prints one JSON object, then a table of milliseconds and TFLOP/s
(counting 4 * B * N * T * S * H forward FLOPs, x3.5 for forward + backward
of the non-causal case; causal FLOPs are counted at half).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness


def _time_impl(q, k, v, g, mask, impl):
    """(forward seconds, forward+backward seconds, error) for one implementation."""
    import jax
    import jax.numpy as jnp

    from attention_jax.attention import dot_product_attention

    def attend(q, k, v):
        return dot_product_attention(q, k, v, mask, impl=impl)

    def loss(q, k, v):
        return jnp.vdot(attend(q, k, v).astype(jnp.float32), g.astype(jnp.float32))

    fwd = jax.jit(attend)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    try:
        return harness.time_fn(lambda: fwd(q, k, v)), harness.time_fn(lambda: bwd(q, k, v)), None
    except Exception as e:  # a backend may reject a shape; record why
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="64,128,256")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default="")
    args = p.parse_args(argv)
    harness.set_gpu_flags()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from attention_jax.attention import Mask

    on_gpu = jax.default_backend() == "gpu"
    impls = args.impls.split(",") if args.impls else (["xla", "cudnn"] if on_gpu else ["xla"])
    dtype = jnp.dtype(args.dtype if on_gpu else "float32")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        b = max(1, args.tokens // length)
        n, h = args.heads, args.head_dim
        rng = np.random.default_rng(0)
        lengths = rng.integers(int(0.7 * length), length + 1, size=b).astype(np.int32)
        valid = np.arange(length)[None, :] < lengths[:, None]  # [B, T]
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, g = (jax.random.normal(kk, (b, length, n, h), dtype) for kk in keys)
        for causal in (False, True):
            dense = valid[:, None, :, None] & valid[:, None, None, :]
            if causal:
                dense = dense & np.tril(np.ones((length, length), bool))
            mask = Mask(jnp.asarray(dense), jnp.asarray(lengths), jnp.asarray(lengths), causal)
            for impl in impls:
                t_fwd, t_all, err = _time_impl(q, k, v, g, mask, impl)
                flops = 4 * b * n * length * length * h * (0.5 if causal else 1.0)
                rows.append(
                    {
                        "length": length,
                        "batch": b,
                        "causal": causal,
                        "impl": impl,
                        "fwd_ms": t_fwd and 1e3 * t_fwd,
                        "fwd_bwd_ms": t_all and 1e3 * t_all,
                        "fwd_tflops": t_fwd and flops / t_fwd / 1e12,
                        "fwd_bwd_tflops": t_all and 3.5 * flops / t_all / 1e12,
                        "error": err,
                    }
                )
    meta = {"device": harness.device_info(), "dtype": str(dtype), "tokens": args.tokens}
    cols = [
        "length",
        "batch",
        "causal",
        "impl",
        "fwd_ms",
        "fwd_bwd_ms",
        "fwd_tflops",
        "fwd_bwd_tflops",
        "error",
    ]
    harness.report("attention", meta, rows, cols)


if __name__ == "__main__":
    main()

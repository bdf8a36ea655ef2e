"""Where a beam-search step's time goes: the whole step and its pieces, per batch size.

    python bench/decode_step.py [--config=tiny] [--sources=4,16,64] [--beam_size=4]
    python bench/decode_step.py --sources=32 --trace_dir=/tmp/step   # + time by operation

Random weights of the config's size. For each batch of B sources (B*K beam rows,
room for --room tokens) it times, each in one compiled loop of --steps iterations
(so that no dispatch is counted), per step:

- `step`: search/beam.py `step`, all of it, as decode.py runs it on this platform;
- `decoder`: the model's `decode_step` alone (embedding, layers, output projection);
- `top_k`: picking the 2K best of the K x V candidates (search/scoring.py `top_k`);
- `reorder`: the cache rows that take their parent's (search/beam.py `move_rows`), for
  parents drawn at random within each source: on a CPU copied one at a time in place,
  elsewhere a gather of every row;
- `rest` = step - decoder - top_k - reorder: log-softmax, restrictions, bookkeeping
  (a difference of separate timings: within their noise it may even be negative).

Then fits the step's time to a + b x rows (the fixed cost per step, and the cost
per beam row). Prints one JSON object, then a table. With --trace_dir, one loop of the
whole step at the last batch size is also recorded (`jax.profiler.trace`) and summed
by XLA operation, on a CPU too (tools/trace_summary.py: ms for the loop's --steps steps).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness


def _model(name: str):
    from flax import nnx

    from attention_jax import Transformer, TransformerConfig

    cfg = importlib.import_module(f"attention_jax.configs.{name}").get_config()
    fields = {**cfg.model.to_dict(), "vocab_size": cfg.vocab_size, "dropout_rate": 0.0}
    fields["dtype"] = "float32"  # as decode.py on a CPU
    return Transformer(TransformerConfig.from_dict(fields), rngs=nnx.Rngs(0))


def _pieces(
    model, sources: int, k: int, room: int, steps: int, trace_dir: str | None = None
) -> dict[str, float]:
    """Seconds per step of each piece, for `sources` sources of width 16; with trace_dir,
    one more loop of the whole step is recorded there."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from attention_jax import EOS_ID
    from attention_jax.search import beam, scoring
    from attention_jax.search.settings import SearchSettings

    rng = np.random.default_rng(0)
    src = rng.integers(4, model.config.vocab_size, (sources, 16)).astype(np.int32)
    src[:, -1] = EOS_ID
    rule = SearchSettings(beam_size=k).rule()
    alpha = jnp.float32(0.6)
    limits = jnp.full((sources,), room, jnp.int32)
    state = beam.init(model.init_cache(jnp.asarray(src), room), limits, k, room)
    rows = sources * k
    cand = jnp.asarray(rng.standard_normal((sources, k * model.config.vocab_size)), jnp.float32)
    # Each row's new beam and its parent (drawn within its source), placed as a step does.
    origin = rng.integers(0, k, (sources, k)).astype(np.int32)  # [B, K], best first
    held = np.asarray(beam.places(jnp.asarray(origin)))
    origin = jnp.asarray(np.take_along_axis(origin, held, 1))  # [B, K] by row
    moving = origin != jnp.arange(k)

    def loop(body):
        return jax.jit(lambda c: jax.lax.fori_loop(0, steps, body, c))

    def step(_, s):
        return beam.step(model.decode_step, s, alpha, rule)

    def decoder(i, c):
        logits, cache = model.decode_step(jnp.full((rows,), 4 + i % 7, jnp.int32), c[1])
        return c[0] + logits[:, 0], cache

    def top(i, c):
        values, _ = scoring.top_k(cand + i, 2 * k)  # another row each time: nothing hoisted
        return c + values[:, :1]

    def reorder(_, cache):
        return beam.move_rows(cache, origin, moving)

    cases = {
        "step": (step, state),
        "decoder": (decoder, (jnp.zeros((rows,)), state.cache)),
        "top_k": (top, jnp.zeros((sources, 1))),
        "reorder": (reorder, state.cache),
    }
    out = {}
    for name, (body, carry) in cases.items():
        fn = loop(body)
        out[name] = harness.time_fn(lambda fn=fn, carry=carry: fn(carry), warmup=1, iters=7) / steps
    out["rest"] = out["step"] - out["decoder"] - out["top_k"] - out["reorder"]
    if trace_dir:
        fn, carry = loop(step), state
        jax.block_until_ready(fn(carry))
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(carry))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--sources", default="4,16,64", help="batch sizes, in sources")
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--room", type=int, default=48, help="the caches' room for tokens")
    p.add_argument("--steps", type=int, default=32, help="steps per timed loop (<= room)")
    p.add_argument("--trace_dir", help="record the last batch size's step loop here")
    args = p.parse_args(argv)
    if args.steps > args.room:
        p.error("--steps must be at most --room (a step writes one more cache slot)")

    import json

    import numpy as np

    model = _model(args.config)
    k = args.beam_size
    rows = []
    sizes = [int(x) for x in args.sources.split(",")]
    for b in sizes:
        trace = args.trace_dir if b == sizes[-1] else None
        pieces = _pieces(model, b, k, args.room, args.steps, trace)
        ms = {name: 1000 * s for name, s in pieces.items()}
        rows.append(
            {"sources": b, "beam_rows": b * k, **{f"{n}_ms": round(v, 4) for n, v in ms.items()}}
        )
    fit = {}
    if len(rows) > 1:
        slope, fixed = np.polyfit([r["beam_rows"] for r in rows], [r["step_ms"] for r in rows], 1)
        fit = {"fixed_ms": round(float(fixed), 4), "per_row_ms": round(float(slope), 5)}
    result = {
        "benchmark": "decode_step",
        "config": args.config,
        "beam_size": k,
        "room": args.room,
        **harness.device_info(),
        "rows": rows,
        "fit": fit,
    }
    print(json.dumps(result))
    names = ("step", "decoder", "top_k", "reorder", "rest")
    print(f"{'sources':>7} {'rows':>5} " + " ".join(f"{n + ' ms':>10}" for n in names))
    for r in rows:
        shares = " ".join(f"{r[n + '_ms']:>10.3f}" for n in names)
        print(f"{r['sources']:>7} {r['beam_rows']:>5} {shares}")
    if fit:
        print(f"step = {fit['fixed_ms']:.3f} ms + {fit['per_row_ms']:.4f} ms per beam row")
    if args.trace_dir:
        from tools import trace_summary

        trace_summary.main([args.trace_dir, "--top=15"])


if __name__ == "__main__":
    main()

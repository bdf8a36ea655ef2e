"""Where a job's search time goes, program by program: each search call timed to its end.

    python bench/decode_segments.py --workdir=workdir/tiny          # the Ding test set
    taskset -c 0 python bench/decode_segments.py --workdir=workdir/tiny   # on one core
    python bench/decode_segments.py --workdir=workdir/tiny --batched  # as on a GPU

Translates --split's sources with the library (`attention_jax.Translator`, beam
--beam_size) on one search stream, so that no two calls overlap, twice: the first
prepares the programs (kept and loaded as decode.py keeps them), the second is timed.
Every call of a pooled batch's search (search/pool.py, a CPU's) or, with --batched,
of a shrinking batch's programs (search/segments.py: start, grow, select, advance)
and of a small batch's whole search is timed until its outputs are ready. Per
program and the shape of the state it returns (beam rows, room; a pool: its slots'
rows; a whole search: its rows): calls, seconds, the beam-row steps it ran (rows x
steps) and the time per beam-row step (a start's and a pool's include the encoder).
Blocking on each call serializes the host and the device, so the sum is the search
with nothing overlapped; `bench/decode_step.py` times one step loop alone. Prints one
JSON object, then a table.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from bench import harness
from bench.translate_python import source_lines
from tools.report import report


def _timed(table: dict, name: str, fn: Any) -> Any:
    """fn, each call timed until its outputs are ready, into table[(name, rows, room)]:
    the beam rows and room of the state it returns (a whole search: its beam rows)."""

    def call(*args: Any, **kw: Any) -> Any:
        shapes = jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in shapes):
            return fn(*args, **kw)  # a program prepared (from shapes), not run
        step0 = int(args[1].step) if name == "advance" else 0
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kw))
        seconds = time.perf_counter() - t0
        steps = 0
        if name == "whole":
            key = (name, args[1].shape[0] * kw["rule"].beam_size, None)
        elif name == "pool":
            key = (name, kw["slots"] * kw["rule"].beam_size, kw["length"])
            steps = int(out[3])
        else:
            state = out[0] if name in ("start", "advance") else out
            b, k, room = state.live_seqs.shape
            key = (name, b * k, room)
            if name in ("start", "advance"):
                steps = int(out[1][1]) - step0
        entry = table[key]
        entry["calls"] += 1
        entry["seconds"] += seconds
        entry["beam_row_steps"] += key[1] * steps
        return out

    return call


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="a training workdir")
    p.add_argument("--input", default=None, help="source lines (default: --split's)")
    p.add_argument("--split", default="test", choices=["train", "dev", "test"])
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument(
        "--batched", action="store_true", help="search as on a GPU, not pooled as on a CPU"
    )
    p.add_argument(
        "--compilation_cache",
        default="default",
        help="where programs are kept, as decode.py keeps them (default: its directory); off",
    )
    args = p.parse_args(argv)

    from attention_jax import Translator
    from attention_jax.runtime.cpus import usable_cpus
    from attention_jax.search import decoding, pool, segments, stages

    lines = source_lines(args)
    cache = None if args.compilation_cache == "off" else args.compilation_cache
    table: dict = collections.defaultdict(lambda: {"calls": 0, "seconds": 0.0, "beam_row_steps": 0})
    timed = {(segments, f"{n}_segment"): n for n in ("start", "grow", "select", "advance")}
    timed[(decoding, "search_batch")] = "whole"
    timed[(pool, "pool_search")] = "pool"
    patched = [*timed, (stages, "search_streams"), (pool, "POOL_PLATFORMS")]
    real = {where: getattr(*where) for where in patched}
    try:
        stages.search_streams = lambda sharding: 1  # one call at a time
        if args.batched:
            pool.POOL_PLATFORMS = ()
        translator = Translator(args.workdir, compilation_cache=cache)
        translator.translate(lines, beam_size=args.beam_size)  # programs compiled or loaded
        for (module, attr), name in timed.items():
            setattr(module, attr, _timed(table, name, real[(module, attr)]))
        t0 = time.perf_counter()
        translator.translate(lines, beam_size=args.beam_size)
        wall = time.perf_counter() - t0
    finally:  # as it was (a test calls main in its process)
        for (module, attr), fn in real.items():
            setattr(module, attr, fn)

    rows = []
    for (name, beam_rows, room), e in sorted(table.items(), key=lambda kv: -kv[1]["seconds"]):
        per = e["seconds"] / e["beam_row_steps"] * 1e6 if e["beam_row_steps"] else None
        rows.append(
            {"program": name, "beam_rows": beam_rows, "room": room, "calls": e["calls"],
             "seconds": round(e["seconds"], 3), "beam_row_steps": e["beam_row_steps"],
             "us_per_beam_row_step": None if per is None else round(per, 1)}
        )  # fmt: skip
    meta = {
        "workdir": args.workdir,
        "lines": len(lines),
        "beam_size": args.beam_size,
        "search": "batched" if args.batched else "pooled where the platform pools",
        "cpus": usable_cpus(),
        "translate_s": round(wall, 3),
        "timed_s": round(sum(r["seconds"] for r in rows), 3),
        **harness.device_info(),
    }
    columns = ["program", "beam_rows", "room", "calls", "seconds", "beam_row_steps",
               "us_per_beam_row_step"]  # fmt: skip
    report("decode_segments", meta, rows, columns)


if __name__ == "__main__":
    main()

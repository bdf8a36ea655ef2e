"""Throughput of the training input pipeline on the Ding corpus (tokens/s).

    python bench/input_pipeline.py [--config=tiny] [--seconds=5] [--workdir=DIR]

Measures batches/s and tokens/s (non-padding source + target tokens, and all
slots including padding) of `data.train_iterator`, bucketed and packed, after
the one-off corpus preparation and tokenization (timed separately). Prints
one JSON object on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import data


def measure(it: data.TrainIterator, seconds: float) -> dict[str, float]:
    next(it)  # warm up
    real = slots = batches = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = next(it)
        real += np.count_nonzero(b["src"]) + np.count_nonzero(b["tgt_out"])
        slots += b["src"].size + b["tgt_out"].size
        batches += 1
    dt = time.perf_counter() - t0
    return {
        "batches_per_s": batches / dt,
        "tokens_per_s": real / dt,
        "slots_per_s": slots / dt,
        "padding_fraction": 1 - real / slots,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="configs/<name>.py")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    parser.add_argument("--workdir", default="", help="where tokenizer.model lives/is trained")
    args = parser.parse_args()

    config = importlib.import_module(f"configs.{args.config}").get_config()
    workdir = args.workdir or os.path.join(tempfile.gettempdir(), f"bench-input-{args.config}")
    t0 = time.perf_counter()
    corpus = data.load_split(config, "train")
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = data.get_tokenizer(config, workdir, corpus)
    t_tok = time.perf_counter() - t0

    results = {
        "config": args.config,
        "dataset": config.dataset,
        "num_pairs": len(corpus),
        "batch_tokens": config.batch_tokens,
        "max_length": config.max_length,
        "cpu_count": os.cpu_count(),
        "load_corpus_s": t_load,
        "get_tokenizer_s": t_tok,
    }
    for packing in (False, True):
        config.packing = packing
        t0 = time.perf_counter()
        it = data.train_iterator(config, tokenizer, corpus)
        name = "packed" if packing else "bucketed"
        results[f"{name}_setup_s"] = time.perf_counter() - t0
        results[name] = measure(it, args.seconds)
        results[name]["num_shapes"] = len(it.shapes)

    print(json.dumps(results))
    rows = [
        ("corpus load (cached)", f"{t_load:.2f} s"),
        ("tokenizer (load or train)", f"{t_tok:.2f} s"),
    ]
    for name in ("bucketed", "packed"):
        r = results[name]
        rows += [
            (f"{name}: setup (tokenize corpus)", f"{results[name + '_setup_s']:.2f} s"),
            (f"{name}: tokens/s (non-pad)", f"{r['tokens_per_s']:,.0f}"),
            (f"{name}: slots/s (with pad)", f"{r['slots_per_s']:,.0f}"),
            (f"{name}: batches/s", f"{r['batches_per_s']:,.1f}"),
            (f"{name}: padding fraction", f"{r['padding_fraction']:.3f}"),
            (f"{name}: distinct shapes", str(r["num_shapes"])),
        ]
    width = max(len(k) for k, _ in rows)
    print(f"input pipeline, config={args.config}, {len(corpus)} pairs", file=sys.stderr)
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>14}", file=sys.stderr)


if __name__ == "__main__":
    main()

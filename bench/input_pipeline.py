"""Input pipeline throughput on Ding, and the padding of bucket schemes.

    python bench/input_pipeline.py [--config=tiny] [--seconds=5]          # (make bench)

Measures batches/s and tokens/s (non-padding source + target tokens, and all
slots including padding) of `data.TrainIterator`, bucketed and packed, after
the one-off corpus preparation, tokenizer and cache build (timed separately;
setup_s is a restart: map the cache, plan an epoch), and the padding of
several bucket schemes on Ding's lengths and on WMT-like ones. The WMT-scale
benchmark (build, restart, planning, peak memory) is bench/data_scale.py.
Prints one JSON object on stdout, then a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from attention_jax import data
from attention_jax.data.plans import length_buckets
from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Target tokens/s of the tiny train step on the 2-core CPU box (docs/PERFORMANCE.md).
TINY_STEP_TGT_TOKENS_PER_S = 3600


def measure(it: data.TrainIterator, seconds: float) -> dict[str, float]:
    next(it)  # warm up
    real = tgt = slots = batches = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = next(it)
        real += np.count_nonzero(b["src"]) + np.count_nonzero(b["tgt_out"])
        tgt += np.count_nonzero(b["tgt_out"])
        slots += b["src"].size + b["tgt_out"].size
        batches += 1
    dt = time.perf_counter() - t0
    return {
        "batches_per_s": batches / dt,
        "tokens_per_s": real / dt,
        "tgt_tokens_per_s": tgt / dt,
        "slots_per_s": slots / dt,
        "padding_fraction": 1 - real / slots,
    }


# Bucket schemes compared on real lengths: name -> config.length_buckets for a max_length.
SCHEMES = {
    "powers of two from 8 (before)": lambda L: [8 * 2**i for i in range(10) if 8 * 2**i < L],
    "multiples of 8": lambda L: list(range(8, L, 8)),
    "multiples of 16": lambda L: list(range(16, L, 16)),
    "rule (8 to 48 by 4, then ~1/6 steps)": lambda L: length_buckets(L).tolist(),
    "fitted to the corpus (default)": lambda L: [],
}


def padding_by_scheme(config, tc) -> list[dict]:
    """Planned padding of one epoch of `tc` under each bucket scheme (plans only, no batches)."""
    rows = []
    for name, scheme in SCHEMES.items():
        c = config.copy_and_resolve_references()
        c.packing, c.length_buckets = False, tuple(scheme(c.max_length))
        it = data.TrainIterator(c, None, None, tokenized=tc)
        rows.append(
            {
                "scheme": name,
                "shapes": len(it.shapes),
                "padding": it.planned_padding_fraction,
            }
        )
    c = config.copy_and_resolve_references()
    c.packing = True
    it = data.TrainIterator(c, None, None, tokenized=tc)
    rows.append({"scheme": "packed", "shapes": 1, "padding": it.planned_padding_fraction})
    return rows


def ding_main(args) -> None:
    config = importlib.import_module(f"attention_jax.configs.{args.config}").get_config()
    workdir = args.workdir or os.path.join(tempfile.gettempdir(), f"bench-input-{args.config}")
    t0 = time.perf_counter()
    corpus = data.load_split(config, "train")
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = data.get_tokenizer(config, workdir, corpus)
    t_tok = time.perf_counter() - t0
    meta = {
        "mode": "ding",
        "config": args.config,
        "dataset": config.dataset,
        "num_pairs": len(corpus),
        "batch_tokens": config.batch_tokens,
        "max_length": config.max_length,
        "cpu_count": os.cpu_count(),
        "load_corpus_s": t_load,
        "get_tokenizer_s": t_tok,
    }
    cache = os.path.join(workdir, "data_cache")
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    data.TrainIterator(config, tokenizer, corpus, cache_dir=cache)
    meta["cache_build_s"] = time.perf_counter() - t0  # tokenize once, then map
    rows = []
    for packing in (False, True):
        config.packing = packing
        t0 = time.perf_counter()
        it = data.TrainIterator(config, tokenizer, corpus, cache_dir=cache)
        it.batches_per_epoch  # noqa: B018  (plans the epoch, or maps its stored plan)
        setup = time.perf_counter() - t0  # a restart: map the cache and the plan
        rows.append(
            {
                "pipeline": "packed" if packing else "bucketed",
                "setup_s": setup,
                **measure(it, args.seconds),
                "shapes": len(it.shapes),
            }
        )
    meta["padding_by_scheme"] = {"ding": padding_by_scheme(config, it._tc)}
    # The same schemes on WMT-like token lengths (bench/train.py's synthetic corpus).
    from bench.train import synthetic_corpus

    # tiny's batches and shape count at max_length 64, base's at 256.
    base = importlib.import_module("attention_jax.configs.base").get_config()
    for name, c in (("wmt_like_64", config), ("wmt_like_256", base)):
        c = c.copy_and_resolve_references()
        c.packing, max_length = False, c.max_length
        tc = synthetic_corpus(2_000_000, c.vocab_size, max_length)
        meta["padding_by_scheme"][name] = padding_by_scheme(c, tc)
    cols = ["pipeline", "setup_s", "tokens_per_s", "slots_per_s", "batches_per_s"]
    harness.report("input_pipeline", meta, rows, [*cols, "padding_fraction", "shapes"])
    for corpus_name, schemes in meta["padding_by_scheme"].items():
        print(f"\npadding of one epoch, {corpus_name}:")
        for r in schemes:
            print(f"  {r['scheme']:<42} {r['shapes']:>3} shapes  padding {r['padding']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="configs/<name>.py")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per throughput run")
    parser.add_argument("--workdir", default="", help="where tokenizer.model lives")
    ding_main(parser.parse_args())


if __name__ == "__main__":
    main()

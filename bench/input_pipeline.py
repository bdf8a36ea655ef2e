"""Input pipeline benchmarks: throughput on Ding, and the WMT-scale cache (build, restart, memory).

    python bench/input_pipeline.py [--config=tiny] [--seconds=5]          # Ding (make bench)
    python bench/input_pipeline.py --mode=wmt --pairs=1000000,4500000,20000000 \\
        --dir=/tmp/bench-wmt                                              # ~40 min on 2 cores

`--mode=ding` measures batches/s and tokens/s (non-padding source + target
tokens, and all slots including padding) of `data.TrainIterator`, bucketed
and packed, after the one-off corpus preparation, tokenizer and cache build
(timed separately; setup_s is a restart: map the cache, plan an epoch), and
the padding of several bucket schemes on Ding's lengths.

`--mode=wmt` writes a synthetic WMT-like TSV of N pairs per size (Zipf words,
log-normal sentence lengths, a fixed seed; reused if present) under --dir,
then for each N: trains the base tokenizer (37k pieces, its 250k-sentence sample)
in its own process; runs `train.py` (configs/base.py data settings, a small
model so that a CPU step is quick, see `train_command`) once from scratch
(builds the cache) and once more on the same workdir (a restart), each under
/usr/bin/time for the peak RSS of the process tree; then, in this process,
maps the cache again and measures the time to the first batch, the padding,
and the batch throughput against what the tiny train step consumes.
Prints one JSON object on stdout, then a table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

import data
from bench import common
from data.files import atomic_write
from data.plans import length_buckets

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
    config = importlib.import_module(f"configs.{args.config}").get_config()
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
        setup = time.perf_counter() - t0  # a restart: map the cache, plan the epoch
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
    base = importlib.import_module("configs.base").get_config()
    for name, c in (("wmt_like_64", config), ("wmt_like_256", base)):
        c = c.copy_and_resolve_references()
        c.packing, max_length = False, c.max_length
        tc = synthetic_corpus(2_000_000, c.vocab_size, max_length)
        meta["padding_by_scheme"][name] = padding_by_scheme(c, tc)
    cols = ["pipeline", "setup_s", "tokens_per_s", "slots_per_s", "batches_per_s"]
    common.report("input_pipeline", meta, rows, [*cols, "padding_fraction", "shapes"])
    for corpus_name, schemes in meta["padding_by_scheme"].items():
        print(f"\npadding of one epoch, {corpus_name}:")
        for r in schemes:
            print(f"  {r['scheme']:<42} {r['shapes']:>3} shapes  padding {r['padding']:.3f}")


# --- WMT-scale -------------------------------------------------------------------------------


def _vocabulary(rng: np.random.Generator, size: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
    """Random lowercase words (2-10 letters), as (concatenated bytes, start offsets)."""
    lengths = rng.integers(2, 11, size)
    letters = rng.integers(ord("a"), ord("z") + 1, int(lengths.sum()), dtype=np.uint8)
    return letters, np.concatenate([[0], np.cumsum(lengths)])


def write_synthetic_tsv(path: str, n: int, seed: int = 0, chunk: int = 50_000) -> None:
    """n WMT-like pairs: Zipf-distributed words, source length log-normal (median 20
    words, sigma 0.6), target ~1.1x source; vectorized in chunks (~1 min per 10M pairs)."""
    rng = np.random.default_rng(seed)
    letters, word_start = _vocabulary(rng)
    vocab = len(word_start) - 1
    zipf = 1.0 / np.arange(1, vocab + 1) ** 1.05
    cdf = np.cumsum(zipf / zipf.sum())
    with atomic_write(path) as f:
        for lo in range(0, n, chunk):
            m = min(chunk, n - lo)
            src = np.clip(rng.lognormal(np.log(20), 0.6, m), 1, 200).astype(np.int64)
            tgt = np.clip(np.round(src * rng.normal(1.1, 0.15, m)), 1, 220).astype(np.int64)
            per_pair = src + tgt
            words = np.minimum(np.searchsorted(cdf, rng.random(int(per_pair.sum()))), vocab - 1)
            wlen = word_start[words + 1] - word_start[words]
            # Each word is followed by a space, a tab (end of source) or a newline (end of pair).
            sep = np.full(len(words), ord(" "), np.uint8)
            ends = np.cumsum(per_pair)
            sep[ends - 1] = ord("\n")
            sep[ends - tgt - 1] = ord("\t")
            out_end = np.cumsum(wlen + 1)  # one past each word's separator
            word_of = np.repeat(np.arange(len(words), dtype=np.int32), wlen)
            within = np.arange(len(word_of)) - np.repeat(np.cumsum(wlen) - wlen, wlen)
            buf = np.empty(int(out_end[-1]), np.uint8)
            buf[(out_end - wlen - 1)[word_of] + within] = letters[
                word_start[words][word_of] + within
            ]
            buf[out_end - 1] = sep
            f.write(buf.tobytes())


def train_command(tsv: str, dev: str, workdir: str, steps: int, extra=()) -> list[str]:
    """train.py with configs/base.py's data settings (vocab 37000, max_length 256, 250k-sentence
    tokenizer sample, bucketed) and a small model (d_model 64, 1+1 layers) with 1024-token
    batches, so that a CPU step takes a fraction of a second: the runs measure the input
    side, not the model."""
    return [
        sys.executable,
        "train.py",
        "--config=configs/base.py",
        f"--workdir={workdir}",
        f"--config.dataset=tsv:{tsv}",
        f"--config.eval_dataset=tsv:{dev}",
        "--config.model.d_model=64",
        "--config.model.num_heads=2",
        "--config.model.num_encoder_layers=1",
        "--config.model.num_decoder_layers=1",
        "--config.model.d_ff=128",
        "--config.model.dtype=float32",
        "--config.batch_tokens=1024",
        f"--config.num_train_steps={steps}",
        "--config.log_every_steps=1",
        "--config.eval_every_steps=0",
        "--config.final_eval_max_examples=1",
        "--config.eval_beam_size=1",
        *extra,
    ]


def run_timed(cmd: list[str], log_path: str) -> dict:
    """Runs cmd under /usr/bin/time; wall seconds, peak RSS of the process tree, and when
    the first `step N/M` progress line (a finished train step) appeared."""
    rss_file = log_path + ".rss"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    first_step = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["/usr/bin/time", "-f", "%M", "-o", rss_file, *cmd],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in proc.stderr:
            log.write(f"{time.perf_counter() - t0:8.2f} {line}")
            if first_step is None and re.match(r"step \d+/\d+", line):
                first_step = time.perf_counter() - t0
        proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{cmd} failed; see {log_path}")
    with open(rss_file) as f:
        peak_kb = int(f.read().split()[-1])
    return {"wall_s": wall, "peak_rss_gb": peak_kb / 2**20, "first_step_s": first_step}


def _log_number(log_path: str, pattern: str) -> float | None:
    with open(log_path) as f:
        m = re.search(pattern, f.read())
    return float(m.group(1).replace(",", "")) if m else None


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _first_runs(row: dict, tsv: str, dev: str, workdir: str, logs: str, args) -> None:
    """The tokenizer alone (train.py would train it first), then train.py from scratch."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    saved = os.path.join(args.dir, f"tokenizer-{row['pairs']}.model")
    if args.reuse_tokenizer and os.path.isfile(saved):
        shutil.copy(saved, os.path.join(workdir, "tokenizer.model"))
    code = (
        # JAX's backend is up first, as in train.py, so the peak RSS is train.py's.
        "import jax; jax.devices(); from configs import base; import data; "
        "from training import log; log.setup(); "
        f"c = base.get_config(); c.dataset = 'tsv:{tsv}'; c.eval_dataset = 'tsv:{dev}'; "
        f"c.tokenizer_sample_size = {args.tokenizer_sample_size} or c.tokenizer_sample_size; "
        f"data.get_tokenizer(c, '{workdir}', data.load_split(c, 'train'))"
    )
    row["load_before_tokenizer"] = _load()
    log0 = os.path.join(logs, "tokenizer.log")
    r = run_timed([sys.executable, "-c", code], log0)
    if _log_number(log0, r"trained \w+ tokenizer .* in ([\d.]+)s"):
        row["tokenizer_s"], row["tokenizer_peak_rss_gb"] = r["wall_s"], r["peak_rss_gb"]
        shutil.copy(os.path.join(workdir, "tokenizer.model"), saved)
    # The TSV index is built by the first load_split (seconds since the process started).
    row["tsv_index_done_s"] = _log_number(log0, r"(?m)^\s*([\d.]+) \[data\] indexed")

    # train.py from scratch: builds the cache, trains 1 step.
    row["load_before_build"] = _load()
    log1 = os.path.join(logs, "first.log")
    r = run_timed(train_command(tsv, dev, workdir, 1, _extra(args)), log1)
    row["first_run_s"], row["first_run_peak_rss_gb"] = r["wall_s"], r["peak_rss_gb"]
    row["first_run_first_step_s"] = r["first_step_s"]
    row["cache_build_s"] = _log_number(log1, r"tokens in ([\d.]+)s")
    row["cache_pairs_per_s"] = _log_number(log1, r"\(([\d,]+) pairs/s\)")


def _extra(args) -> list[str]:
    n = args.tokenizer_sample_size
    return [f"--config.tokenizer_sample_size={n}"] if n else []


def _restart(row: dict, tsv: str, dev: str, workdir: str, logs: str, args) -> None:
    """train.py again on the same workdir: maps the cache, resumes, trains one more step."""
    done = [int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
    row["load_before_restart"] = _load()
    log2 = os.path.join(logs, "restart.log")
    r = run_timed(train_command(tsv, dev, workdir, max(done) + 1, _extra(args)), log2)
    row["restart_first_step_s"], row["restart_peak_rss_gb"] = r["first_step_s"], r["peak_rss_gb"]
    row["restart_data_ready_s"] = _log_number(log2, r"(?m)^\s*([\d.]+) \[data\] shard 0/1")


def _in_process(row: dict, tsv: str, dev: str, workdir: str, args) -> None:
    """The cached shard's restart cost, padding and batch throughput, in this process."""
    import grain  # noqa: F401  (imported by train.py long before its data: not timed here)
    import jax  # noqa: F401

    from configs import base

    config = base.get_config()
    config.dataset, config.eval_dataset = f"tsv:{tsv}", f"tsv:{dev}"
    corpus = data.load_split(config, "train")
    tokenizer = data.Tokenizer.load(os.path.join(workdir, "tokenizer.model"))
    cache = os.path.join(workdir, "data_cache")
    for packing, budget in ((False, 1024), (False, 25000), (True, 1024)):
        config.packing, config.batch_tokens = packing, budget
        t0 = time.perf_counter()
        it = data.TrainIterator(config, tokenizer, corpus, cache_dir=cache)
        next(it)
        name = f"{'packed' if packing else 'bucketed'}_{budget}"
        row[f"{name}_first_batch_s"] = time.perf_counter() - t0
        row[f"{name}_shapes"] = len(it.shapes)
        row[f"{name}_padding"] = it.planned_padding_fraction
        m = measure(it, args.seconds)
        row[f"{name}_tgt_tokens_per_s"] = m["tgt_tokens_per_s"]
        row[f"{name}_x_tiny_step"] = m["tgt_tokens_per_s"] / TINY_STEP_TGT_TOKENS_PER_S
    row["cache_gb"] = (
        sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs) / 1e9
    )


def wmt_one(n: int, args) -> dict:
    tsv = os.path.join(args.dir, f"wmt-like-{n}.tsv")
    dev = os.path.join(args.dir, "dev.tsv")
    row: dict = {"pairs": n}
    if not os.path.isfile(tsv):
        t0 = time.perf_counter()
        write_synthetic_tsv(tsv, n, seed=args.seed)
        row["generate_s"] = time.perf_counter() - t0
    if not os.path.isfile(dev):
        write_synthetic_tsv(dev, 8, seed=args.seed + 1)
    row["tsv_gb"] = os.path.getsize(tsv) / 1e9
    workdir = os.path.join(args.dir, f"workdir-{n}")
    os.environ["ATTENTION_JAX_CACHE"] = os.path.join(args.dir, "user-cache")
    logs = os.path.join(args.dir, f"logs-{n}")
    os.makedirs(logs, exist_ok=True)
    if not args.restart_only:
        _first_runs(row, tsv, dev, workdir, logs, args)
    _restart(row, tsv, dev, workdir, logs, args)
    _in_process(row, tsv, dev, workdir, args)
    row["load_after"] = _load()
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return row


def wmt_main(args) -> None:
    os.makedirs(args.dir, exist_ok=True)
    rows = [wmt_one(int(n), args) for n in args.pairs.split(",")]
    meta = {
        "mode": "wmt",
        "cpu_count": os.cpu_count(),
        "tokenizer_sample_size": args.tokenizer_sample_size,
        "train_command": " ".join(train_command("TSV", "DEV", "WORKDIR", 1)),
    }
    cols = [
        "pairs",
        "tokenizer_s",
        "cache_build_s",
        "cache_pairs_per_s",
        "restart_first_step_s",
        "first_run_peak_rss_gb",
        "restart_peak_rss_gb",
        "bucketed_25000_padding",
        "bucketed_1024_x_tiny_step",
    ]
    common.report("input_pipeline_wmt", meta, rows, cols)
    if not args.keep:
        for n in args.pairs.split(","):
            os.remove(os.path.join(args.dir, f"wmt-like-{int(n)}.tsv"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ding", choices=["ding", "wmt"])
    parser.add_argument("--config", default="tiny", help="ding: configs/<name>.py")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per throughput run")
    parser.add_argument("--workdir", default="", help="ding: where tokenizer.model lives")
    parser.add_argument("--pairs", default="1000000,4500000,20000000", help="wmt: corpus sizes")
    parser.add_argument("--dir", default="/tmp/bench-wmt", help="wmt: corpora and workdirs")
    parser.add_argument("--seed", type=int, default=0, help="wmt: corpus seed")
    parser.add_argument(
        "--tokenizer_sample_size", type=int, default=0, help="wmt: 0 = configs/base.py's"
    )
    parser.add_argument("--keep", action="store_true", help="wmt: keep corpora and workdirs")
    parser.add_argument(
        "--reuse_tokenizer", action="store_true", help="wmt: reuse DIR/tokenizer-N.model if there"
    )
    parser.add_argument(
        "--restart_only", action="store_true", help="wmt: only restart the kept workdirs"
    )
    args = parser.parse_args()
    if args.mode == "ding":
        ding_main(args)
    else:
        wmt_main(args)


if __name__ == "__main__":
    main()

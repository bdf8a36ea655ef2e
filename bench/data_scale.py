"""Data at WMT scale: first run, restart, planning time and peak memory for N pairs.

    python bench/data_scale.py --pairs=4500000,36000000 --config=tiny --vocab_size=2000 \\
        --model=config                       # packed (tiny): 910 CPU s for 36M pairs
    python bench/data_scale.py --pairs=4500000,36000000 --config=base --vocab_size=8000 \\
        --batch_tokens=4096                  # bucketed, base's data settings, a small model

For each N: a synthetic WMT-like TSV of N pairs (Zipf words, log-normal sentence
lengths, a fixed seed; written once under --dir and reused) and a dev file of 8
pairs, then three processes, each with the peak RSS of its process tree sampled
every 0.1 s (the largest process, as /usr/bin/time reports it; all of them
together, the cache build's workers included; and their private memory, which
leaves out the mapped cache's page-cache pages that RSS counts) and its CPU
seconds beside the wall time (the box may be shared):

  first run   train.py on a new workdir: TSV index, tokenizer, tokenized cache,
              epoch 0's plan, --steps steps, the final eval (2 dev pairs)
  restart     train.py again on that workdir, --steps more steps: maps the cache
              and the stored plan, restores, steps, evaluates
  pipeline    the input pipeline alone: map the cache (TrainIterator), the first
              batch, an epoch plan made and stored from scratch (another seed, so
              not the run's), the same plan mapped back, batches for --seconds

--model=small (default) trains a d_model-64, 1+1-layer model so that the runs
measure the data side; --model=config trains the config's own model (float32).
Prints one JSON object on stdout, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from attention_jax.data.files import atomic_write
from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_MODEL = {
    "d_model": 64,
    "num_heads": 2,
    "num_encoder_layers": 1,
    "num_decoder_layers": 1,
    "d_ff": 128,
}


# --- The corpus ----------------------------------------------------------------------------


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


# --- The runs ------------------------------------------------------------------------------


def config_flags(args, tsv: str, dev: str) -> list[str]:
    """--config.* flags of the runs: the config's data settings, with the overrides given."""
    flags = [f"--config.dataset=tsv:{tsv}", f"--config.eval_dataset=tsv:{dev}"]
    if args.vocab_size:
        flags.append(f"--config.vocab_size={args.vocab_size}")
    if args.batch_tokens:
        flags.append(f"--config.batch_tokens={args.batch_tokens}")
    if args.model == "small":
        flags += [f"--config.model.{k}={v}" for k, v in SMALL_MODEL.items()]
    if args.mapped_cache_gb:
        flags.append(f"--config.mapped_cache_gb={args.mapped_cache_gb}")
    return [*flags, "--config.model.dtype=float32"]


def train_command(args, tsv: str, dev: str, workdir: str, steps: int) -> list[str]:
    return [
        sys.executable,
        "train.py",
        f"--config=configs/{args.config}.py",
        f"--workdir={workdir}",
        *config_flags(args, tsv, dev),
        f"--config.num_train_steps={steps}",
        "--config.log_every_steps=1",
        "--config.eval_every_steps=0",
        "--config.final_eval_max_examples=2",
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _find(log: str, pattern: str, group: int = 1) -> float | None:
    m = re.search(pattern, log, re.MULTILINE)
    return float(m.group(group).replace(",", "")) if m else None


def _phases(log_path: str) -> dict[str, float | None]:
    """Seconds (since the process started) of a train.py run's phases, from its log."""
    with open(log_path) as f:
        log = f.read()
    epoch = r"^\s*([\d.]+) \[data\] shard 0/\d+ epoch \d+: .*\(plan .* in ([\d.]+)s\)"
    return {
        "tsv_indexed_at_s": _find(log, r"^\s*([\d.]+) \[data\] indexed"),
        "tokenizer_s": _find(log, r"trained \w+ tokenizer .* in ([\d.]+)s"),
        "cache_build_s": _find(log, r"tokens in ([\d.]+)s"),
        "cache_pairs_per_s": _find(log, r"\(([\d,]+) pairs/s\)"),
        "data_ready_at_s": _find(log, epoch),
        "plan_s": _find(log, epoch, 2),
        "first_step_at_s": _find(log, r"^\s*([\d.]+) step \d+/\d+"),
        "eval_s": _find(log, r"sentences, (\d+)s\)"),
    }


def _run(name: str, row: dict, cmd: list[str], logs: str) -> dict:
    """cmd sampled (see harness.run_sampled), its phases and the load before it, into row."""
    row[f"{name}_load_before"] = _load()
    log = os.path.join(logs, f"{name}.log")
    r = harness.run_sampled(cmd, log, env=_env(), cwd=ROOT)
    row[f"{name}_s"] = r["wall_s"]
    row[f"{name}_cpu_s"] = r["cpu_s"]
    row[f"{name}_peak_rss_gb"] = r["peak_rss_gb"]
    row[f"{name}_peak_tree_rss_gb"] = r["peak_tree_rss_gb"]
    row[f"{name}_peak_tree_anon_gb"] = r["peak_tree_anon_gb"]
    if cmd[1] == "train.py":
        row.update({f"{name}_{k}": v for k, v in _phases(log).items()})
    return r


def scale_one(n: int, args) -> dict:
    tsv = os.path.join(args.dir, f"wmt-like-{n}.tsv")
    dev = os.path.join(args.dir, "dev.tsv")
    row: dict = {"pairs": n, "config": args.config}
    if not os.path.isfile(tsv):
        t0 = time.perf_counter()
        write_synthetic_tsv(tsv, n, seed=args.seed)
        row["generate_s"] = time.perf_counter() - t0
    if not os.path.isfile(dev):
        write_synthetic_tsv(dev, 8, seed=args.seed + 1)
    row["tsv_gb"] = os.path.getsize(tsv) / 1e9
    workdir = os.path.join(args.dir, f"workdir-{args.config}-{n}")
    # The TSV's line index is kept in the user cache: one per run, so that a first run
    # indexes the TSV as a new user's would.
    user_cache = os.path.join(args.dir, f"user-cache-{args.config}-{n}")
    os.environ["ATTENTION_JAX_CACHE"] = user_cache
    logs = os.path.join(args.dir, f"logs-{args.config}-{n}")
    os.makedirs(logs, exist_ok=True)
    if not args.restart_only:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(user_cache, ignore_errors=True)
        _run("first", row, train_command(args, tsv, dev, workdir, args.steps), logs)
    done = max(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    _run("restart", row, train_command(args, tsv, dev, workdir, done + args.steps), logs)
    pipeline = [sys.executable, "bench/data_scale.py", "--pipeline_only", f"--workdir={workdir}"]
    pipeline += [f"--tsv={tsv}", *sys.argv[1:]]
    r = _run("pipeline", row, pipeline, logs)
    row.update(json.loads(r["stdout"].strip().splitlines()[-1]))
    row["cache_gb"] = (
        sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(workdir, "data_cache"))
            for f in fs
        )
        / 1e9
    )
    row["load_after"] = _load()
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(user_cache, ignore_errors=True)
    return row


# --- The input pipeline alone (a child process) ----------------------------------------------


def pipeline_only(args) -> None:
    """Prints a JSON line: mapping, first batch, an epoch plan made and mapped, throughput."""
    import grain  # noqa: F401  (train.py has these loaded before its data: not timed)
    import jax  # noqa: F401

    from attention_jax import data
    from attention_jax.data.plan_cache import EpochPlans
    from bench.input_pipeline import measure

    config = importlib_config(args.config)
    for flag in config_flags(args, args.tsv, os.path.join(args.dir, "dev.tsv")):
        key, value = flag[len("--config.") :].split("=", 1)
        _set(config, key, value)
    corpus = data.load_split(config, "train")
    tokenizer = data.Tokenizer.load(os.path.join(args.workdir, "tokenizer.model"))
    cache = os.path.join(args.workdir, "data_cache")
    out: dict = {}
    t0 = time.perf_counter()
    it = data.TrainIterator(config, tokenizer, corpus, cache_dir=cache)
    out["pipeline_map_s"] = time.perf_counter() - t0
    next(it)
    out["pipeline_first_batch_s"] = time.perf_counter() - t0
    out["batches_per_epoch"] = it.batches_per_epoch
    out["planned_padding"] = it.planned_padding_fraction
    # An epoch plan from scratch: another shuffle seed, so another family than the run's.
    spec = dataclasses.replace(it._plans.spec, shuffle_seed=it._plans.spec.shuffle_seed + 7919)
    fresh = EpochPlans(it._tc, spec)
    t0 = time.perf_counter()
    fresh.get(0)
    out["plan_made_s"] = time.perf_counter() - t0
    again = EpochPlans(it._tc, spec)
    t0 = time.perf_counter()
    again.get(0)
    out["plan_mapped_s"] = time.perf_counter() - t0
    shutil.rmtree(fresh._path(0), ignore_errors=True)
    m = measure(it, args.seconds)
    out["tgt_tokens_per_s"] = m["tgt_tokens_per_s"]
    print(json.dumps(out))


def importlib_config(name: str):
    import importlib

    return importlib.import_module(f"attention_jax.configs.{name}").get_config()


def _set(config, dotted: str, value: str) -> None:
    *path, leaf = dotted.split(".")
    for p in path:
        config = config[p]
    old = config[leaf]
    config[leaf] = type(old)(value) if not isinstance(old, str) else value


# --- Main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="4500000", help="corpus sizes, comma-separated")
    parser.add_argument("--config", default="base", choices=["tiny", "base", "big"])
    parser.add_argument("--vocab_size", type=int, default=0, help="0 = the config's")
    parser.add_argument("--batch_tokens", type=int, default=0, help="0 = the config's")
    parser.add_argument("--model", default="small", choices=["small", "config"])
    parser.add_argument("--steps", type=int, default=2, help="train steps per run")
    parser.add_argument("--seconds", type=float, default=3.0, help="batch throughput run")
    parser.add_argument("--mapped_cache_gb", type=float, default=0.0, help="config's (0 = off)")
    parser.add_argument("--dir", default="/tmp/bench-wmt", help="corpora and workdirs")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed")
    parser.add_argument("--keep", action="store_true", help="keep the workdirs")
    parser.add_argument("--restart_only", action="store_true", help="restart kept workdirs")
    parser.add_argument("--pipeline_only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tsv", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pipeline_only:
        return pipeline_only(args)
    os.makedirs(args.dir, exist_ok=True)
    rows = [scale_one(int(n), args) for n in args.pairs.split(",")]
    meta = {
        "benchmark_args": sys.argv[1:],
        "cpu_count": os.cpu_count(),
        "train_command": " ".join(train_command(args, "TSV", "DEV", "WORKDIR", args.steps)),
    }
    cols = [
        "pairs",
        "first_s",
        "first_cpu_s",
        "first_cache_build_s",
        "first_plan_s",
        "first_peak_rss_gb",
        "first_peak_tree_rss_gb",
        "first_peak_tree_anon_gb",
        "restart_first_step_at_s",
        "restart_data_ready_at_s",
        "restart_s",
        "restart_cpu_s",
        "restart_peak_rss_gb",
        "plan_made_s",
        "plan_mapped_s",
        "pipeline_peak_rss_gb",
    ]
    harness.report("data_scale", meta, rows, cols)


if __name__ == "__main__":
    main()

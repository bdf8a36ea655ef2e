"""decode.py end to end on a file: target tokens/s after start-up, start-up, and where the
time went, with an empty compilation cache ("cold") and then with the one it filled ("warm").

    python bench/decode_file.py --workdir=workdir/tiny --split=test            # make decode's
    python bench/decode_file.py --workdir=W --split=train --lines=100000 -- --beam_size=4
    python bench/decode_file.py --workdir=W --input=big.de --runs=warm

The input is --input, or the sources of a split of the workdir's dataset written to a
file, repeated to --lines lines if given. Each run is `python decode.py ... --stats`
in a process of its own (search/timing.py: start-up, programs, host phases,
device busy and idle); flags after `--` go to decode.py. Prints one JSON object
per run, each with "benchmark": "decode.py", then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import common  # noqa: E402


def split_sources(workdir: str, split: str) -> list[str]:
    """The source sides of `split` of the workdir's dataset (its config.json)."""
    from data import load_split
    from training.config import load_config

    corpus = load_split(load_config(workdir), split)
    return [corpus[i][0] for i in range(len(corpus))]


def write_input(path: str, lines: list[str], count: int | None) -> int:
    """`lines` (cycled to `count` lines when given) into `path`; returns how many."""
    if count:
        lines = [lines[i % len(lines)] for i in range(count)]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line.replace("\n", " ") + "\n" for line in lines)
    return len(lines)


def run_decode(args, input_path: str, cache: str, scratch: str, name: str, extra: list[str]):
    """One decode.py process; its --stats breakdown with the run's facts."""
    stats = os.path.join(scratch, f"{name}.stats.json")
    output = os.path.join(scratch, f"{name}.out")
    flags = [f"--workdir={args.workdir}", f"--input={input_path}", f"--output={output}"]
    flags += [f"--stats={stats}", f"--compilation_cache={cache}", "--restart", *extra]
    process_s = common.run_decode(flags)["wall_s"]
    with open(stats) as f:
        row = json.load(f)
    with open(output, "rb") as f:
        row["output_bytes"] = len(f.read())
    return {"run": name, "process_s": round(process_s, 3), **row}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--input", default=None, help="a file of source lines")
    p.add_argument("--split", default=None, choices=["train", "dev", "test"])
    p.add_argument("--lines", type=int, default=None, help="cycle the input to this many")
    p.add_argument("--runs", default="cold,warm", help="cold (empty cache), warm, or both")
    p.add_argument("--scratch", default=None, help="where inputs, outputs, caches go")
    p.add_argument("--jsonl", default=None, help="also append each run's JSON line here")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if (args.input is None) == (args.split is None):
        p.error("give one of --input and --split")
    scratch = args.scratch or tempfile.mkdtemp(prefix="decode-file-")
    os.makedirs(scratch, exist_ok=True)
    source = os.path.join(scratch, "input.txt")
    if args.split:
        lines = split_sources(args.workdir, args.split)
    else:
        with open(args.input, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    count = write_input(source, lines, args.lines)
    cache = os.path.join(scratch, "cache")
    rows = []
    for name in args.runs.split(","):
        if name not in ("cold", "warm"):
            p.error(f"--runs: cold or warm, not {name!r}")
        if name == "cold" and os.path.exists(cache):
            import shutil

            shutil.rmtree(cache)
        row = run_decode(args, source, cache, scratch, name, extra)
        row.update(
            benchmark="decode.py",
            input=args.input or f"{args.split} sources",
            decode_flags=extra,
            compilation_cache=name,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"{count} lines; scratch {scratch}")
    cols = ["run", "process_s", "startup_s", "programs_s", "device_busy_s", "host_bound_s"]
    cols += ["target_tokens_per_s", "host_share_after_programs"]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>14}" for c in cols))


if __name__ == "__main__":
    main()

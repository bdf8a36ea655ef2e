"""decode.py end to end on files: its pace, its memory, and what a killed job costs to finish.

Every measure runs `python decode.py` in processes of its own on an input file made
in a scratch directory; flags after `--` go to decode.py.

--measure=pace (the default): target tokens/s after start-up, start-up, and where the
time went, with an empty compilation cache ("cold") and then with the one it filled
("warm"). The input is --input, or the sources of a split of the workdir's dataset,
cycled to --lines lines if given; each run is `decode.py ... --stats` (search/timing.py:
start-up, programs, host phases, device busy and idle). One JSON line per run
("benchmark": "decode.py"), then a table.

    python bench/decode_file.py --workdir=workdir/tiny --split=test            # make decode's
    python bench/decode_file.py --workdir=W --split=train --lines=100000 -- --beam_size=4
    python bench/decode_file.py --workdir=W --input=big.de --runs=warm

--measure=memory: peak RSS and throughput of the whole process, per input size. Inputs
are the Ding sources (data/corpora.py: the training split's German side, repeated up to
each of --sizes; or the test split). Peak RSS is the kernel's ru_maxrss of the child
(os.wait4); wall_s covers start-up to exit, as does cpu_s (the CPU seconds of all its
threads, the measure to compare when other processes share the cores); the translation
rates are decode.py's own summary line (encoding, translating, writing; no start-up).
Runs are repeated (--repeats) and the median wall time and rates kept, with the largest
RSS. --read_lines=0 means one chunk for the whole input (the batches decode.py made
before it streamed); --plans counts the batches that chunks make, without decode.py.
One JSON object ("benchmark": "decode_stream" or "decode_stream_plans"), then a table.

    # memory: read, tokenize, plan and write 10k and 1M lines without the model
    python bench/decode_file.py --measure=memory --workdir=workdir/tiny --dry_run \
        --sizes=10000,1000000
    # throughput on the Ding test set for some --read_lines (and one chunk for all of it)
    python bench/decode_file.py --measure=memory --test_set --read_lines=250,1000,0
    # ... or of another decode.py (e.g. a checkout of the code before it streamed)
    python bench/decode_file.py --measure=memory --test_set --decode_py=/tmp/old/decode.py
    # the batches chunks make (no decode.py run): filler rows and padding per --read_lines
    python bench/decode_file.py --measure=memory --plans --sizes=100000 \
        --read_lines=1000,10000,0

--measure=resume: decode.py killed at 60% of a job and run again: what the re-run costs
against the whole job, and whether the output is the uninterrupted run's. Per input size
(--lines, the split's sources cycled): a run that fills the compilation cache (not
timed), the whole job timed, then the same command killed (SIGKILL) once the output's
record and journal (inference/output.py) count 60% of the lines, and run again, timed.
One JSON line per size ("benchmark": "decode_resume"), then a table.

    python bench/decode_file.py --measure=resume --workdir=workdir/tiny --split=train \
        --lines=5000,12000

--measure=programs: what jobs of the same size add to one compilation cache. Job 1
translates --lines lines of a split with decode.py's default chunks into an empty cache;
each later job the next --lines lines, in chunks of one of --read_lines. Per job: the
files in the cache and how many it added, the programs XLA compiled and those loaded
whole (--stats). A job's programs are fixed by its settings and source widths: a later
job of the same kind of lines adds none. One JSON line per job ("benchmark":
"decode_programs"), then a table.

    python bench/decode_file.py --measure=programs --workdir=workdir/tiny --lines=8000 \
        --read_lines=1000

The "benchmark" names are those of the scripts these measures came from (decode_stream.py,
decode_resume.py), so that new results line up with the old ones in bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness  # noqa: E402

MEASURES = ("pace", "memory", "resume", "programs")


# --- inputs -----------------------------------------------------------------------------------


def split_sources(workdir: str, split: str) -> list[str]:
    """The source sides of `split` of the workdir's dataset (its config.json)."""
    from attention_jax.data import load_split
    from attention_jax.training.config import load_config

    corpus = load_split(load_config(workdir), split)
    return [corpus[i][0] for i in range(len(corpus))]


def ding_sources(split: str) -> list[str]:
    """The German side of a split of the Ding corpus (parsed once, cached by data/)."""
    from attention_jax.data.corpora import prepare_ding

    return [de for de, _ in prepare_ding()[split]]


def write_input(path: str, lines: list[str], count: int | None = None) -> int:
    """`lines` cycled to `count` lines (all once when None) into `path`; returns how many.

    Written a block of all `lines` at a time: the memory measure asks for 1M lines.
    """
    count = len(lines) if count is None else count
    block = "".join(line.replace("\n", " ") + "\n" for line in lines)
    full, rest = divmod(count, len(lines)) if lines else (0, 0)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(full):
            f.write(block)
        f.writelines(line.replace("\n", " ") + "\n" for line in lines[:rest])
    return count


def decode_flags(rest: list[str]) -> list[str]:
    """The flags meant for decode.py: what argparse left, without the `--` before them."""
    return [a for a in rest if a != "--"]


# --- pace: cold and warm runs with --stats ------------------------------------------------


def pace_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True)
    p.add_argument("--input", default=None, help="a file of source lines")
    p.add_argument("--split", default=None, choices=["train", "dev", "test"])
    p.add_argument("--lines", type=int, default=None, help="cycle the input to this many")
    p.add_argument("--runs", default="cold,warm", help="cold (empty cache), warm, or both")
    p.add_argument("--scratch", default=None, help="where inputs, outputs, caches go")
    p.add_argument("--jsonl", default=None, help="also append each run's JSON line here")


def stats_run(args, input_path: str, cache: str, scratch: str, name: str, extra: list[str]):
    """One decode.py process; its --stats breakdown with the run's facts."""
    stats = os.path.join(scratch, f"{name}.stats.json")
    output = os.path.join(scratch, f"{name}.out")
    flags = [f"--workdir={args.workdir}", f"--input={input_path}", f"--output={output}"]
    flags += [f"--stats={stats}", f"--compilation_cache={cache}", "--restart", *extra]
    process_s = harness.run_decode(flags)["wall_s"]
    with open(stats) as f:
        row = json.load(f)
    row["output_bytes"] = os.path.getsize(output)
    return {"run": name, "process_s": round(process_s, 3), **row}


def pace(p: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """Cold and warm decode.py runs with --stats: one JSON line each, then a table."""
    if (args.input is None) == (args.split is None):
        p.error("give one of --input and --split")
    runs = args.runs.split(",")
    if bad := [r for r in runs if r not in ("cold", "warm")]:
        p.error(f"--runs: cold or warm, not {bad[0]!r}")
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
    for name in runs:
        if name == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        row = stats_run(args, source, cache, scratch, name, extra)
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
    for row in rows:
        row["compiled"] = row["programs"]["compiled"]
    cols = ["run", "process_s", "startup_s", "compiled", "programs_critical_s", "device_busy_s"]
    harness.table(rows, [*cols, "host_bound_s", "target_tokens_per_s", "host_share"])


# --- memory: peak RSS and throughput per input size; the batches chunks make ---------------


def memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="workdir/tiny")
    p.add_argument("--dry_run", action="store_true", help="decode.py --dry_run (no model)")
    p.add_argument("--sizes", default="10000,1000000", help="input lines (training sources)")
    p.add_argument("--test_set", action="store_true", help="the Ding test set, not --sizes")
    p.add_argument("--read_lines", default="", help="chunk sizes; 0 = one chunk; '' = default")
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--decode_py", default=harness.DECODE_PY)
    p.add_argument("--scratch", default=None, help="where inputs and outputs go (default: tmp)")
    p.add_argument("--plans", action="store_true", help="count the batches of each chunk size")
    p.add_argument("--batch_tokens", type=int, default=4096)


def repeated_run(decode_py: str, flags: list[str], repeats: int) -> dict:
    """decode.py run `repeats` times: the median of each figure, the largest peak RSS."""
    runs = []
    for _ in range(repeats):
        row = harness.run_decode(flags, decode_py=decode_py)
        runs.append({k: v for k, v in row.items() if k not in ("stdout", "stderr")})
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "peak_rss_mb"}
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    out["lines"] = int(out["lines"])
    return out


def plan_costs(workdir: str, sources: list[str], chunks: list[int], batch_tokens: int) -> list:
    """Per chunk size, the batches `data.plans.plan_translation` makes of the sources read
    in chunks of that many lines: batches, rows (with the filler that pads a width's last
    batch), padded source tokens; compared with one chunk for everything."""
    from attention_jax.data.plans import plan_translation
    from attention_jax.data.tokenizer import load_tokenizer
    from attention_jax.training.config import load_config

    max_len = load_config(workdir).model.max_len
    tokenizer = load_tokenizer(workdir)  # ours, or a fine-tuned OPUS-MT model's
    lengths = [min(len(ids) + 1, max_len) for ids in tokenizer.encode_batch(sources)]
    rows = []
    for chunk in chunks:
        size = chunk or len(lengths)
        batches = filled = slots = 0
        for start in range(0, len(lengths), size):
            plan = plan_translation(
                lengths[start : start + size], batch_tokens=batch_tokens, max_len=max_len
            )
            batches += len(plan)
            filled += sum(r for _, _, r in plan)
            slots += sum(r * w for _, w, r in plan)
        rows.append(
            {"read_lines": chunk, "batches": batches, "rows": filled, "padded_tokens": slots}
        )
    whole = rows[-1] if chunks[-1] == 0 else None
    for r in rows:
        r["filler_rows_pct"] = 100 * (r["rows"] - len(lengths)) / r["rows"]
        if whole:
            r["rows_vs_one_chunk_pct"] = 100 * (r["rows"] / whole["rows"] - 1)
    return rows


def memory(p: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """Peak RSS and rates per input size and --read_lines (or, with --plans, the batches
    of each chunk size): one JSON object, then a table."""
    if args.plans:
        size = int(args.sizes.split(",")[0])
        sources = ding_sources("test" if args.test_set else "train")
        sources = (sources * (size // len(sources) + 1))[:size]
        chunks = [int(x) for x in (args.read_lines or "1000,10000,0").split(",")]
        rows = plan_costs(args.workdir, sources, chunks, args.batch_tokens)
        columns = ["read_lines", "batches", "rows", "filler_rows_pct", "rows_vs_one_chunk_pct"]
        meta = {"input_lines": len(sources), "batch_tokens": args.batch_tokens}
        return harness.report("decode_stream_plans", meta, rows, [*columns, "padded_tokens"])

    scratch = args.scratch or tempfile.mkdtemp(prefix="decode-memory-")
    os.makedirs(scratch, exist_ok=True)
    sources = ding_sources("test" if args.test_set else "train")
    sizes = [len(sources)] if args.test_set else [int(s) for s in args.sizes.split(",")]
    chunks = [int(x) for x in args.read_lines.split(",")] if args.read_lines else [None]
    rows = []
    for size in sizes:
        src = os.path.join(scratch, f"in_{size}.de")
        if not os.path.isfile(src) or os.path.getsize(src) == 0:
            write_input(src, sources, size)
        for chunk in chunks:
            out = os.path.join(scratch, f"out_{size}.txt")
            flags = [
                f"--workdir={os.path.abspath(args.workdir)}",
                f"--input={src}",
                f"--output={out}",
                f"--beam_size={args.beam_size}",
            ]
            if chunk is not None:
                flags.append(f"--read_lines={chunk or max(size, 1)}")
            flags += ["--dry_run"] if args.dry_run else []
            r = repeated_run(args.decode_py, [*flags, *extra], args.repeats)
            rows.append({"input_lines": size, "read_lines": chunk, **r})
            print(f"# {size} lines, read_lines={chunk}: {r}", file=sys.stderr)
    meta = {
        "decode_py": os.path.abspath(args.decode_py),
        "workdir": args.workdir,
        "dry_run": args.dry_run,
        "input": "ding test sources" if args.test_set else "ding training sources, repeated",
        "beam_size": args.beam_size,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
    }
    columns = ["input_lines", "read_lines", "peak_rss_mb", "wall_s", "cpu_s", "translate_s"]
    harness.report("decode_stream", meta, rows, [*columns, "sentences_per_s", "tokens_per_s"])


# --- resume: killed at 60% and run again ------------------------------------------------------


def resume_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True)
    p.add_argument("--split", default="train", choices=["train", "dev", "test"])
    p.add_argument("--lines", default="5000,12000", help="input sizes, comma-separated")
    p.add_argument("--at", type=float, default=0.6, help="kill once this share is done")
    p.add_argument("--scratch", default="/tmp/decode-resume")


def lines_done(output: str) -> int:
    """Lines the output's record counts, plus the sources its journal holds for the chunk
    after them. decode.py replaces the record before it empties the journal, so a journal
    read just after the record may still hold the chunk the record already counts: only
    the entries a resume would use (inference/output.py `Journal.read`) are counted."""
    from attention_jax.inference.output import JOURNAL, RECORD, Journal

    done = 0
    try:
        with open(output + RECORD) as f:
            done = json.load(f).get("done", {}).get("lines", 0)
    except (OSError, ValueError):
        pass
    try:
        return done + len(Journal(output + JOURNAL, done).read())
    except OSError:  # replaced while read
        return done


def killed_run(flags: list[str], kill_at: int, output: str) -> float:
    """decode.py with `flags`, SIGKILLed once `kill_at` lines of `output` are done; seconds."""
    t0 = time.perf_counter()
    cmd = [sys.executable, harness.DECODE_PY, *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and lines_done(output) < kill_at:
        time.sleep(0.05)
    if proc.poll() is not None:
        sys.exit(f"decode.py ended before {kill_at} lines were done")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - t0


def resume(p: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """Whole job, killed job and its re-run per input size: one JSON line each, a table."""
    os.makedirs(args.scratch, exist_ok=True)
    sources = split_sources(args.workdir, args.split)
    rows = []
    for n in (int(x) for x in args.lines.split(",")):
        source = os.path.join(args.scratch, f"in{n}.txt")
        write_input(source, sources, n)
        out = os.path.join(args.scratch, f"out{n}.txt")
        cache = os.path.join(args.scratch, "cache")
        flags = [f"--workdir={args.workdir}", f"--input={source}", f"--output={out}"]
        flags += [f"--compilation_cache={cache}", *extra]
        harness.run_decode([*flags, "--restart"])  # fills the compilation cache
        whole_s = harness.run_decode([*flags, "--restart"])["wall_s"]
        with open(out, "rb") as f:
            whole = f.read()
        os.remove(out)
        killed_s = killed_run(flags, int(args.at * n), out)
        at = lines_done(out)
        rerun_s = harness.run_decode(flags)["wall_s"]
        with open(out, "rb") as f:
            same = f.read() == whole
        row = {
            "benchmark": "decode_resume",
            "lines": n,
            "killed_at_lines": at,
            "whole_s": round(whole_s, 2),
            "killed_after_s": round(killed_s, 2),
            "rerun_s": round(rerun_s, 2),
            "rerun_share": round(rerun_s / whole_s, 3),
            "identical_output": same,
            "decode_flags": extra,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = ["lines", "killed_at_lines", "whole_s", "killed_after_s", "rerun_s", "rerun_share"]
    harness.table(rows, [*cols, "identical_output"])


# --- programs: what each job adds to the compilation cache -----------------------------------


def programs_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", required=True)
    p.add_argument("--split", default="train", choices=["train", "dev", "test"])
    p.add_argument("--lines", type=int, default=8000, help="lines per job")
    p.add_argument("--read_lines", default="1000", help="the later jobs' chunks, one job each")
    p.add_argument("--scratch", default=None, help="where inputs, outputs, the cache go")


def programs(p: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """Jobs over other lines in other chunks, one cache: the files each adds, a table."""
    scratch = args.scratch or tempfile.mkdtemp(prefix="decode-programs-")
    os.makedirs(scratch, exist_ok=True)
    cache = os.path.join(scratch, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    sources = split_sources(args.workdir, args.split)
    chunks = [None, *(int(r) for r in args.read_lines.split(","))]
    files = lambda: sum(len(f) for _, _, f in os.walk(cache))
    rows = []
    for job, read_lines in enumerate(chunks):
        source, stats = os.path.join(scratch, "in.txt"), os.path.join(scratch, "stats.json")
        lines = sources[job * args.lines :][: args.lines]
        write_input(source, lines, args.lines)
        before = files() if os.path.isdir(cache) else 0
        flags = [f"--workdir={args.workdir}", f"--input={source}", f"--stats={stats}"]
        flags += [f"--output={os.path.join(scratch, 'out.txt')}", f"--compilation_cache={cache}"]
        flags += ["--restart", *([f"--read_lines={read_lines}"] if read_lines else []), *extra]
        process_s = harness.run_decode(flags)["wall_s"]
        with open(stats) as f:
            b = json.load(f)
        row = {
            "benchmark": "decode_programs",
            "job": job + 1,
            "lines": args.lines,
            "first_line": job * args.lines,
            "read_lines": read_lines or "default",
            "cache_files": files(),
            "added_files": files() - before,
            "compiled": b["programs"]["compiled"],
            "loaded": b["programs"].get("loaded", 0),
            "process_s": round(process_s, 2),
            "target_tokens_per_s": b["target_tokens_per_s"],
            "decode_flags": extra,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = ["job", "first_line", "read_lines", "cache_files", "added_files", "compiled"]
    harness.table(rows, [*cols, "loaded", "process_s", "target_tokens_per_s"])


# --- the command line -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    # --measure first: each measure keeps the flags (and defaults) of the script it was.
    choose = argparse.ArgumentParser(add_help=False)
    choose.add_argument("--measure", choices=MEASURES, default="pace", help="see the docstring")
    measure = choose.parse_known_args(argv)[0].measure
    add_flags, run = {
        "pace": (pace_flags, pace),
        "memory": (memory_flags, memory),
        "resume": (resume_flags, resume),
        "programs": (programs_flags, programs),
    }[measure]
    p = argparse.ArgumentParser(description=run.__doc__.splitlines()[0], parents=[choose])
    add_flags(p)
    args, rest = p.parse_known_args(argv)
    run(p, args, decode_flags(rest))


if __name__ == "__main__":
    main()

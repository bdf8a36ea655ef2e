"""Our JAX decoder against CTranslate2 (float32 and int8) on the same weights and sentences.

    python bench/decode_cpu.py --workdir=workdir/tiny            # Ding test set, beam 4
    python bench/decode_cpu.py --workdir=workdir/tiny --repeats=3 --threads=2 \
        --backends=jax,jax-average-count,ct2-float32     # ours, ours as CTranslate2, it
    python bench/decode_cpu.py --workdir=workdir/tiny --score --backends=jax,ct2-float32
    python bench/decode_cpu.py --workdir=workdir/tiny --splits=test,dev ...  # 2,000 sentences

Each backend is decode.py as a user runs it, in a fresh process, on the Ding
test split's 1,000 sources with their references (--splits=test,dev: 2,000):
`--workdir` (our decoder; `jax` with its default GNMT length penalty and exact stop,
`-average` with CTranslate2's penalty, `-heuristic` with `--stop=heuristic`, `-count`
with CTranslate2's stop, `--stop=count`: `jax-average-count` searches by CTranslate2's rules,
the same search problem), or `--ct2` on a directory `--export_ct2`
wrote from the same checkpoint (`ct2-float32`, `ct2-int8`, ...; exported once
into --scratch). Runs are interleaved (backend by backend, repeat after repeat)
so that load from other processes falls on all of them alike; the median is kept.

Per backend: decode.py's own summary rates (translation only: no start-up), the
process's wall and CPU seconds (CPU seconds of all its threads: the measure to
compare when other processes share the cores; `uptime`'s load is recorded
before and after), BLEU and chrF, and the share of output lines identical to
`jax-average-count`'s when it runs, else to `jax-average`'s (CTranslate2's length
penalty, our stop). JAX runs use decode.py's persistent compilation cache (or
--compilation_cache=DIR|off), filled by --warmup rounds that are not counted:
what a user's second run of a model costs.

--score: each backend scores the references (`decode.py --score`) instead of
translating; its rates count target tokens, and `within_1e-3_pct` is the share of
lines whose score is within 1e-3 (relative) of the first backend's.
Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE_PY = os.path.join(ROOT, "decode.py")
SCORE = re.compile(r"^(BLEU|chrF) = ([\d.]+)", re.M)


def load() -> float:
    """The 1-minute load average (other processes on the cores)."""
    return os.getloadavg()[0]


def decode(args: list[str]) -> dict:
    """One decode.py process: its rates, wall seconds, scores."""
    load_before = load()
    row = harness.run_decode(args)
    scores = {k.lower(): float(v) for k, v in SCORE.findall(row["stdout"])}
    keys = ("wall_s", "translate_s", "sentences_per_s", "tokens_per_s")
    return {**{k: row[k] for k in keys}, "load": (load_before + load()) / 2, **scores}


def cpu_seconds_of(fn) -> tuple[dict, float]:
    """fn()'s result and the CPU seconds its child processes used."""
    before = os.times()
    result = fn()
    after = os.times()
    return result, (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )


def backend_flags(name: str, args: argparse.Namespace, ct2_dirs: dict[str, str]) -> list[str]:
    kind, *parts = name.split("-")
    stops = [x for x in parts if x in ("heuristic", "count")]
    if kind == "jax" and set(parts) <= {"average", "heuristic", "count"} and len(stops) < 2:
        flags = [f"--workdir={args.workdir}"]
        flags += ["--length_penalty=average"] if "average" in parts else []
        flags += [f"--stop={stops[0]}"] if stops else []
    elif name.startswith("ct2-"):
        flags = [f"--ct2={ct2_dirs[name]}", f"--threads={args.threads}"]
    else:
        raise SystemExit(
            f"unknown backend {name!r} (jax[-average][-heuristic|-count], ct2-QUANTIZATION)"
        )
    if name.startswith("jax") and args.compilation_cache:
        flags.append(f"--compilation_cache={args.compilation_cache}")
    return flags


def export(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """The checkpoint as CTranslate2 directories, one per quantization asked for."""
    dirs = {}
    for name in names:
        if not name.startswith("ct2-"):
            continue
        quantization = name.removeprefix("ct2-")
        d = os.path.join(args.scratch, f"ct2_{quantization}")
        dirs[name] = d
        r = subprocess.run(
            [
                sys.executable,
                DECODE_PY,
                f"--workdir={args.workdir}",
                f"--export_ct2={d}",
                f"--quantization={quantization}",
            ],
            capture_output=True,
            env={**os.environ, "PYTHONPATH": ROOT},
            cwd=ROOT,
        )
        if r.returncode != 0:
            raise SystemExit(r.stderr.decode()[-2000:])
    return dirs


def agreement(a: str, b: str) -> float:
    """Percent of lines of two output files that are identical."""
    with open(a) as fa, open(b) as fb:
        x, y = fa.read().split("\n"), fb.read().split("\n")
    return 100 * sum(p == q for p, q in zip(x, y, strict=True)) / len(x)


def within(a: str, b: str, rtol: float = 1e-3) -> float:
    """Percent of lines of two --score outputs whose scores agree within `rtol`."""
    with open(a) as fa, open(b) as fb:
        x, y = ([json.loads(line)["score"] for line in f] for f in (fa, fb))
    ok = [p == q or (p is not None and q is not None and abs(p - q) <= rtol * abs(q))
          for p, q in zip(x, y, strict=True)]  # fmt: skip
    return 100 * sum(ok) / len(ok)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="workdir/tiny")
    p.add_argument(
        "--backends",
        default="jax,jax-heuristic,jax-average,jax-average-count,ct2-float32,ct2-int8",
    )
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="CTranslate2's --threads")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--compilation_cache", default=None, help="decode.py's, for jax runs")
    p.add_argument("--warmup", type=int, default=1, help="uncounted rounds first")
    p.add_argument("--scratch", default=None, help="inputs, exports, outputs (default: tmp)")
    p.add_argument("--score", action="store_true", help="score the references instead")
    p.add_argument("--splits", default="test", help="Ding splits, comma-separated, in order")
    args = p.parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="decode_cpu_")
    os.makedirs(args.scratch, exist_ok=True)
    names = args.backends.split(",")

    from attention_jax.data.corpora import prepare_ding

    ding, splits = prepare_ding(), args.splits.split(",")
    if unknown := [x for x in splits if x not in ("train", "dev", "test")]:
        raise SystemExit(f"--splits: {unknown} are not Ding splits (train, dev, test)")
    pairs = [pair for split in splits for pair in ding[split]]
    src, ref = os.path.join(args.scratch, "test.de"), os.path.join(args.scratch, "test.en")
    with open(src, "w") as f:
        f.writelines(de.replace("\n", " ") + "\n" for de, _ in pairs)
    with open(ref, "w") as f:
        f.writelines(en.replace("\n", " ") + "\n" for _, en in pairs)
    ct2_dirs = export(args, names)

    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(-args.warmup, args.repeats):
        for name in names:
            out = os.path.join(args.scratch, f"{name}.out")
            job = [f"--reference={ref}", f"--beam_size={args.beam_size}"]
            job = [f"--score={ref}"] if args.score else job
            flags = [
                *backend_flags(name, args, ct2_dirs),
                f"--input={src}",
                f"--output={out}",
                *job,
            ]
            result, cpu = cpu_seconds_of(lambda flags=flags: decode(flags))
            result["cpu_s"] = cpu
            print(f"# {name} run {repeat + 1}: {result}", file=sys.stderr)
            if repeat >= 0:
                runs[name].append(result)
    rows = []
    reference = next((n for n in ("jax-average-count", "jax-average") if n in names), None)
    for name in names:
        row = {"backend": name}
        for key in runs[name][0]:
            row[key] = statistics.median(r[key] for r in runs[name])
        tokens = row["tokens_per_s"] * row["translate_s"]
        row["tokens_per_cpu_s"] = tokens / row["cpu_s"]
        if args.score:
            row["within_1e-3_pct"] = within(
                os.path.join(args.scratch, f"{name}.out"),
                os.path.join(args.scratch, f"{names[0]}.out"),
            )
        elif reference is not None:
            row["same_lines_pct"] = agreement(
                os.path.join(args.scratch, f"{name}.out"),
                os.path.join(args.scratch, f"{reference}.out"),
            )
        rows.append(row)
    meta = {
        "input": f"ding {'+'.join(splits)} split, {len(pairs)} sentences",
        "workdir": args.workdir,
        "job": "score the references" if args.score else "translate",
        "beam_size": args.beam_size,
        "ct2_threads": args.threads,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "cpus": os.cpu_count(),
        "machine": harness.host_cpu(),
        "scratch": args.scratch,
    }
    columns = ["backend", "tokens_per_s", "sentences_per_s", "translate_s", "wall_s", "cpu_s",
               "tokens_per_cpu_s", "bleu", "chrf", "same_lines_pct", "within_1e-3_pct",
               "load"]  # fmt: skip
    harness.report("decode_cpu", meta, rows, columns)


if __name__ == "__main__":
    main()

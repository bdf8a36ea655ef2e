"""decode.py killed at 60% of a job and run again: what the re-run costs against the
whole job, and whether the output is the uninterrupted run's.

    python bench/decode_resume.py --workdir=workdir/tiny --split=train --lines=5000,12000

Per input size: a run that fills the compilation cache (not timed), the whole job
timed, then the same command killed (SIGKILL) once the output's record and journal
(inference/resume.py) count 60% of the lines, and run again, timed. Prints one JSON
object per size, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.decode_file import split_sources, write_input  # noqa: E402


def lines_done(output: str) -> int:
    """Lines the output's record counts, plus the sources its journal holds."""
    done = 0
    try:
        with open(output + ".partial.json") as f:
            done = json.load(f).get("done", {}).get("lines", 0)
    except (OSError, ValueError):
        pass
    try:
        with open(output + ".partial.journal") as f:
            for line in f:
                with contextlib.suppress(ValueError, KeyError):  # a torn line
                    done += len(json.loads(line)["i"])
    except OSError:
        pass
    return done


def decode(cmd: list[str], kill_at: int | None = None, output: str = "") -> float:
    """Run cmd to its end (or SIGKILL it once `kill_at` lines are done); seconds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_at is None:
        _, err = proc.communicate()
        if proc.returncode:
            sys.exit(f"decode.py failed:\n{err[-2000:]}")
        return time.perf_counter() - t0
    while proc.poll() is None and lines_done(output) < kill_at:
        time.sleep(0.05)
    if proc.poll() is not None:
        sys.exit(f"decode.py ended before {kill_at} lines were done")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--split", default="train", choices=["train", "dev", "test"])
    p.add_argument("--lines", default="5000,12000")
    p.add_argument("--at", type=float, default=0.6, help="kill once this share is done")
    p.add_argument("--scratch", default="/tmp/decode-resume")
    args, extra = p.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    os.makedirs(args.scratch, exist_ok=True)
    sources = split_sources(args.workdir, args.split)
    rows = []
    for n in (int(x) for x in args.lines.split(",")):
        source = os.path.join(args.scratch, f"in{n}.txt")
        write_input(source, sources, n)
        out = os.path.join(args.scratch, f"out{n}.txt")
        cache = os.path.join(args.scratch, "cache")
        cmd = [sys.executable, os.path.join(ROOT, "decode.py"), f"--workdir={args.workdir}"]
        cmd += [f"--input={source}", f"--output={out}", f"--compilation_cache={cache}", *extra]
        decode([*cmd, "--restart"])  # fills the compilation cache
        whole_s = decode([*cmd, "--restart"])
        with open(out, "rb") as f:
            whole = f.read()
        os.remove(out)
        killed_s = decode(cmd, kill_at=int(args.at * n), output=out)
        at = lines_done(out)
        rerun_s = decode(cmd)
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
    print("  ".join(f"{c:>15}" for c in [*cols, "identical_output"]))
    for r in rows:
        print("  ".join(f"{r[c]!s:>15}" for c in [*cols, "identical_output"]))


if __name__ == "__main__":
    main()

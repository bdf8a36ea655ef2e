"""Seeded bugs: plant each of a handful of real bugs in the code, run the tests, and check
that they fail. A suite made faster must still catch every one of them.

    .venv/bin/python tests/seeded_bugs.py            # the modules named per bug (~3 min)
    .venv/bin/python tests/seeded_bugs.py --whole    # the whole fast suite per bug, -x

Each bug is one textual edit of one file, undone afterwards (also on Ctrl-C); the
script refuses to run on a file with uncommitted changes. Prints one JSON line per
bug and a table; exit status 1 if any bug went unnoticed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    path: str
    old: str
    new: str
    modules: tuple[str, ...]  # where the suite should notice it


BUGS = (
    Bug(
        "look-ahead mask off by one (a query sees the next token)",
        "model/attention.py",
        "lower = jnp.tril(jnp.ones((t, t), dtype=bool))",
        "lower = jnp.tril(jnp.ones((t, t), dtype=bool), k=1)",
        ("tests/test_attention.py", "tests/test_model.py"),
    ),
    Bug(
        "wrong GNMT length penalty ((1 + |Y|) / 6 instead of (5 + |Y|) / 6)",
        "search/scoring.py",
        "((5.0 + length) / 6.0) ** alpha",
        "((1.0 + length) / 6.0) ** alpha",
        ("tests/test_decoding.py", "tests/test_translate.py"),
    ),
    Bug(
        "streaming drops an input's last line when it has no newline",
        "inference/lines.py",
        "            if not raw:\n                break",
        '            if not raw.endswith(b"\\n"):\n                break',
        ("tests/test_stream_parts.py", "tests/test_decode_stream.py"),
    ),
    Bug(
        "a training resume skips a batch (the data position restored one ahead)",
        "data/pipeline.py",
        'self.position = int(state["position"])',
        'self.position = int(state["position"]) + 1',
        ("tests/test_data_pipeline.py", "tests/test_train_loop.py"),
    ),
    Bug(
        "a decode resume takes an earlier chunk's journal for the running one",
        "inference/output.py",
        'if entry.get("at") != self.at:',
        'if entry.get("at") > self.at:',
        ("tests/test_stream_parts.py", "tests/test_decode_stream.py"),
    ),
    Bug(
        "a checkpoint is moved aside on a storage error (not damage)",
        "training/checkpoint_errors.py",
        "in _STORAGE_STATUS):\n            return STORAGE",
        "in _STORAGE_STATUS):\n            return DAMAGED",
        ("tests/test_restore_faults.py",),
    ),
)


def _dirty(path: str) -> bool:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", path], cwd=ROOT, capture_output=True, text=True
    )
    return bool(out.stdout.strip())


def _run_tests(modules: tuple[str, ...], jobs: int) -> tuple[int, list[str], str]:
    """(exit status, failed test ids, the summary line) of pytest -x on `modules`."""
    targets = list(modules) or []
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    cmd += ["-n", str(jobs), "--dist", "loadfile", *targets] if jobs > 1 else targets
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    lines = proc.stdout.strip().splitlines()
    return proc.returncode, failed, lines[-1] if lines else proc.stderr[-300:]


def plant(bug: Bug, whole: bool, jobs: int) -> dict:
    """Edit the file, run the tests, undo the edit: what the tests said."""
    path = os.path.join(ROOT, bug.path)
    with open(path, encoding="utf-8") as f:
        original = f.read()
    if original.count(bug.old) != 1:
        raise SystemExit(f"{bug.path}: the text to change is not there once: {bug.old!r}")
    start = time.time()
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original.replace(bug.old, bug.new))
        status, failed, summary = _run_tests(() if whole else bug.modules, jobs)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
    return {
        "bug": bug.name,
        "file": bug.path,
        "tests": "the fast suite" if whole else list(bug.modules),
        "caught": status != 0 and bool(failed),
        "failed": failed,
        "summary": summary,
        "seconds": round(time.time() - start, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--whole", action="store_true", help="run the whole fast suite per bug")
    parser.add_argument("--jobs", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--only", default="", help="run the bugs whose name contains this")
    args = parser.parse_args()
    bugs = [b for b in BUGS if args.only in b.name]
    dirty = [b.path for b in bugs if _dirty(os.path.join(ROOT, b.path))]
    if dirty:
        raise SystemExit(f"commit or stash your changes first: {', '.join(sorted(set(dirty)))}")
    records = []
    for bug in bugs:
        record = plant(bug, args.whole, args.jobs)
        print(json.dumps(record), flush=True)
        records.append(record)
    print("\n| seeded bug | file | caught by | seconds |\n|---|---|---|---|")
    for r in records:
        caught = ", ".join(f"`{t.split('::')[-1]}`" for t in r["failed"][:2]) or "**nothing**"
        print(f"| {r['bug']} | `{r['file']}` | {caught} | {r['seconds']} |")
    missed = [r["bug"] for r in records if not r["caught"]]
    print(f"\n{len(records) - len(missed)}/{len(records)} seeded bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

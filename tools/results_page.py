"""docs/results.md from bench/results/: every measured number, as tables, newest first.

    python tools/results_page.py            # writes docs/results.md
    python tools/results_page.py --check    # exit 1 if docs/results.md is out of date

A results file is named MACHINE-YYYYMMDD-COMMIT[-LABEL].{jsonl,json}: a benchmark's
JSON lines (one object a run, its rows under "results" when it has several), a
train run's metrics.jsonl (summed up: steps, losses, throughput, BLEU), or a GPU
suite's summary (its steps and their outcome). tests/test_results_page.py keeps
the page up to date.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
NAME = re.compile(
    r"^(?P<machine>.+?)-(?P<date>\d{8})-(?P<commit>[0-9a-f]{7,})(?:-(?P<label>.+?))?$"
)
# Long or nested fields that say how a run was set up rather than what it measured.
SKIP = {"device", "configs", "xla_flags", "env", "results", "note", "machine", "date"}
SKIP |= {"benchmark", "command"}  # in the line above each table
MAX_COLUMNS = 9
BLEU_KEYS = ("eval_bleu", "dev_bleu", "bleu")

HEADER = """# Results

Every number measured for this project, generated from the JSON lines in
`bench/results/` by `python tools/results_page.py` (do not edit by hand). Each
section is one file: the machine, the date and the commit are in its name, the
command in its lines. Newest first.
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value, separators=(",", ":"))
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table of the rows' scalar fields, in their first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in SKIP and k not in columns]
    columns = columns[:MAX_COLUMNS]
    if not columns:
        return []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return lines


def _metrics(rows: list[dict[str, Any]]) -> list[str]:
    """A train run's metrics.jsonl, summed up."""
    train = [r for r in rows if "train_loss" in r]
    evals = [r for r in rows if any(r.get(k) is not None for k in BLEU_KEYS)]
    summary: dict[str, Any] = {"rows": len(rows)}
    if train:
        speed = [r["tokens_per_sec"] for r in train if "tokens_per_sec" in r]
        summary.update(
            last_step=train[-1]["step"],
            first_loss=train[0]["train_loss"],
            last_loss=train[-1]["train_loss"],
            mean_tokens_per_sec=sum(speed) / len(speed) if speed else "",
        )
    if evals:
        bleus = [next(r[k] for k in BLEU_KEYS if r.get(k) is not None) for r in evals]
        summary.update(best_dev_bleu=max(bleus), last_dev_bleu=bleus[-1])
    return table([summary])


def _suite(data: dict[str, Any]) -> list[str]:
    """A GPU suite's summary: each step and its outcome."""
    steps = data.get("steps", [])
    rows = [{k: v for k, v in s.items() if not isinstance(v, (dict, list))} for s in steps]
    versions = data.get("env", {}).get("versions", {})
    head = [f"jax {versions['jax']}"] if "jax" in versions else []
    return [*head, "", *table(rows)] if rows else head


def _benchmark_lines(rows: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for row in rows:
        name = row.get("benchmark", "run")
        what = ", ".join(f"{k} {_cell(v)}" for k, v in row.items() if k in ("command", "note"))
        out += [f"**{name}**" + (f": {what}" if what else ""), ""]
        out += table([row]) if "results" not in row else table(row["results"])
        out.append("")
    return out


def section(path: str) -> list[str]:
    """The markdown of one results file."""
    base = os.path.basename(path)
    stem = re.sub(r"\.(metrics\.jsonl|suite\.json|jsonl|json)$", "", base)
    m = NAME.match(stem)
    title = base if m is None else (
        f"{m['machine']}, {m['date'][:4]}-{m['date'][4:6]}-{m['date'][6:]}, commit {m['commit']}"
        + (f": {m['label']}" if m["label"] else "")
    )  # fmt: skip
    lines = [f"## {title}", "", f"`bench/results/{base}`", ""]
    with open(path, encoding="utf-8") as f:
        if base.endswith(".json"):
            body = _suite(json.load(f))
        else:
            rows = [json.loads(line) for line in f if line.strip()]
            body = _metrics(rows) if base.endswith(".metrics.jsonl") else _benchmark_lines(rows)
    return lines + body + [""]


def render(directory: str = RESULTS) -> str:
    """The whole page, newest file first (by the date in its name, then its name)."""
    names = [n for n in os.listdir(directory) if n.endswith((".jsonl", ".json"))]

    def key(name: str) -> tuple[str, str]:
        m = NAME.match(name.split(".")[0])
        return (m["date"] if m else "", name)

    parts = [HEADER]
    for name in sorted(names, key=key, reverse=True):
        parts.append("\n".join(section(os.path.join(directory, name))).rstrip() + "\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = render()
    if args.check:
        with open(PAGE, encoding="utf-8") as f:
            stale = f.read() != page
        if stale:
            print("docs/results.md is out of date: run python tools/results_page.py")
        return int(stale)
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

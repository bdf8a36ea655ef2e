"""docs/results.md, its pages and the README's results table, all from bench/results/.

    python tools/results_page.py            # writes docs/results*, the README's table
    python tools/results_page.py --check    # exit 1 if any is out of date

A results file is named MACHINE-YYYYMMDD-COMMIT[-LABEL].{jsonl,json}: a benchmark's
JSON lines (one object a run, its rows under "results" when it has several), a
train run's metrics.jsonl (summed up: steps, losses, throughput, BLEU), or a GPU
suite's summary (its steps and their outcome).

docs/results/MACHINE.md shows every file of a machine, newest first: one line per
run, its rows inline; docs/results.md lists the machines (so that no page grows
past what a reader takes in as results accumulate). The README's table shows the
`HEADLINES` below, each a value picked from one file, with the file's command,
hardware, commit and date. tests/test_results_page.py keeps them all current.
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
DOCS = os.path.join(ROOT, "docs")
PAGE = os.path.join(DOCS, "results.md")  # the index; a page per machine in docs/results/
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
NAME = re.compile(
    r"^(?P<machine>.+?)-(?P<date>\d{8})-(?P<commit>[0-9a-f]{7,})(?:-(?P<label>.+?))?$"
)
# Fields that say where and how a run was made, not what it measured.
SETUP = {"device", "configs", "xla_flags", "env", "machine", "date", "commit", "jax"}
SETUP |= {"benchmark", "command", "note", "results", "platform", "num_devices"}
BLEU_KEYS = ("eval_bleu", "dev_bleu", "bleu")
MACHINE_ORDER = ("nvidia", "cpu-zen5")  # GPUs first, then the CPU box of CI, then the rest

HEADER = """# Results

Every number measured for this project, generated from the JSON lines in
`bench/results/` by `python tools/results_page.py` (do not edit by hand). Each
machine has a page, its files newest first; each line is one run: its benchmark,
its command, then what it measured (several rows separated by `·`). The machine,
date, commit and label are in the file's name, which each entry links. A command
whose script is no longer in the repository says so, with the `git show` that
gives the script as it ran.
"""
MACHINE_HEADER = (
    "Generated from `bench/results/` by `python tools/results_page.py` (do not edit by "
    "hand); [every machine](../results.md)."
)
# A script a command runs: bench/, tools/ or tests/ code.
SCRIPT = re.compile(r"(?<![\w./-])((?:bench|tools|tests)/[\w./-]+\.(?:py|sh))\b")
# Scripts that results ran and that are gone: the last commit that holds each (the
# parent of the one that removed it; tests/test_results_page.py checks them with git).
GONE = {
    "bench/decode_steps.py": "318430e",
    "bench/decode_stream.py": "2b3c22e",
    "bench/flax_wmt.py": "318430e",
    "bench/gpu_ding.sh": "46ad127",
    "bench/host_step.py": "2b3c22e",
    "bench/trace_summary.py": "46ad127",
}

# The README's table: (what, file stem, the run's fields to match, result index, format).
HEADLINES: list[tuple[str, str, dict[str, Any], int | None, str]] = [
    ("`make train` (tiny on Ding), then `make decode`", "cpu-zen5-20261129-9b2eceb-make-train",
     {"benchmark": "make train"}, None, "{wall_s} s; dev BLEU {dev_bleu}, test BLEU {test_bleu}"),
    ("`make decode`, first run after `make train`", "cpu-zen5-20261129-9b2eceb-make-train",
     {"benchmark": "make decode", "run": "first after make train"}, None,
     "{wall_s} s for {lines} lines"),
    ("`make decode`, again", "cpu-zen5-20261129-fe8c937-decode",
     {"benchmark": "make decode", "run": "again"}, None, "{wall_s} s for {lines} lines"),
    ("decode.py against CTranslate2 float32, Ding test, beam 4, 2 cores",
     "cpu-zen5-20261129-fe8c937-decode-cpu", {"benchmark": "decode_cpu"}, None,
     "CTranslate2 is {ct2_over_jax_same_rules}x as fast searching by its rules, "
     "{ct2_over_jax}x against our defaults"),
    ("the same on 2,000 sentences (Ding test and dev; the goal's measure)",
     "cpu-zen5-20261129-fe8c937-decode-cpu-2000", {"benchmark": "decode_cpu", "run": 2}, None,
     "CTranslate2 is {ct2_over_jax_same_rules}x as fast by its rules, the slower of two runs ("
     "{ct2_over_jax_cpu_s_same_rules}x in CPU seconds), {ct2_over_jax}x against our defaults "
     "(goal: 1.5x)"),
    ("decode.py on 10,000 lines, programs compiled", "cpu-zen5-20261127-144cd11-programs",
     {"run": "warm", "lines": 10000}, None,
     "{target_tokens_per_s} target tokens/s; host share {host_share}"),
    ("decode.py on 8,000 more lines in 1,000-line chunks", "cpu-zen5-20261127-144cd11-programs",
     {"benchmark": "decode_programs", "job": 2}, None,
     "{added_files} files added to the cache (the first job's: 12); {compiled} compiled"),
    ("`--constraints` and `--prefix`, Ding test (1,500 phrases)",
     "cpu-zen5-20261127-2912302-constraints", {"benchmark": "constraints"}, None,
     "phrases met: {met_share}; BLEU {bleu_constrained} (plain {bleu_plain}); time "
     "x{cost_constrained}; prefixes as CTranslate2's: {prefix_equal_to_ct2}"),
    ("decode.py killed at 60% and re-run, 12,000 lines", "cpu-zen5-20261127-1c29c1a-pace",
     {"benchmark": "decode_resume", "lines": 12000}, None,
     "the re-run takes {rerun_share} of the whole job's time"),
    ("decode.py on 100,000 Ding lines, base, beam 4, programs compiled",
     "nvidia-h100-20261127-47f1ade-pace", {"benchmark": "decode.py", "run": "warm"}, None,
     "{target_tokens_per_s} target tokens/s, {process_s} s (goal: 30,000 target tokens/s)"),
    ("decode.py on the same 100,000 lines, empty cache", "nvidia-h100-20261127-47f1ade-pace",
     {"benchmark": "decode.py", "run": "cold"}, None,
     "{process_s} s, {programs_critical_s} s of it waiting for programs (goal: 90 s)"),
    ("train step, base, 32,768-token packed batches", "nvidia-h100-20261127-47f1ade-mfu",
     {"benchmark": "train"}, 0,
     "{tgt_tokens_per_s} target tokens/s, {step_ms} ms; {tflops_over_780} of 780 TFLOP/s"),
    ("train.py, base on Ding, 8,192-token packed batches", "nvidia-h200-20261127-190dd07-pace",
     {"benchmark": "train.py_ding_base"}, None,
     "{steps_per_sec} steps/s, {tokens_per_sec} target tokens/s"),
    ("base on Ding, 5,050 steps (6.5 min), test set", "nvidia-h100-20261126-c02d827-ding-base",
     {"benchmark": "ding_base_decode", "split": "test"}, None, "BLEU {bleu}, chrF {chrf}"),
    ("importing an OPUS-MT-sized model", "cpu-xeon-20261128-64a0a45-marian",
     {"benchmark": "marian_import", "commit": "64a0a45"}, 2, "{load_s} s"),
    ("`make test` (the fast suite), empty caches", "cpu-zen5-20261129-9b2eceb-make-test",
     {"benchmark": "make test"}, None, "{test_s} s: {tests}"),
    ("`bash .ci/run` (lint, fast, slow and floor tests)", "cpu-zen5-20261129-54ae08e-ci",
     {"benchmark": ".ci/run"}, None, "{wall_s} s"),
]  # fmt: skip


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value, separators=(",", ":"))
    return str(value).replace("|", "\\|").replace("\n", " ")


def _fields(row: dict[str, Any]) -> str:
    """`key value, key value` of a row's measured fields, in its order."""
    return ", ".join(f"{k} {_cell(v)}" for k, v in row.items() if k not in SETUP)


def _metrics(rows: list[dict[str, Any]]) -> str:
    """A train run's metrics.jsonl, summed up in one line."""
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
    return f"  - **train metrics**: {_fields(summary)}"


def _suite(data: dict[str, Any]) -> list[str]:
    """A GPU suite's summary: one line per step and its outcome."""
    out = []
    for step in data.get("steps", []):
        scalars = {k: v for k, v in step.items() if not isinstance(v, (dict, list))}
        out.append(f"  - {_fields(scalars)}")
    return out


def gone_scripts(command: str) -> list[str]:
    """The scripts `command` runs that are not in the repository now."""
    return [p for p in dict.fromkeys(SCRIPT.findall(command)) if not os.path.exists(_path(p))]


def _path(script: str) -> str:
    return os.path.join(ROOT, *script.split("/"))


def _runs(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run: benchmark, command (and which of its scripts are gone, and where
    to get them), note, then its fields or its rows."""
    out = []
    for row in rows:
        head = f"  - **{row.get('benchmark', 'run')}**"
        if row.get("command"):
            head += f" `{_cell(row['command']).replace('`', '')}`"
            gone = gone_scripts(row["command"])
            if gone:
                shows = ", ".join(f"`git show {GONE[p]}:{p}`" if p in GONE else p for p in gone)
                head += f" (no longer in the repository: {shows})"
        if row.get("note"):
            head += f" ({_cell(row['note'])})"
        body = _fields(row)
        if "results" in row:
            body = "; ".join(x for x in [body, " · ".join(map(_fields, row["results"]))] if x)
        out.append(f"{head}: {body}" if body else head)
    return out


def _stem(name: str) -> str:
    return re.sub(r"\.(metrics\.jsonl|suite\.json|jsonl|json)$", "", name)


def entry(path: str) -> list[str]:
    """The lines of one results file: a bullet with its date, commit and label, then
    one sub-bullet per run."""
    base = os.path.basename(path)
    m = NAME.match(_stem(base))
    when = f"{_dashed(m['date'])}, {m['commit']}" if m else base
    label = f", {m['label']}" if m and m["label"] else ""
    lines = [f"- {when}{label}: [`{base}`](../../bench/results/{base})"]
    with open(path, encoding="utf-8") as f:
        if base.endswith(".json"):
            return lines + _suite(json.load(f))
        rows = [json.loads(line) for line in f if line.strip()]
    if base.endswith(".metrics.jsonl"):
        return [*lines, _metrics(rows)]
    return lines + _runs(rows)


def _machine_key(machine: str) -> tuple[int, str]:
    for rank, prefix in enumerate(MACHINE_ORDER):
        if machine.startswith(prefix):
            return rank, machine
    return len(MACHINE_ORDER), machine


def render(directory: str = RESULTS) -> dict[str, str]:
    """The pages, by path under docs/: results.md (the machines, each with its count of
    files and their dates) and results/MACHINE.md per machine (its files newest first)."""
    by_machine: dict[str, list[str]] = {}
    for name in os.listdir(directory):
        if name.endswith((".jsonl", ".json")):
            m = NAME.match(_stem(name))
            by_machine.setdefault(m["machine"] if m else "other", []).append(name)
    pages, index = {}, [HEADER, "## Machines", ""]
    for machine in sorted(by_machine, key=_machine_key):
        names = sorted(by_machine[machine], key=lambda n: (_date(n), n), reverse=True)
        dates = sorted({_dashed(_date(n)) for n in names if _date(n)})
        span = f", {dates[0]} to {dates[-1]}" if dates else ""
        files = f"{len(names)} file{'s' if len(names) > 1 else ''}"
        index.append(f"- [{machine}](results/{machine}.md): {files}{span}")
        lines = [f"# Results on {machine}", "", MACHINE_HEADER, ""]
        for name in names:
            lines += entry(os.path.join(directory, name))
        pages[f"results/{machine}.md"] = "\n".join(lines) + "\n"
    return {"results.md": "\n".join(index) + "\n", **pages}


def _date(name: str) -> str:
    m = NAME.match(_stem(name))
    return m["date"] if m else ""


def _dashed(date: str) -> str:
    """YYYYMMDD -> YYYY-MM-DD."""
    return f"{date[:4]}-{date[4:6]}-{date[6:]}"


# --- The README's table ----------------------------------------------------------------


def _record(directory: str, stem: str, match: dict[str, Any], index: int | None) -> dict:
    """The first run in bench/results/STEM.jsonl whose fields equal `match`'s, merged with
    its results[index] when given (KeyError naming what is missing)."""
    with open(os.path.join(directory, f"{stem}.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line) if line.strip() else {}
            if row and all(row.get(k) == v for k, v in match.items()):
                return {**row, **(row["results"][index] if index is not None else {})}
    raise KeyError(f"{stem}.jsonl has no run with {match}")


def headline_table(directory: str = RESULTS) -> str:
    """The README's results table (markdown), from `HEADLINES`."""
    lines = ["| what | result | hardware | command | commit, date |", "|---|---|---|---|---|"]
    for what, stem, match, index, fmt in HEADLINES:
        row = _record(directory, stem, match, index)
        m = NAME.match(stem)
        result = fmt.format(**{k: _cell(v) for k, v in row.items()})
        machine = _cell(row.get("machine") or row.get("device") or m["machine"])
        date = _dashed(m["date"])
        command = _cell(row.get("command", "")).replace("`", "")
        command = f"`{command}`" if command else ""
        link = f"[{m['commit']}, {date}](bench/results/{stem}.jsonl)"
        lines.append(f"| {what} | {result} | {machine} | {command} | {link} |")
    return "\n".join(lines) + "\n"


def with_table(readme: str, table: str) -> str:
    """README.md's text with the table between its BEGIN and END markers replaced."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + table + readme[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any is stale")
    args = parser.parse_args()
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    wanted = {os.path.join(DOCS, *name.split("/")): text for name, text in render().items()}
    wanted[README] = with_table(readme, headline_table())
    pages = os.path.join(DOCS, "results")
    kept = {os.path.join(pages, n) for n in os.listdir(pages)} if os.path.isdir(pages) else set()
    stale = sorted(kept - set(wanted))  # the page of a machine no file names any more
    for path, text in wanted.items():
        old = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = f.read()
        if old != text:
            stale.append(path)
        if not args.check and old != text:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if args.check:
        for path in stale:
            print(f"{os.path.relpath(path, ROOT)} is out of date: run python tools/results_page.py")
        return int(bool(stale))
    for path in kept - set(wanted):
        os.remove(path)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}, its pages and the table in README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

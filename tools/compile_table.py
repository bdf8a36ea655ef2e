"""The README's table of `train.py --compile_for` reports (tools/compile_targets.sh).

    python tools/compile_table.py docs/aot/compile-20261124-*.jsonl

Reads the JSON reports, one a line, and prints one JSON object (a row per config
and target, and the parameter + optimizer bytes per chip of each FSDP config on
its smallest and largest slice against 1/N) on stdout, then the markdown tables
on stderr. Nothing is compiled here.
"""

from __future__ import annotations

import json
import sys
from typing import Any

GIB = 2**30


def _program(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in report["programs"] if p["program"] == name)


def _comms(program: dict[str, Any]) -> str:
    parts = [
        f"{c['count']} {kind} {c['bytes'] / 2**20:,.0f} MiB"
        for kind, c in sorted(program["collectives"].items())
    ]
    return ", ".join(parts) or "none"


def row(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of one report that the table shows (bytes per chip, seconds)."""
    train = _program(report, "train_step")
    est = train["estimate"] or {}
    mesh = report["mesh"]
    return {
        "config": report["config"].removeprefix("configs/").removesuffix(".py"),
        "target": report["target"],
        "mesh": "x".join(str(mesh[a]) for a in ("data", "fsdp", "tensor")),
        "batch": "x".join(map(str, train["shape"])),
        "attention": report["attention_impl"],
        "state_gib": train["bytes"]["state"] / GIB,
        "temps_gib": train["bytes"]["temporaries"] / GIB,
        "total_gib": train["bytes"]["total"] / GIB,
        "usable_gib": report["usable_bytes_per_chip"] / GIB,
        "fits": report["fits"],
        "collectives": _comms(train),
        "all_to_all": train["collectives"].get("all-to-all", {}).get("count", 0),
        "matmul_dtypes": train["matmul_dtypes"],
        "cudnn_calls": train["cudnn_calls"],
        "compile_s": report["seconds"],
        "est_step_ms": est.get("step_s", 0) * 1e3,
        "est_tokens_per_s": est.get("padded_target_tokens_per_s", 0),
        "compiler": report["compiler"],
        "jax": report["jax"],
    }


def fsdp_scaling(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config run with every chip in fsdp: state bytes per chip, smallest vs largest
    slice, against the 1/N of the smallest."""
    out = []
    for config in sorted({r["config"] for r in reports}):
        runs = sorted(
            (r for r in reports if r["config"] == config and r["mesh"]["fsdp"] == r["devices"] > 1),
            key=lambda r: r["devices"],
        )
        if len(runs) < 2 or runs[0]["devices"] == runs[-1]["devices"]:
            continue
        small, large = runs[0], runs[-1]
        bytes_small = _program(small, "train_step")["bytes"]["state"]
        bytes_large = _program(large, "train_step")["bytes"]["state"]
        ideal = bytes_small * small["devices"] / large["devices"]
        out.append({
            "config": config, "devices": [small["devices"], large["devices"]],
            "state_bytes": [bytes_small, bytes_large], "ideal_bytes": ideal,
            "ratio_to_ideal": bytes_large / ideal,
        })  # fmt: skip
    return out


def markdown(rows: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> str:
    head = (
        "| config | target | mesh d x f x t | batch | attention | state GiB | temps GiB | "
        "total / usable GiB | fits | collectives (train step) | compile s | est. step ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['config']} | `{r['target']}` | {r['mesh']} | {r['batch']} | {r['attention']} "
            f"| {r['state_gib']:.2f} | {r['temps_gib']:.2f} | {r['total_gib']:.2f} / "
            f"{r['usable_gib']:.1f} | {'yes' if r['fits'] else '**no**'} | {r['collectives']} "
            f"| {r['compile_s']:.0f} | {r['est_step_ms']:.0f} |"
        )
    for s in scaling:
        a, b = s["devices"]
        lines.append(
            f"\n{s['config']}, fsdp over every chip: parameters + optimizer state "
            f"{s['state_bytes'][0] / 2**20:.1f} MiB per chip on {a} chips, "
            f"{s['state_bytes'][1] / 2**20:.2f} MiB on {b} (1/N: "
            f"{s['ideal_bytes'] / 2**20:.2f} MiB, x{s['ratio_to_ideal']:.3f})"
        )
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    reports = []
    for path in paths:
        with open(path) as f:
            reports += [json.loads(line) for line in f if line.strip()]
    rows, scaling = [row(r) for r in reports], fsdp_scaling(reports)
    print(json.dumps({"benchmark": "compile_table", "rows": rows, "fsdp_scaling": scaling}))
    print(markdown(rows, scaling), file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

"""The ahead-of-time compile report for people: advice when it does not fit, and the table.

report = fit.compile_for(config, "tpu:v5e-8")   # aot/fit.py: the JSON report
report["advice"] = advice(report)
print(table(report), file=sys.stderr)
"""

from __future__ import annotations

from typing import Any


def advice(report: dict[str, Any]) -> list[str]:
    """What to change when a program does not fit (empty when everything fits)."""
    out = []
    usable = report["usable_bytes_per_chip"]
    train = [p for p in report["programs"] if p["program"] == "train_step" and not p["fits"]]
    if train:
        state = train[0]["bytes"]["state"]
        if state > 0.4 * usable:
            out.append(
                f"parameters + optimizer state take {state / 2**30:.1f} of {usable / 2**30:.1f} "
                "GiB per chip: shard them over more devices with --config.mesh_fsdp=N "
                "(and --config.mesh_data=-1 for the rest)"
            )
        out.append(
            "activations: --config.grad_accum_steps=k (the same batch in k micro-batches, "
            "temporaries about 1/k), --config.model.remat=True (recompute layers in the "
            "backward pass), or a smaller --config.batch_tokens (--find_batch finds the "
            "largest that fits)"
        )
    if any(p["program"] == "beam_search" and not p["fits"] for p in report["programs"]):
        out.append("decoding: a smaller decode.py --batch_tokens")
    return out


# --- The table -------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _collectives_text(comms: dict[str, dict[str, Any]]) -> str:
    if not comms:
        return "none"
    parts = []
    for kind, c in sorted(comms.items()):
        parts.append(f"{c['count']} {kind} {c['bytes'] / 2**20:,.0f} MiB")
    return ", ".join(parts)


def table(report: dict[str, Any]) -> str:
    """The report for people: one line per program, then the verdict and the advice."""
    mesh = " ".join(f"{k}={v}" for k, v in report["mesh"].items())
    head = (
        f"{report['config'] or 'config'} on {report['target']} ({report['devices']} x "
        f"{report['chip']}, {report['hosts']} host(s)); mesh {mesh}; "
        f"{report['params'] / 1e6:.1f}M params, {report['dtype']}, attention "
        f"{report['attention_impl']}; jax {report['jax']}, {report['compiler']}"
    )
    hbm = _gb(report["usable_bytes_per_chip"])
    cols = (
        f"{'program':<12} {'batch':>9} {'state':>6} {'temps':>6} {'total':>6} / {hbm:<6}"
        f" {'fits':>4} {'TFLOP':>7} {'compile':>8} {'est. step':>10}  collectives"
    )
    lines = [head, "per chip, GiB:", cols, "-" * len(cols)]
    for p in report["programs"]:
        b, est = p["bytes"], p["estimate"]
        step = f"{est['step_s'] * 1e3:.0f} ms" if est else "-"
        lines.append(
            f"{p['program']:<12} {'x'.join(map(str, p['shape'])):>9} {_gb(b['state']):>6} "
            f"{_gb(b['temporaries']):>6} {_gb(b['total']):>6}   {'':<6}"
            f" {'yes' if p['fits'] else 'NO':>4} {p['flops'] / 1e12:>7.2f}"
            f" {p['compile_seconds']:>7.0f}s {step:>10}  {_collectives_text(p['collectives'])}"
        )
    train = report["programs"][0]["estimate"]
    kernels = train and train.get("kernels")
    if kernels:
        lines.append(
            f"est. train step = {kernels['kernels']} kernels, each max(FLOPs / matmul rate, "
            f"bytes / bandwidth): GEMMs {kernels['gemm_s'] * 1e3:.0f} ms, attention "
            f"{kernels['attention_s'] * 1e3:.0f} ms, memory-bound {kernels['memory_s'] * 1e3:.0f}"
            f" ms; + collectives {train['collectives_s'] * 1e3:.0f} ms: "
            f"{train['padded_target_tokens_per_s']:,.0f} padded target tokens/s (an estimate, "
            "not a measurement: measured steps take longer, docs/aot.md)"
        )
    elif train:
        lines.append(
            f"est. train step = max(compute {train['compute_s'] * 1e3:.0f} ms, HBM "
            f"{train['hbm_s'] * 1e3:.0f} ms) + collectives {train['collectives_s'] * 1e3:.0f} "
            f"ms: {train['padded_target_tokens_per_s']:,.0f} padded target tokens/s (an "
            "estimate from datasheet peaks, not a measurement)"
        )
    if report["other_train_widths"]:
        lines.append(
            f"{report['other_train_widths']} narrower train width(s) are not compiled (fitted "
            "to the corpus at start; --compile_all_buckets compiles the default rule's)"
        )
    verdict = "fits" if report["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict}: compiled in {report['seconds']:.0f} s")
    lines += [f"  - {a}" for a in advice(report)]
    best = report.get("find_batch")
    if best:
        lines.append(
            f"find_batch: the largest batch that fits is --config.batch_tokens="
            f"{best['batch_tokens']} ({best['rows']} rows of {best['width']} tokens; "
            f"{len(best['probes'])} compiles)"
        )
    return "\n".join(lines)

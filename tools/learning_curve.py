"""Draw a run's learning curve from its metrics.jsonl: loss and dev BLEU against minutes.

    python tools/learning_curve.py --metrics=workdir/base/metrics.jsonl \
        --output=docs/images/learning_curve.png --title="base on Ding, one H100"

metrics.jsonl holds no wall-clock times, so the minutes are rebuilt from what
it does hold: each logged window of steps took (steps in it) / steps_per_sec
seconds (the first window includes compiling the train step) and each
evaluation took eval_seconds. Start-up before the first step (tokenizer,
planning) is not counted. Prints the points as JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def read_rows(path: str) -> list[dict[str, Any]]:
    """The JSON rows of a metrics.jsonl, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def curve_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per training window or evaluation: step, minutes since the first step,
    and train_loss or (eval_loss, eval_bleu, eval_chrf)."""
    points, seconds, last_step = [], 0.0, 0
    for row in rows:
        step = int(row["step"])
        if "train_loss" in row and row.get("steps_per_sec"):
            seconds += (step - last_step) / row["steps_per_sec"]
            last_step = step
            points.append({"step": step, "minutes": seconds / 60, "train_loss": row["train_loss"]})
        elif "eval_bleu" in row:  # evaluations (and averages, "avg_" keys, are left out)
            seconds += row.get("eval_seconds", 0.0)
            keys = ("eval_loss", "eval_bleu", "eval_chrf")
            points.append(
                {"step": step, "minutes": seconds / 60, **{k: row[k] for k in keys if k in row}}
            )
    return points


def draw(points: list[dict[str, Any]], output: str, title: str) -> None:
    """Two panels against minutes: train and dev loss; dev BLEU and chrF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [p for p in points if "train_loss" in p]
    dev = [p for p in points if "eval_bleu" in p]
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_loss.plot([p["minutes"] for p in train], [p["train_loss"] for p in train], label="train")
    ax_loss.plot([p["minutes"] for p in dev], [p["eval_loss"] for p in dev], "o-", label="dev")
    ax_loss.set(xlabel="minutes of training", ylabel="loss (label-smoothed, per token)")
    ax_loss.legend()
    ax_bleu.plot([p["minutes"] for p in dev], [p["eval_bleu"] for p in dev], "o-", label="BLEU")
    ax_bleu.plot([p["minutes"] for p in dev], [p["eval_chrf"] for p in dev], "s--", label="chrF")
    ax_bleu.set(xlabel="minutes of training", ylabel="dev score (sacreBLEU)")
    ax_bleu.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--metrics", required=True, help="a workdir's metrics.jsonl")
    parser.add_argument("--output", required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="the picture's title")
    args = parser.parse_args(argv)
    try:
        points = curve_points(read_rows(args.metrics))
    except (OSError, ValueError, KeyError) as e:
        print(f"learning_curve.py: cannot read {args.metrics}: {e}", file=sys.stderr)
        return 1
    if not any("eval_bleu" in p for p in points):
        print(f"learning_curve.py: {args.metrics} holds no evaluation rows", file=sys.stderr)
        return 1
    draw(points, args.output, args.title)
    for p in points:
        print(json.dumps(p))
    print("| step | minutes | train loss | dev loss | dev BLEU | dev chrF |")
    print("|---|---|---|---|---|---|")
    for p in points:
        cells = [
            f"{p[k]:.2f}" if k in p else ""
            for k in ("train_loss", "eval_loss", "eval_bleu", "eval_chrf")
        ]
        print(f"| {p['step']} | {p['minutes']:.2f} | " + " | ".join(cells) + " |")
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

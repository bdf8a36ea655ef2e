"""One JSON object for machines, then an aligned table for people: how every benchmark and
tool of this project prints its result (bench/harness.py hands it on to bench/).

    report("trace_summary", {"plane": plane}, rows, ["kind", "ms", "share", "count"])
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def report(name: str, meta: dict[str, Any], rows: Sequence[dict[str, Any]], columns: Sequence[str]):
    """Print one JSON object (machine-readable) then an aligned table (for people)."""
    print(json.dumps({"benchmark": name, **meta, "results": list(rows)}))
    table(rows, columns)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """The aligned table alone: a benchmark that prints a JSON line per run as it goes."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths, strict=True)))
    sys.stdout.flush()


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1e5:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)

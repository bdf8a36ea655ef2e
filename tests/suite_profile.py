"""Where the test suite's minutes go: seconds, XLA compiles and subprocesses per module.

    python -m pytest -p tests.suite_profile --suite-profile=suite.jsonl -n 2 --dist loadfile
    python tests/suite_profile.py suite.jsonl [--tests 20]    # the tables

As a pytest plugin it writes one JSON line per test (setup, call and teardown
seconds, and the `compiles`, their `compile_s`, `trace_s` and `lower_s` in the
test's process, the same by program name (`programs`), and the `subprocesses`
that tests/conftest.py records for it; with xdist, from the controller). As a
script it sums them per module, most expensive first, and lists the costliest
tests and programs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def pytest_addoption(parser):
    parser.addoption("--suite-profile", default=None, help="one JSON line per test, here")


def pytest_configure(config):
    path = config.getoption("--suite-profile")
    if path and not hasattr(config, "workerinput"):  # the controller sees every report
        config.pluginmanager.register(_Profile(path), "suite-profile")


class _Profile:
    def __init__(self, path: str):
        self.path = path
        self.rows: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        row = self.rows.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed"})
        row[f"{report.when}_s"] = round(report.duration, 3)
        if report.failed:
            row["outcome"] = "failed"
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        row.update({k: v for k, v in report.user_properties})

    def pytest_sessionfinish(self, session, exitstatus):
        with open(self.path, "w") as f:
            for row in self.rows.values():
                f.write(json.dumps(row) + "\n")


# This process's seconds in XLA's compiles, in tracing and in lowering (tests/conftest.py).
_JAX_SECONDS = ("compile_s", "trace_s", "lower_s")


def seconds(row: dict) -> float:
    return sum(row.get(f"{w}_s", 0.0) for w in ("setup", "call", "teardown"))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--tests", type=int, default=20, help="how many of the costliest tests")
    p.add_argument("--programs", type=int, default=15, help="how many of the costliest programs")
    args = p.parse_args(argv)
    with open(args.path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        m = modules[r["nodeid"].split("::")[0]]
        m["tests"] += 1
        m["seconds"] += seconds(r)
        for key in ("compiles", "subprocesses", *_JAX_SECONDS):
            m[key] += r.get(key, 0)
    total = sum(m["seconds"] for m in modules.values())
    header = "| module | tests | seconds | share | compiles | compile s | trace s | lower s |"
    print(f"{header} subprocesses |\n|{'---|' * 9}")
    for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["seconds"]):
        share = 100 * m["seconds"] / max(total, 1e-9)
        jax_s = " | ".join(f"{m[key]:.1f}" for key in _JAX_SECONDS)
        print(
            f"| {name} | {m['tests']} | {m['seconds']:.1f} | {share:.1f}% | "
            f"{m['compiles']} | {jax_s} | {m['subprocesses']} |"
        )
    sums = " | ".join(f"{sum(m[key] for m in modules.values()):.1f}" for key in _JAX_SECONDS)
    print(f"| all | {len(rows)} | {total:.1f} | 100% | | {sums} | |\n")
    print("| test | seconds | compiles | subprocesses |\n|---|---|---|---|")
    for r in sorted(rows, key=seconds, reverse=True)[: args.tests]:
        print(
            f"| {r['nodeid']} | {seconds(r):.1f} | {r.get('compiles', 0)} | "
            f"{r.get('subprocesses', 0)} |"
        )
    _programs(rows, args.programs)
    sys.stdout.flush()


def _programs(rows: list[dict], count: int) -> None:
    """The programs (jitted functions, by name) whose compiles, tracing and lowering cost
    the most, summed over every test."""
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for r in rows:
        for name, counts in r.get("programs", {}).items():
            sums[name] = [a + b for a, b in zip(sums[name], counts, strict=True)]
    print("\n| program | compiles | compile s | trace s | lower s |\n|---|---|---|---|---|")
    for name, (n, *jax_s) in sorted(sums.items(), key=lambda kv: -sum(kv[1][1:]))[:count]:
        print(f"| {name} | {n:.0f} | " + " | ".join(f"{x:.1f}" for x in jax_s) + " |")


if __name__ == "__main__":
    main()

"""A pytest plugin that writes one JSON line per test outcome (pytest has no JSON reporter).

    python -m pytest -p tests.pytest_jsonl --jsonl=OUT/pytest.jsonl tests/test_gpu.py

Lines are written as tests finish, so a run killed by a timeout keeps what
finished. Each is {"nodeid", "outcome", "when", "duration_s", "message",
"properties"}: outcome is passed, failed, skipped, error (a fixture failed),
xfailed or xpassed; message is the short reason of a failure or skip;
properties are what the test recorded with `record_property`. A last line
{"summary": {outcome: count}, "exitstatus": N} closes a run that ended.
"""

from __future__ import annotations

import collections
import json


def pytest_addoption(parser):
    parser.addoption("--jsonl", default=None, help="append one JSON line per test to this file")


def pytest_configure(config):
    path = config.getoption("--jsonl")
    if path:
        config.pluginmanager.register(_JsonlWriter(path), "jsonl-writer")


def _message(report) -> str | None:
    if report.passed:
        return None
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (file, line, reason)
    text = report.longreprtext.strip()
    lines = text.splitlines()
    # The assertion (pytest's "E   ..." lines) says more than the traceback above it.
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return "\n".join(errors[-20:]) if errors else "\n".join(lines[-20:])


class _JsonlWriter:
    def __init__(self, path: str):
        self.file = open(path, "a")  # noqa: SIM115 (closed in pytest_sessionfinish)
        self.counts: collections.Counter[str] = collections.Counter()

    def _write(self, row: dict) -> None:
        self.file.write(json.dumps(row, default=str) + "\n")
        self.file.flush()

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
        elif report.failed:
            outcome = "error"  # a fixture failed in setup or teardown
        elif report.when == "setup" and report.skipped:
            outcome = "skipped"  # skipif marks skip in setup
        else:
            return
        self.counts[outcome] += 1
        self._write(
            {
                "nodeid": report.nodeid,
                "outcome": outcome,
                "when": report.when,
                "duration_s": round(report.duration, 3),
                "message": _message(report),
                "properties": dict(report.user_properties),
            }
        )

    def pytest_sessionfinish(self, session, exitstatus):
        self._write({"summary": dict(self.counts), "exitstatus": int(exitstatus)})
        self.file.close()

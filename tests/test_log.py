"""The project's log lines reach stderr: every module that logs is under a routed name."""

from __future__ import annotations

import logging
import os
import re

from attention_jax.runtime import log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = [
    d
    for d in sorted(os.listdir(ROOT))
    if os.path.isfile(os.path.join(ROOT, d, "__init__.py")) and d not in ("tests", "bench")
]


def test_every_package_that_logs_is_routed_to_stderr():
    logging_packages = set()
    for package in PACKAGES:
        for base, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(base, name), encoding="utf-8") as f:
                        if re.search(r"logging\.getLogger\(__name__\)", f.read()):
                            logging_packages.add(package)
    assert {"training", "backends", "runtime"} <= logging_packages  # the scan sees them
    # Each package's loggers print under a tag of their own, not their raw name.
    named = {
        p: log.tag(f"attention_jax.{p}.x" if p != "model" else "attention_jax.x")
        for p in logging_packages
    }
    assert all(not t.startswith("attention_jax") for t in named.values()), named


def test_a_record_prints_as_one_tagged_line(capsys):
    log.setup()
    logging.getLogger("attention_jax.runtime.distributed").error(
        "another process of this job is gone"
    )
    logging.getLogger("attention_jax.training.loop").info("resumed from step 500")
    logging.getLogger("attention_jax.attention").info("cuDNN attention")
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[job] ERROR: another process of this job is gone",
        "[train] resumed from step 500",
        "[model] cuDNN attention",
    ]

"""How many CPU cores this process may use."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The cores this process may run on (its affinity, which a container or `taskset`
    narrows), else every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1

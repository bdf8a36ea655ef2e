"""decode.py's processes (hosts) that translate one input into one output together.

    out = open_shared_output(path, job, restart)    # process 0's output; others follow it

Each process reads the whole input and takes part in every batch (its devices hold a
share of the rows: inference/translators.py). Process 0 alone writes the output, its
record and its journal, and tells the others where the job resumes and which of a
chunk's sources its journal holds, so that all of them run the same batches. The
processes must agree on the job (the same input, model and settings): otherwise each
stops with one message. With one process every function here is a no-op or a pass-through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from attention_jax.inference.output import PartialOutput, StreamOutput, differences, open_output
from attention_jax.runtime.errors import UserError


def check_single_process_flags(options: Any) -> None:
    """UserError for what a job of several processes cannot do (decode.py's options)."""
    if jax.process_count() == 1:
        return
    single = ["export", "export_ct2", "ct2", "exported", "dry_run", "alignment", "plot_attention"]
    used = [f"--{name}" for name in single if getattr(options, name)]
    if used:
        raise UserError(
            f"{', '.join(used)} run(s) in one process: drop them, or run without "
            "--coordinator_address/--num_processes/--process_id"
        )


def is_main() -> bool:
    """Whether this process writes the output (process 0)."""
    return jax.process_index() == 0


def from_main(value: Any) -> Any:
    """Process 0's `value`, on every process (one collective; all must call it)."""
    if jax.process_count() == 1:
        return value
    from attention_jax.runtime.distributed import allgather_json

    return allgather_json(value)[0]


def check_same_job(job: dict[str, Any] | None) -> None:
    """UserError on every process unless all of them describe the same job."""
    if jax.process_count() == 1:
        return
    from attention_jax.runtime.distributed import allgather_json

    jobs = allgather_json(job)
    for index, other in enumerate(jobs[1:], start=1):
        if other != jobs[0]:
            changed = differences(jobs[0], other)
            raise UserError(
                f"process {index} has another job than process 0 ({'; '.join(changed[:3])}): "
                "give every process the same input, model and flags"
            )


class FollowerOutput:
    """A process other than 0: it translates with the others and writes nothing."""

    resumable = False
    journal = None

    def __init__(self, done: dict[str, Any]):
        self.done = done

    def append(self, data: bytes, done: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_shared_output(
    path: str, job: dict[str, Any] | None, restart: bool
) -> PartialOutput | StreamOutput | FollowerOutput:
    """The job's output on process 0 (inference/output.py `open_output`); a follower of
    its record on the others. A UserError on process 0 stops every process."""
    if jax.process_count() == 1:
        return open_output(path, job, restart)
    check_same_job(job)
    out, error = None, None
    if is_main():
        try:
            out = open_output(path, job, restart)
        except UserError as e:
            error = str(e)
    shared = from_main({"done": out.done if out else {}, "error": error})
    if shared["error"]:
        raise UserError(shared["error"] if is_main() else f"process 0: {shared['error']}")
    return out if out is not None else FollowerOutput(shared["done"])


def known_sources(known: dict[int, Any]) -> Sequence[int]:
    """The indices of a chunk's sources that process 0's journal holds, on every process."""
    return from_main(sorted(known))

"""Jobs of several processes on one machine's CPU (the multi-host tests: test_multihost,
test_multihost_faults): each process gets its share of 4 host devices, and they meet
over gloo on a free port of 127.0.0.1."""

import os
import socket
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(nproc: int, argv) -> list[subprocess.Popen]:
    """`argv(i, port)` on processes i = 0..nproc-1 of one CPU job (4 // nproc devices
    each, gloo over 127.0.0.1:port), not waited for."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    devices = f"--xla_force_host_platform_device_count={4 // nproc}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {devices}"
    port = str(_free_port())
    return [
        subprocess.Popen(
            argv(i, port),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(nproc)
    ]

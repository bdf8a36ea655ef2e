"""bench/harness.py: `host_cpu`, the CPU a result row states (read from /proc/cpuinfo), and
`failure`, what of a failed decode.py's stderr a benchmark shows."""

import subprocess
import sys

from attention_jax.runtime.cpus import usable_cpus
from bench import harness

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512bw
processor\t: 1
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512bw
"""


def test_the_model_its_widest_vector_extension_and_the_usable_cores(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert harness.host_cpu(str(info)) == f"AMD EPYC 9B45, AVX-512, {usable_cpus()} cores"
    info.write_text(CPUINFO.replace(" avx512f avx512bw", ""))
    assert harness.host_cpu(str(info)) == f"AMD EPYC 9B45, AVX2, {usable_cpus()} cores"


def test_without_cpuinfo_the_platforms_word_and_no_extension(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.platform, "processor", lambda: "arm")
    assert harness.host_cpu(str(tmp_path / "absent")) == f"arm, {usable_cpus()} cores"


CRASH = """
import faulthandler, threading, time
faulthandler.enable()

def crashing_worker():
    time.sleep(0.2)
    faulthandler._sigsegv()

def idle_worker():
    time.sleep(60)

for target in [idle_worker] * 40 + [crashing_worker]:  # the newest thread is listed first
    threading.Thread(target=target, daemon=True).start()
time.sleep(60)
"""


def test_a_crash_shows_the_crashing_threads_stack_though_many_threads_follow_it():
    proc = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True)
    assert proc.returncode != 0 and "Current thread" in proc.stderr
    shown = harness.failure(proc.stderr, size=600)
    assert shown.startswith("Fatal Python error: Segmentation fault")
    assert "crashing_worker" in shown and len(shown) <= 600 + len(shown.split("\n")[0]) + 1
    assert "crashing_worker" not in proc.stderr[-600:]  # the end alone would miss it


def test_an_error_shows_the_end_of_stderr():
    stderr = "I0000 loading\n" * 500 + "Error: --input: no such file\n"
    assert harness.failure(stderr, size=100).endswith("Error: --input: no such file\n")
    assert len(harness.failure(stderr, size=100)) == 100

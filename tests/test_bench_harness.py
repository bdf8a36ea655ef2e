"""bench/harness.py's `host_cpu`: the CPU a result row states, read from /proc/cpuinfo."""

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

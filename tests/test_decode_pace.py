"""decode.py at the accelerator's pace: the search's steps per stopping test, batches
searched whole or carried over, every device of the job (8 forced host devices, 2
processes), a chunk's finished batches kept across a kill, and --stats.

Each way of running must give the output of the plain single-device run: byte for byte
on one device; on several, the same texts, tokens and alignments, and scores equal to
float32 rounding (a device's share of the rows can change how XLA blocks a matmul).
"""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from attention_jax import EOS_ID, Transformer, TransformerConfig
from attention_jax.search import beam, decoding
from attention_jax.search.settings import SearchSettings
from tests.conftest import model_fields
from tests.decode_runs import ROOT, run_decode
from tests.digits import digit_pairs


def _sources(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, size=n)
    return [[*rng.integers(4, 40, size=k - 1).tolist(), EOS_ID] for k in lengths]


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(**model_fields(num_decoder_layers=2, max_len=48))
    return Transformer(cfg, rngs=nnx.Rngs(3))


def _batch(n: int, width: int, seed: int) -> np.ndarray:
    src = np.zeros((n, width), np.int32)  # [B, S]
    for i, s in enumerate(_sources(n, seed)):
        s = [*s[: width - 1], EOS_ID] if len(s) > width else s
        src[i, : len(s)] = s
    return src


@pytest.mark.parametrize(
    ("size", "room"),
    [
        (4, 13),  # pairs, then one step
        # a few seconds each (two programs): make test-slow
        pytest.param(1, 13, marks=pytest.mark.slow),
        pytest.param(4, 24, marks=pytest.mark.slow),  # pairs only
    ],
)
def test_two_steps_a_loop_iteration_give_the_same_tokens_and_scores(model, monkeypatch, size, room):
    """A large search takes two steps per loop iteration (search/beam.py `step_until`), then
    single steps for what is left of the room (odd rooms leave one): the same tokens, and
    the same scores to float32 rounding, as one step an iteration, for beams of 4 and 1."""
    from attention_jax.search.decoding import translate_beams

    src = _batch(6, 11, seed=4)
    run = lambda: [
        np.asarray(x) for x in translate_beams(model, src, beam_size=size, max_decode_len=room)
    ]
    want = run()
    monkeypatch.setattr(decoding, "LARGE_SEARCH_BYTES", 0)  # every search is large
    monkeypatch.setattr(decoding, "TWO_STEP_PLATFORMS", frozenset({"cpu"}))  # as on a GPU
    jax.clear_caches()  # the same static arguments: traced anew, not the program above
    unrolls, step_until = [], beam.step_until
    monkeypatch.setattr(beam, "step_until", lambda *a: unrolls.append(a[4]) or step_until(*a))
    got = run()
    assert unrolls == [2]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)  # fused otherwise: the last bit


def test_skipped_sources_leave_the_others_hypotheses_as_they_were(model):
    """A resumed chunk's journal holds some sources: told to skip them, the search gives
    them none and every other source exactly what it had (its batch keeps its shape)."""
    from attention_jax.search.translate import translate_ids

    sources = _sources(30, seed=5)
    settings = SearchSettings(beam_size=4, n_best=2, batch_tokens=96, min_rows=1)
    want = translate_ids(model, sources, settings)
    assert all(want)
    skip = {0, 3, 4, 5, 17, 29}
    got = translate_ids(model, sources, settings, skip=skip)
    assert all(got[i] == ([] if i in skip else want[i]) for i in range(len(sources)))


def test_the_dry_run_skips_sources_as_the_search_does():
    """decode.py --dry_run on a resumed chunk: the sources its journal holds get no
    hypotheses and are not reported again, and the others are echoed in the batches
    they would have had without the skip."""
    from attention_jax.search.translate import PlanOnlyTranslator

    sources = [*_sources(30, seed=6), []]
    settings = SearchSettings(batch_tokens=64)

    def run(skip):
        reported = []
        got = PlanOnlyTranslator(48, settings).translate(
            sources, lambda done, found: reported.append(list(done)), skip=skip
        )
        return got, reported

    whole, batches = run(())
    assert [[h.tokens for h in hyps] for hyps in whole] == [[s[:-1]] if s else [] for s in sources]
    skip = {1, 2, 8, 29}
    got, reported = run(skip)
    assert got == [[] if i in skip else whole[i] for i in range(len(sources))]
    kept = [[i for i in b if i not in skip] for b in batches]
    assert reported == [b for b in kept if b]


# --- decode.py: devices, processes, kills, --stats ------------------------------------------


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """120 digit lines and the plain single-device run's output of them."""
    d = tmp_path_factory.mktemp("pace")
    path = d / "in.de"
    path.write_text("".join(s + "\n" for s, _ in digit_pairs(np.random.default_rng(21), 120)))
    return path


@pytest.fixture(scope="module")
def plain(workdir, lines, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "out.en"
    r = run_decode(f"--workdir={workdir}", f"--input={lines}", f"--output={out}", *SMALL)
    assert r.returncode == 0, r.stderr.decode()
    return out.read_bytes()


# many batches of a few shapes, n-best lists with scores; the runs share the programs
# the first compiles (the test session's cache)
SMALL = ("--batch_tokens=64", "--n_best=2", "--output_format=jsonl")


@pytest.fixture(scope="module")
def same_translations(workdir, lines):
    """check(got, want): the same hypotheses line for line, but at near-ties
    (tests/parity.py: another device count computes in other shapes, which round
    otherwise); scores to float32 rounding where the tokens are the same."""
    from attention_jax.training.workdir import load_workdir
    from tests.parity import NearTies, source_ids

    model, config, _, tokenizer = load_workdir(workdir)
    sources = source_ids(tokenizer, lines.read_bytes(), config.max_length)
    ties = NearTies(model)  # decode.py's defaults: gnmt, alpha 0.6

    def check(got: bytes, want: bytes) -> None:
        got_lines, want_lines = got.decode().split("\n")[:-1], want.decode().split("\n")[:-1]
        g = [json.loads(x)["hypotheses"] for x in got_lines]
        w = [json.loads(x)["hypotheses"] for x in want_lines]
        tokens = lambda run: [[h["tokens"] for h in hyps] for hyps in run]
        result = ties.compare(sources, tokens(g), tokens(w))
        assert result.ok, result.report()
        for x, y in zip(g, w, strict=True):
            if tokens([x]) == tokens([y]):
                assert [h["text"] for h in x] == [h["text"] for h in y]
                np.testing.assert_allclose(
                    [h["score"] for h in x], [h["score"] for h in y], rtol=1e-5, atol=1e-5
                )

    return check


def test_eight_devices_write_the_single_devices_output_and_report_where_time_went(
    workdir,
    lines,
    plain,
    same_translations,
    tmp_path,
):
    out, stats = tmp_path / "out.en", tmp_path / "stats.json"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags}
    args = [f"--workdir={workdir}", f"--input={lines}", f"--output={out}", f"--stats={stats}"]
    r = run_decode(*args, *SMALL, env=env)
    assert r.returncode == 0, r.stderr.decode()
    same_translations(out.read_bytes(), plain)
    b = json.loads(stats.read_text())
    assert b["devices"] == 8 and b["search_devices"] == 8 and b["lines"] == 120
    assert b["searches"] > 0 and b["target_tokens"] > 120
    parts = b["startup_s"] + b["device_busy_s"] + b["device_idle_s"]
    assert parts == pytest.approx(b["wall_s"], abs=0.01)  # busy + idle = the time after start-up
    assert 0 <= b["host_bound_s"] <= b["device_idle_s"] + 1e-6
    assert 0 <= b["host_share"] <= 1 and b["programs_critical_s"] <= b["work_s"]
    assert sum(b["phases_s"].values()) <= b["wall_s"]
    assert "device busy" in r.stderr.decode()  # the table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(n: int, args_of, **popen) -> list[subprocess.Popen]:
    """n decode.py processes of one job (args_of(i): process i's arguments), started."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    where = [f"--coordinator_address=localhost:{_free_port()}", f"--num_processes={n}"]
    return [
        subprocess.Popen(
            [sys.executable, "decode.py", *args_of(i), *where, f"--process_id={i}"],
            cwd=ROOT,
            env=env,
            **popen,
        )
        for i in range(n)
    ]


def _processes(n: int, args_of) -> list[subprocess.CompletedProcess]:
    """n decode.py processes of one job, run to their end."""
    procs = _start(n, args_of, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _killed_once_journaled(args: list[str], out, batches: int) -> None:
    """Two decode.py processes of one job (`args`, writing `out`), both SIGKILLed once
    process 0's journal holds `batches` batches."""
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = _start(2, lambda i: args, **quiet)
    journal = out.parent / f"{out.name}.partial.journal"
    deadline = time.time() + 240
    while time.time() < deadline and procs[0].poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= batches:
            break
        time.sleep(0.02)
    for p in procs:
        p.kill()
        p.wait()
    assert not out.exists() and journal.exists(), "the job ended before it was killed"


@pytest.mark.slow  # ~6 s: test_two_processes_killed_mid_chunk_... writes it in make test
def test_two_processes_write_one_output_identical_to_one_process(
    workdir,
    lines,
    plain,
    same_translations,
    tmp_path,
):
    out = tmp_path / "out.en"
    args = [f"--workdir={workdir}", f"--input={lines}", f"--output={out}", *SMALL]
    for r in _processes(2, lambda i: args):
        assert r.returncode == 0, r.stderr.decode()
    same_translations(out.read_bytes(), plain)
    assert sorted(os.listdir(tmp_path)) == ["out.en"]  # no partial file, record or journal


def test_processes_that_disagree_on_the_input_stop_with_one_line(
    workdir,
    lines,
    tmp_path,
):
    other = tmp_path / "other.de"
    other.write_text("eins zwei\n")
    out = tmp_path / "out.en"

    def args(i):
        source = lines if i == 0 else other
        return [f"--workdir={workdir}", f"--input={source}", f"--output={out}", *SMALL]

    for r in _processes(2, args):
        assert r.returncode == 1
        err = r.stderr.decode().strip().splitlines()[-1]
        assert "process 1 has another job than process 0" in err, err
        assert "Traceback" not in r.stderr.decode()
    assert not out.exists()


# Runs decode.py in a child that SIGKILLs itself once its journal holds `batches` batches.
KILLER = """
import os, runpy, signal, sys
from attention_jax.inference import output
batches = int(sys.argv[1])
write = output.Journal.write
def killing_write(self, indices, found):
    write(self, indices, found)
    self.written = getattr(self, "written", 0) + 1
    if self.written >= batches:
        os.kill(os.getpid(), signal.SIGKILL)
output.Journal.write = killing_write
sys.argv = ["decode.py", *sys.argv[2:]]
runpy.run_path("decode.py", run_name="__main__")
"""


def test_a_job_killed_mid_chunk_goes_on_from_its_finished_batches(
    workdir,
    lines,
    plain,
    tmp_path,
):
    """One chunk of many batches, killed after 6 of them: the re-run translates only the
    sources the journal lacks, and the output is the uninterrupted run's."""
    out = tmp_path / "out.en"
    args = [f"--workdir={workdir}", f"--input={lines}", f"--output={out}", *SMALL]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, "6", *args], cwd=ROOT, env=env, capture_output=True
    )
    assert killed.returncode == -9, killed.stderr.decode()
    assert not out.exists() and os.path.getsize(f"{out}.partial.journal") > 0
    r = run_decode(*args)
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert "sentences of the running chunk were done by an earlier run" in err, err
    assert out.read_bytes() == plain
    assert sorted(os.listdir(tmp_path)) == ["out.en"]


def test_bad_pace_settings_are_one_line_errors(workdir, tmp_path):
    for flags, message in ((["--batch_tokens=0"], "--batch_tokens must be >= 1"),):
        workdir_flag = [] if any(f.startswith("--ct2") for f in flags) else [f"--workdir={workdir}"]
        r = run_decode(*workdir_flag, *flags, stdin=b"eins\n")
        assert r.returncode == 1, (flags, r.stderr.decode())
        assert message in r.stderr.decode() and "Traceback" not in r.stderr.decode()


@pytest.mark.slow  # ~18 s; several processes in make test: test_processes_that_disagree_...
def test_two_processes_killed_mid_chunk_go_on_and_write_one_output(
    workdir,
    lines,
    plain,
    same_translations,
    tmp_path,
):
    """Both processes of a job SIGKILLed once process 0's journal holds a few batches:
    the same command run again goes on from that journal (every process translates
    what it lacks) and writes the uninterrupted run's output, never a mixed file."""
    out = tmp_path / "out.en"
    args = [f"--workdir={workdir}", f"--input={lines}", f"--output={out}", *SMALL]
    _killed_once_journaled(args, out, batches=4)
    done = _processes(2, lambda i: args)
    for r in done:
        assert r.returncode == 0, r.stderr.decode()
    assert "were done by an earlier run" in done[0].stderr.decode()
    same_translations(out.read_bytes(), plain)
    assert sorted(os.listdir(tmp_path)) == ["out.en"]


@pytest.mark.slow  # ~20 s; one process's resumed scoring is in make test (test_score.py)
def test_two_processes_score_killed_mid_chunk_go_on_and_write_one_processs_scores(
    workdir, lines, tmp_path
):
    """--score over two processes, both SIGKILLed once process 0's journal holds a few
    batches: the same command goes on and writes one process's scores (to float32
    rounding: the rows are split over two devices)."""
    import json

    given = tmp_path / "given.en"
    given.write_text("".join(t + "\n" for _, t in digit_pairs(np.random.default_rng(21), 120)))
    out, alone = tmp_path / "out.jsonl", tmp_path / "alone.jsonl"
    args = [f"--workdir={workdir}", f"--input={lines}", f"--score={given}", "--batch_tokens=64"]
    assert run_decode(*args, f"--output={alone}").returncode == 0
    _killed_once_journaled([*args, f"--output={out}"], out, batches=3)
    for r in _processes(2, lambda i: [*args, f"--output={out}"]):
        assert r.returncode == 0, r.stderr.decode()
    rows = lambda path: [json.loads(x) for x in path.read_text().splitlines()]
    for got, want in zip(rows(out), rows(alone), strict=True):
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["token_log_probs"], want["token_log_probs"], atol=1e-5)

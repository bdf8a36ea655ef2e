"""decode.py streams: chunks of --read_lines lines, resumable after a kill, progress on stderr.

The reference for every streamed output is the same command with one chunk for the
whole file (what decode.py did before it streamed: read everything, translate it in
one set of length-sorted batches, write once). Kills are real SIGKILLs: at chosen
points of the output's write (a wrapper patches `PartialOutput.append` in the child:
tests/decode_runs.py `run_killed`), and once at a moment chosen by the clock.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from attention_jax.inference.output import PARTIAL, RECORD
from tests.decode_runs import ROOT, run_decode, run_killed
from tests.digits import digit_pairs, hostile_input

WHOLE = "--read_lines=1000000"  # one chunk: the reference


def test_tiny_chunks_keep_order_and_every_line(workdir, tmp_path):
    data, expected = hostile_input()
    src = tmp_path / "in.de"
    src.write_bytes(data)
    outs = {}
    for name, chunk in (("streamed", "--read_lines=3"), ("whole", WHOLE)):
        out = tmp_path / f"{name}.en"
        r = run_decode(
            f"--workdir={workdir}", f"--input={src}", f"--output={out}", chunk, "--beam_size=2"
        )
        assert r.returncode == 0, r.stderr.decode()
        outs[name] = out.read_bytes()
        err = r.stderr.decode()
        assert "1 line(s) had invalid UTF-8" in err and "1 line(s) over 64 tokens truncated" in err
        assert f"decode.py: {len(expected)} lines (3 empty)" in err
    assert outs["streamed"] == outs["whole"]
    got = outs["streamed"].decode().split("\n")
    assert got[-1] == "" and len(got) - 1 == len(expected)
    for i, want in enumerate(expected):
        if want is not None:
            assert got[i] == want, i
    assert not any(name.endswith((PARTIAL, RECORD)) for name in os.listdir(tmp_path))


@pytest.mark.slow  # ~30 s; test_decode_cli checks n-best, alignments and scores
def test_n_best_alignments_and_scores_across_chunks(workdir, tmp_path):
    data, expected = hostile_input(seed=6, n=20)
    ref = tmp_path / "ref.en"
    ref.write_text("".join(f"{t or 'one'}\n" for t in expected))
    src = tmp_path / "in.de"
    src.write_bytes(data)
    args = ["--n_best=3", "--output_format=jsonl", "--alignment", f"--reference={ref}"]
    runs = {}
    for name, chunk in (("streamed", "--read_lines=4"), ("whole", WHOLE)):
        out = tmp_path / f"{name}.jsonl"
        r = run_decode(f"--workdir={workdir}", f"--input={src}", f"--output={out}", chunk, *args)
        assert r.returncode == 0, r.stderr.decode()
        runs[name] = ([json.loads(x) for x in out.read_text().splitlines()], r.stdout.decode())
    (streamed, scores), (whole, whole_scores) = runs["streamed"], runs["whole"]
    assert len(streamed) == len(whole) == len(expected) == 26
    for a, b in zip(streamed, whole, strict=True):
        assert [(h["text"], h["tokens"], h["alignment"]) for h in a["hypotheses"]] == [
            (h["text"], h["tokens"], h["alignment"]) for h in b["hypotheses"]
        ]
        for ha, hb in zip(a["hypotheses"], b["hypotheses"], strict=True):
            assert ha["score"] == pytest.approx(hb["score"], abs=1e-5)  # other batch rows
    # BLEU and chrF over the whole file, not the last chunk.
    assert scores == whole_scores and "BLEU = " in scores and "chrF = " in scores


@pytest.mark.slow  # ~9 s
def test_split_streams_and_scores_the_whole_split(workdir, tmp_path):
    outs = []
    for chunk in ("--read_lines=3", WHOLE):
        out = tmp_path / f"test{len(outs)}.hyp"
        r = run_decode(f"--workdir={workdir}", "--split=test", f"--output={out}", chunk)
        assert r.returncode == 0, r.stderr.decode()
        assert "BLEU = 100.00" in r.stdout.decode()
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 10


@pytest.mark.slow  # ~13 s; test_tiny_chunks_keep_order_and_every_line covers chunking
def test_attention_plots_continue_across_chunks(workdir, tmp_path):
    plots = tmp_path / "plots"
    stdin = b"eins\n\nzwei drei\nvier\nfuenf\n"
    r = run_decode(
        f"--workdir={workdir}", f"--plot_attention={plots}", "--num_plots=3", "--read_lines=1",
        stdin=stdin,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(os.listdir(plots)) == [f"attention_00{i}.png" for i in range(3)]
    assert "wrote 3 attention plot(s)" in r.stderr.decode()


# --- Kills ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(workdir, tmp_path_factory):
    """A 40-line input, references, and its uninterrupted output (jsonl, 5 chunks)."""
    d = tmp_path_factory.mktemp("job")
    pairs = digit_pairs(np.random.default_rng(9), 40)
    (d / "in.de").write_text("".join(s + "\n" for s, _ in pairs))
    (d / "ref.en").write_text("".join(t + "\n" for _, t in pairs))
    args = [
        f"--workdir={workdir}",
        f"--input={d / 'in.de'}",
        f"--reference={d / 'ref.en'}",
        "--read_lines=8",
        "--n_best=2",
        "--output_format=jsonl",
        "--alignment",
    ]
    r = run_decode(*args, f"--output={d / 'whole.jsonl'}")
    assert r.returncode == 0, r.stderr.decode()
    return args, (d / "whole.jsonl").read_bytes(), r.stdout.decode()


# ~10 s each: the first in make test, the others in make test-slow.
@pytest.mark.parametrize(
    "where", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_sigkill_then_rerun_gives_the_uninterrupted_output(job, tmp_path, where):
    args, whole, scores = job
    out = tmp_path / "out.jsonl"
    out.write_text("yesterday's output\n")
    killed = run_killed(16, where, *args, f"--output={out}")
    assert killed.returncode == -signal.SIGKILL
    assert out.read_text() == "yesterday's output\n"  # untouched until complete
    record = json.loads((tmp_path / f"out.jsonl{RECORD}").read_text())
    assert record["done"]["lines"] == 8  # the chunk that was being written is lost, no more
    r = run_decode(*args, f"--output={out}")
    assert r.returncode == 0, r.stderr.decode()
    assert "going on with" in r.stderr.decode() and "8 lines were done" in r.stderr.decode()
    assert out.read_bytes() == whole
    assert r.stdout.decode() == scores  # BLEU over all 40 lines, half of them from the 1st run
    assert "decode.py: 40 lines (0 empty)" in r.stderr.decode()
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]


@pytest.mark.slow  # ~10 s; a kill at a chosen write is in make test
def test_sigkill_at_any_moment_then_rerun(job, tmp_path):
    """A kill from outside once the first chunk is recorded (not at a chosen write)."""
    args, whole, _ = job
    out = tmp_path / "out.jsonl"
    record = tmp_path / f"out.jsonl{RECORD}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "decode.py"), *args, f"--output={out}"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        try:
            if json.loads(record.read_text())["done"].get("lines"):
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    assert p.wait() == -signal.SIGKILL, "the job ended before the kill"
    assert not out.exists()
    r = run_decode(*args, f"--output={out}")
    assert r.returncode == 0, r.stderr.decode()
    assert out.read_bytes() == whole


def test_a_changed_job_is_refused_and_restart_starts_over(job, tmp_path):
    args, whole, _ = job
    out = tmp_path / "out.jsonl"
    assert run_killed(16, 0, *args, f"--output={out}").returncode == -signal.SIGKILL
    partial = (tmp_path / f"out.jsonl{PARTIAL}").read_bytes()
    for change, message in (
        (["--beam_size=3"], "settings.beam_size: 4 -> 3"),
        (["--read_lines=9"], "settings.read_lines: 8 -> 9"),
    ):
        r = run_decode(*args, *change, f"--output={out}")
        err = r.stderr.decode()
        assert r.returncode == 1 and message in err and "--restart" in err, err
        assert "Traceback" not in err and not out.exists()
    assert (tmp_path / f"out.jsonl{PARTIAL}").read_bytes() == partial  # nothing lost
    # Another input file: its identity differs (path, size, mtime, first bytes).
    other = tmp_path / "other.de"
    shutil.copyfile(args[1].split("=", 1)[1], other)  # the same bytes, another file
    moved = [a.replace(args[1], f"--input={other}") for a in args]
    r = run_decode(*moved, f"--output={out}")
    assert r.returncode == 1 and "inputs.input.path" in r.stderr.decode()
    r = run_decode(*moved, "--restart", f"--output={out}")
    assert r.returncode == 0, r.stderr.decode()
    assert "going on" not in r.stderr.decode() and out.read_bytes() == whole


@pytest.mark.slow  # an export (~45 s); the live model's resume is tested in make test
def test_exported_translator_resumes_too(workdir, tmp_path):
    export_dir = tmp_path / "translator"
    r = run_decode(f"--workdir={workdir}", f"--export={export_dir}", "--beam_size=2")
    assert r.returncode == 0, r.stderr.decode()
    src = tmp_path / "in.de"
    src.write_text("".join(s + "\n" for s, _ in digit_pairs(np.random.default_rng(4), 20)))
    args = [f"--exported={export_dir}", f"--input={src}", "--read_lines=6"]
    live = run_decode(f"--workdir={workdir}", "--beam_size=2", f"--input={src}", WHOLE)
    out = tmp_path / "out.en"
    assert run_killed(12, 2, *args, f"--output={out}").returncode == -signal.SIGKILL
    r = run_decode(*args, f"--output={out}")
    assert r.returncode == 0 and "6 lines were done" in r.stderr.decode(), r.stderr.decode()
    assert out.read_bytes() == live.stdout


# --- stdout, stdin, dry runs ----------------------------------------------------------------


def test_stdin_to_stdout_streams_a_chunk_at_a_time(workdir):
    """With --read_lines=1 each translation is out before the next line is typed in."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "decode.py"), f"--workdir={workdir}"]
    p = subprocess.Popen(
        [*cmd, "--read_lines=1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    timer = threading.Timer(300, p.kill)
    timer.start()
    try:
        for de, en in (("eins zwei", "one two"), ("", ""), ("neun", "nine")):
            p.stdin.write(f"{de}\n".encode())
            p.stdin.flush()
            assert p.stdout.readline().decode() == f"{en}\n"
        p.stdin.close()
        assert p.wait() == 0 and p.stdout.read() == b""
    finally:
        timer.cancel()


def test_dry_run_writes_the_tokenized_input_without_the_model(workdir, tmp_path):
    data, _ = hostile_input(seed=8, n=20)
    src = tmp_path / "in.de"
    src.write_bytes(data)
    out = tmp_path / "out.txt"
    r = run_decode(f"--workdir={workdir}", f"--input={src}", f"--output={out}", "--dry_run",
                   "--read_lines=5")  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    assert "(dry run: no model)" in r.stderr.decode()
    got = out.read_text().split("\n")[:-1]
    lines = data.decode("utf-8", "replace").split("\n")
    assert len(got) == len(lines)
    for line, copy in zip(lines, got, strict=True):
        if "sieben sieben" in line:
            assert line.startswith(copy)  # truncated to max_length
        elif "\ufffd" not in line:  # (an unknown piece comes out as " ⁇ ")
            assert copy == " ".join(line.split())  # SentencePiece normalizes spaces
    r = run_decode(f"--workdir={workdir}", "--dry_run", "--alignment", "--output_format=jsonl")
    assert r.returncode == 1 and "--dry_run runs no model" in r.stderr.decode()


def test_progress_lines_when_stderr_is_not_a_terminal(workdir, tmp_path):
    src = tmp_path / "in.de"
    src.write_text("eins\n" * 6)
    r = run_decode(f"--workdir={workdir}", f"--input={src}", "--read_lines=2")
    assert r.returncode == 0
    err = r.stderr.decode()
    assert "\r" not in err  # no bar drawn into a log
    assert "decode.py: 6 lines (0 empty)" in err

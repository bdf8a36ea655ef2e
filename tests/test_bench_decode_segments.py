"""bench/decode_segments.py on the digit workdir: every search program a job runs is
timed (pooled, or with --batched its segments), with the beam-row steps it ran,
together they are the search's time, and what it replaced to time them is put back."""

import json

import pytest

from attention_jax.search import decoding, pool, programs, segments, stages
from bench import decode_segments


def run(workdir, capsys, monkeypatch, *flags):
    # the bench keeps programs, as decode.py does: the store is put back after the test
    monkeypatch.setattr(programs, "_directory", programs._directory)
    monkeypatch.setattr(programs, "_loaded", {})
    monkeypatch.setattr(programs, "_pending", {})
    patched = [segments.start_segment, decoding.search_batch, stages.search_streams]
    patched += [pool.pool_search, pool.POOL_PLATFORMS]
    decode_segments.main([f"--workdir={workdir}", "--split=test", "--beam_size=2", *flags])
    assert [*patched[:3], pool.pool_search, pool.POOL_PLATFORMS] == patched
    return json.loads(capsys.readouterr().out.splitlines()[0])


def test_each_pooled_batch_is_timed_with_its_beam_row_steps(workdir, capsys, monkeypatch):
    report = run(workdir, capsys, monkeypatch)
    rows = report["results"]
    assert {r["program"] for r in rows} == {"pool"}
    assert report["timed_s"] == pytest.approx(
        sum(r["seconds"] for r in rows), abs=0.001 * len(rows)
    )
    for r in rows:  # the slots' rows x the steps of each call
        assert r["calls"] > 0 and r["beam_rows"] % 2 == 0
        assert r["beam_row_steps"] > 0 and r["beam_row_steps"] % r["beam_rows"] == 0


def test_each_program_of_a_job_is_timed_with_its_beam_row_steps(workdir, capsys, monkeypatch):
    report = run(workdir, capsys, monkeypatch, "--batched")
    rows = report["results"]
    assert report["benchmark"] == "decode_segments" and report["lines"] > 0
    assert 0 < report["timed_s"] <= report["translate_s"]
    # each rounded to the millisecond
    assert report["timed_s"] == pytest.approx(
        sum(r["seconds"] for r in rows), abs=0.001 * len(rows)
    )
    assert {r["program"] for r in rows} >= {"start", "advance", "grow", "select"}
    for r in rows:
        assert r["calls"] > 0 and r["beam_rows"] % 2 == 0
        if r["program"] in ("start", "advance"):  # rows x the steps of each call
            assert r["beam_row_steps"] % r["beam_rows"] == 0
        else:
            assert r["beam_row_steps"] == 0 and r["us_per_beam_row_step"] is None
    stepped = [r for r in rows if r["program"] == "advance"]
    assert all(r["beam_row_steps"] > 0 and r["us_per_beam_row_step"] > 0 for r in stepped)

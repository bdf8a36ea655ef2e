"""bench/decode_file.py on the trained digit workdir: the pace measure's cold and warm
runs, and the resume measure's killed job, whose re-run must give the uninterrupted
run's output. (--measure=memory reads the Ding corpus; `make train` installs it.)"""

import json

import pytest

from bench import decode_file


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_pace_reports_where_the_time_went_cold_and_warm(workdir, tmp_path, capsys):
    jsonl = tmp_path / "runs.jsonl"
    decode_file.main(
        [f"--workdir={workdir}", "--split=test", "--lines=300", f"--scratch={tmp_path}",
         f"--jsonl={jsonl}", "--", "--beam_size=2"]
    )  # fmt: skip
    out = capsys.readouterr().out
    rows = _json_lines(out)
    assert [r["run"] for r in rows] == ["cold", "warm"]
    assert rows == [json.loads(line) for line in jsonl.read_text().splitlines()]
    for r in rows:
        assert r["benchmark"] == "decode.py" and r["decode_flags"] == ["--beam_size=2"]
        assert r["process_s"] > 0 and r["target_tokens_per_s"] > 0 and r["output_bytes"] > 0
    # The warm run finds the programs the cold one compiled, and compiles nothing.
    assert rows[0]["programs"]["compiled"] > 0 and rows[1]["programs"]["compiled"] == 0
    assert rows[1]["programs_critical_s"] < rows[0]["programs_critical_s"]
    header = [line.split() for line in out.splitlines() if line.split()[:1] == ["run"]]
    assert header and header[0][-1] == "host_share"  # then the table


def test_lines_done_counts_a_chunk_once_while_its_journal_is_being_emptied(tmp_path):
    # decode.py replaces the record, then empties the journal: between the two, the
    # journal still holds the chunk the record counts: counted twice, a job polled there
    # was killed before the share asked for.
    out = str(tmp_path / "out.txt")
    record, journal = out + ".partial.json", out + ".partial.journal"
    assert decode_file.lines_done(out) == 0

    def entry(at, indices):
        return json.dumps({"at": at, "i": indices, "h": [[[[5, 6], -1.0]]] * len(indices)})

    with open(journal, "w") as f:  # the first chunk: no record yet, two batches done
        f.write(entry(0, list(range(16))) + "\n" + entry(0, list(range(16, 30))) + "\n")
    assert decode_file.lines_done(out) == 30
    with open(record, "w") as f:  # the chunk of 40 committed, its journal not yet emptied
        json.dump({"version": 1, "job": {}, "done": {"lines": 40, "output_bytes": 99}}, f)
    assert decode_file.lines_done(out) == 40
    with open(journal, "w") as f:  # the next chunk's batch, and a torn line after it
        f.write(entry(40, list(range(8))) + "\n" + entry(40, [8, 9])[:20])
    assert decode_file.lines_done(out) == 48


@pytest.mark.slow  # ~8 s: the resume itself is test_decode_stream's (make test)
def test_resume_kills_the_job_and_its_rerun_gives_the_same_output(workdir, tmp_path, capsys):
    at = 0.5
    decode_file.main(
        ["--measure=resume", f"--workdir={workdir}", "--split=test", "--lines=800",
         f"--at={at}", f"--scratch={tmp_path}", "--", "--read_lines=40", "--beam_size=2"]
    )  # fmt: skip
    (row,) = _json_lines(capsys.readouterr().out)
    assert row["benchmark"] == "decode_resume" and row["lines"] == 800
    assert at * 800 <= row["killed_at_lines"] < 800
    assert row["identical_output"] is True
    assert row["rerun_share"] > 0 and row["rerun_s"] > 0 and row["whole_s"] > 0


@pytest.mark.slow  # ~10 s: the property itself is test_stages' in make test
def test_later_jobs_in_other_chunks_add_no_program(workdir, tmp_path, capsys):
    decode_file.main(
        ["--measure=programs", f"--workdir={workdir}", "--lines=150", "--read_lines=20",
         f"--scratch={tmp_path}", "--", "--beam_size=2"]
    )  # fmt: skip
    first, second = _json_lines(capsys.readouterr().out)
    assert first["benchmark"] == second["benchmark"] == "decode_programs"
    assert first["cache_files"] == first["added_files"] > 0 and first["compiled"] > 0
    assert second["first_line"] == 150 and second["read_lines"] == 20
    assert second["added_files"] == 0 and second["compiled"] == 0 and second["loaded"] > 0

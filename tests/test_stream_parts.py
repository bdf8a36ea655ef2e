"""The parts of decode.py's streaming (no model): chunked reading against reading the whole
file, chunked BLEU/chrF against sacreBLEU's corpus scores, the partial output and its
progress record, and the progress meter (a fake clock)."""

import io
import json
import os
import random

import pytest
import sacrebleu

from attention_jax.inference.lines import LineReader, count_lines, read_lines
from attention_jax.inference.options import DecodeOptions
from attention_jax.inference.output import PARTIAL, RECORD, differences, file_identity, open_output
from attention_jax.inference.progress import Meter, format_eta, progress_line
from attention_jax.inference.stream import ListReader
from attention_jax.runtime.errors import UserError
from attention_jax.search.bleu import CorpusScores, bleu_chrf

HOSTILE = [
    b"",
    b"eins zwei\nvier\n",
    b"no newline at the end",
    b"\n",
    b"\n\n\n",
    b"a\r\nb\r\n\r\n",
    b"bad \xff\xfe utf-8\nok\n\xc3\n",
    b"vertical\x0btab\x1cfile sep\xe2\x80\xa8line sep\nform\x0cfeed",
    b"x" * 70_000 + b"\n" + b"short\n",
]


@pytest.mark.parametrize("data", HOSTILE)
@pytest.mark.parametrize("n", [1, 2, 3, 1000])
def test_line_reader_reads_the_lines_read_lines_reads(tmp_path, data, n):
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    want_lines, want_bad = read_lines(str(path))
    reader, got, bad, offsets = LineReader(str(path)), [], 0, []
    while chunk := reader.read(n):
        if not chunk[0]:
            break
        got += chunk[0]
        bad += chunk[1]
        offsets.append((len(got), reader.offset))
    reader.close()
    assert (got, bad) == (want_lines, want_bad)
    assert count_lines(str(path)) == len(want_lines)
    # From any recorded offset, a new reader reads exactly the rest.
    for lines_done, offset in offsets:
        rest = LineReader(str(path), offset)
        assert rest.read(10**9)[0] == want_lines[lines_done:]
        rest.close()


def test_count_lines_across_blocks(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"ab\n" * 1000 + b"tail")
    assert count_lines(str(path), block=7) == 1001 == len(read_lines(str(path))[0])


def test_list_reader_offsets_count_lines():
    reader = ListReader(["a", "b", "c", "d", "e"], offset=1)
    assert reader.read(3) == (["b", "c", "d"], 0) and reader.offset == 4
    assert reader.read(3) == (["e"], 0) and reader.read(3) == ([], 0)


def test_corpus_scores_in_chunks_equal_sacrebleu_corpus_scores():
    rng = random.Random(0)
    words = ["the", "a", "house", "is", "old", "very", "cat", "runs", ".", ",", "!", "Haus"]
    hyps = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    refs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    want = {  # sacreBLEU over the whole corpus at once
        "bleu": bleu.corpus_score(hyps, [refs]).score,
        "chrf": chrf.corpus_score(hyps, [refs]).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }
    assert bleu_chrf(hyps, refs) == want
    scores = CorpusScores()
    for i in range(0, 147, 7):
        scores.add(hyps[i : i + 7], refs[i : i + 7])
    resumed = CorpusScores(json.loads(json.dumps(scores.stats)))  # saved and read back
    for i in range(147, 300, 11):
        resumed.add(hyps[i : min(i + 11, 300)], refs[i : min(i + 11, 300)])
    assert resumed.result() == want
    assert resumed.summary().splitlines() == [  # the two lines decode.py prints
        f"BLEU = {want['bleu']:.2f}  {want['bleu_signature']}",
        f"chrF = {want['chrf']:.2f}  {want['chrf_signature']}",
    ]
    empty = CorpusScores().result()
    assert empty["bleu"] == 0.0 and empty["chrf"] == 0.0 and "nrefs:1" in empty["bleu_signature"]


def job(**settings):
    return {"inputs": {"input": "in.txt"}, "settings": {"beam_size": 4, **settings}}


def test_partial_output_appears_only_when_complete_and_resumes(tmp_path):
    path = str(tmp_path / "out" / "test.en")
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("an old translation\n")
    out = open_output(path, job(), restart=False)
    assert out.done == {} and os.path.exists(path + RECORD)
    out.append(b"one\ntwo\n", {"lines": 2})
    out.close()  # killed here: the old file is intact, the chunk is kept
    with open(path) as f:
        assert f.read() == "an old translation\n"
    # A chunk written after the last record (killed before the record was replaced) ...
    with open(path + PARTIAL, "ab") as f:
        f.write(b"three\nfo")
    out = open_output(path, job(), restart=False)
    assert out.done == {"lines": 2, "output_bytes": 8}
    out.append(b"three\nfour\n", {"lines": 4})  # ... is cut off and written again
    out.finish()
    with open(path, "rb") as f:
        assert f.read() == b"one\ntwo\nthree\nfour\n"
    assert not os.path.exists(path + PARTIAL) and not os.path.exists(path + RECORD)


def test_partial_output_refuses_another_job_and_restarts(tmp_path):
    path = str(tmp_path / "test.en")
    out = open_output(path, job(), restart=False)
    out.append(b"one\n", {"lines": 1})
    out.close()
    with pytest.raises(UserError, match=r"settings.beam_size: 4 -> 2.*--restart"):
        open_output(path, job(beam_size=2), restart=False)
    with open(path + PARTIAL, "rb") as f:
        assert f.read() == b"one\n"  # a refused run changes nothing
    out = open_output(path, job(beam_size=2), restart=True)
    assert out.done == {}
    out.append(b"uno\n", {"lines": 1})
    out.finish()
    with open(path) as f:
        assert f.read() == "uno\n"


def test_a_job_killed_in_its_first_chunk_is_started_over_whatever_it_was(tmp_path):
    path = str(tmp_path / "test.en")
    out = open_output(path, job(), restart=False)
    out.close()
    with open(path + PARTIAL, "wb") as f:
        f.write(b"half a ch")
    out = open_output(path, job(beam_size=2), restart=False)
    assert out.done == {} and os.path.getsize(path + PARTIAL) == 0
    out.close()


def test_partial_output_is_locked_and_damage_is_refused(tmp_path):
    path = str(tmp_path / "test.en")
    out = open_output(path, job(), restart=False)
    with pytest.raises(UserError, match=r"another decode\.py is writing"):
        open_output(path, job(), restart=False)
    out.append(b"one\ntwo\n", {"lines": 2})
    out.close()
    os.truncate(path + PARTIAL, 3)
    with pytest.raises(UserError, match="changed by hand"):
        open_output(path, job(), restart=False)
    with open(path + RECORD, "w") as f:
        f.write("{not json")
    with pytest.raises(UserError, match="cannot read the progress record"):
        open_output(path, job(), restart=False)


def test_a_record_without_its_partial_file_is_stale(tmp_path):
    # Killed after the rename that finished a job, before its record was removed.
    path = str(tmp_path / "test.en")
    with open(path + RECORD, "w") as f:
        json.dump({"version": 1, "job": job(), "done": {"lines": 5, "output_bytes": 20}}, f)
    out = open_output(path, job(), restart=False)
    assert out.done == {}
    out.finish()
    assert os.path.getsize(path) == 0 and not os.path.exists(path + RECORD)


def test_a_job_that_cannot_resume_keeps_no_record(tmp_path):
    path = str(tmp_path / "test.en")
    out = open_output(path, job(), restart=False)
    out.append(b"one\n", {"lines": 1})
    out.close()
    out = open_output(path, None, restart=False)  # e.g. stdin into the same file
    assert out.done == {} and not os.path.exists(path + RECORD)
    out.append(b"uno\n", {"lines": 1})
    out.finish()
    with open(path) as f:
        assert f.read() == "uno\n"


def test_devices_are_written_as_streams(tmp_path):
    out = open_output(os.devnull, job(), restart=False)
    assert not out.resumable
    out.append(b"one\n", {"lines": 1})
    out.finish()
    assert not os.path.exists(os.devnull + PARTIAL)
    with pytest.raises(UserError, match="cannot write"):
        open_output(str(tmp_path), job(), restart=False)  # a directory


def test_file_identity_changes_with_the_file(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"eins\n")
    first = file_identity(str(path))
    os.utime(path, ns=(1, 1))
    assert differences(first, file_identity(str(path))) == [f"mtime_ns: {first['mtime_ns']} -> 1"]
    path.write_bytes(b"zwei\n")
    os.utime(path, ns=(1, 1))
    assert [d.split(":")[0] for d in differences(first, file_identity(str(path)))] == [
        "head_sha256",
        "mtime_ns",
    ]


def test_meter_prints_lines_at_intervals_with_rates_and_eta():
    now = [0.0]
    stream = io.StringIO()
    meter = Meter(1000, done=100, stream=stream, every=10.0, clock=lambda: now[0], bar=False)
    meter.start_chunk(lines=200, segments=100)
    now[0] = 5.0
    meter.batch(50, 600)  # half the chunk: 100 lines in 5 s, but the interval is not over
    assert stream.getvalue() == ""
    now[0] = 10.0
    meter.batch(50, 400)
    meter.end_chunk()  # 200 lines in 10 s: 20 lines/s, 100 tokens/s, 700 to go: 35 s
    assert stream.getvalue().splitlines() == [
        "decode.py: 300/1000 lines (30.0%), 20.0 lines/s, 100 tokens/s, ETA 0:00:35"
    ]
    assert progress_line(5, None, 1.0, 2.0) == "decode.py: 5 lines, 1.0 lines/s, 2 tokens/s"
    assert format_eta(3 * 3600 + 7 * 60 + 9.4) == "3:07:09"
    meter.close()


def test_meter_draws_a_bar_on_a_terminal():
    stream = io.StringIO()
    meter = Meter(10, stream=stream, bar=True)
    meter.start_chunk(lines=10, segments=10)
    meter.batch(10, 50)
    meter.end_chunk()
    meter.close()
    assert "10/10" in stream.getvalue() and "tok_s" in stream.getvalue()


def test_checking_the_options_starts_no_jax_backend():
    """decode.py checks its options before jax.distributed.initialize, which must come
    before any backend starts (several processes): the check reads no platform default."""
    import subprocess
    import sys

    code = (
        "from attention_jax.inference.options import DecodeOptions\n"
        "import jax._src.xla_bridge as xb\n"
        "DecodeOptions(workdir='w', output_format='jsonl', search={'n_best': 2}).check()\n"
        "assert not xb.backends_are_initialized()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_chunk_lines_grow_with_the_batch_budget():
    assert DecodeOptions(workdir="w").chunk_lines == 10_000  # the least (CPU: 2.5 x 512)
    assert DecodeOptions(workdir="w", search={"batch_tokens": 1024}).chunk_lines == 10_000
    assert DecodeOptions(workdir="w", search={"batch_tokens": 32768}).chunk_lines == 81_920
    assert DecodeOptions(workdir="w", read_lines=3).chunk_lines == 3
    with pytest.raises(UserError, match="--read_lines must be >= 1"):
        DecodeOptions(workdir="w", read_lines=0).check()


def test_the_journal_keeps_its_chunks_batches_and_skips_a_torn_line(tmp_path):
    """A journal line a kill tore is skipped, and the next batch starts a line of its own;
    lines of another chunk are not this chunk's; clearing starts the next chunk."""
    from attention_jax.inference.output import Journal
    from attention_jax.search.hypothesis import Hypothesis

    path = str(tmp_path / "out.en.partial.journal")
    with open(path, "w") as f:
        f.write('{"at": 10, "i": [0], "h": [[[[4, 5], -3.0]]]}\n')  # another chunk
        f.write('{"at": 0, "i": [1, 2], "h": [[[[5, 6], -1.5]], []]}\n')
        f.write('{"at": 0, "i": [7], "h": [[[[9')  # torn
    journal = Journal(path, 0)
    journal.write([3], [[Hypothesis([8], -2.0), Hypothesis([8, 8], -2.5)]])
    journal.close()
    assert Journal(path, 0).read() == {
        1: [Hypothesis([5, 6], -1.5)],
        2: [],
        3: [Hypothesis([8], -2.0), Hypothesis([8, 8], -2.5)],
    }
    assert Journal(path, 10).read() == {0: [Hypothesis([4, 5], -3.0)]}
    journal.clear(25)
    assert journal.read() == {} and os.path.getsize(path) == 0


def test_every_decode_flag_is_the_option_of_its_name_with_its_default_and_choices():
    """decode.py's flags (inference/cli.py): DecodeOptions' own fields, one flag each with
    the same name, default and accepted values; and one flag per search setting with
    SearchSettings' name, default, choices and help (none declared a second time)."""
    import dataclasses

    from absl import flags

    from attention_jax.backends.ct2_export import DEVICES, QUANTIZATIONS
    from attention_jax.inference import cli, options
    from attention_jax.search.settings import SearchSettings

    job = {name: flags.FLAGS[name] for name in cli.job_flags()}
    fields = {f.name: f.default for f in dataclasses.fields(DecodeOptions) if f.name != "search"}
    assert sorted(job) == sorted(fields)
    for name, flag in job.items():
        got = tuple(flag.default) if name == "export_platforms" else flag.default
        assert got == fields[name], name
    choices = {
        "long_lines": options.LONG_LINES, "output_format": options.OUTPUT_FORMATS,
        "split": options.SPLITS, "quantization": QUANTIZATIONS, "device": DEVICES,
        "checkpoint": options.CHECKPOINTS,
    }  # fmt: skip
    parsers = {n: f.parser for n, f in job.items()}
    enums = {n: tuple(p.enum_values) for n, p in parsers.items() if hasattr(p, "enum_values")}
    assert enums == {n: tuple(c) for n, c in choices.items()}
    settings = SearchSettings.fields(flag=True)
    assert {f.name for f in settings} >= {"beam_size", "alpha", "n_best", "stop", "min_length"}
    for field in settings:
        flag = flags.FLAGS[field.name]
        assert flag.default == field.default and flag.help.endswith(field.metadata["help"])
        enum = getattr(flag.parser, "enum_values", None)
        assert (tuple(enum) if enum else None) == field.metadata["choices"], field.name
        assert field.name not in job and field.name not in fields

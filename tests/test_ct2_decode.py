"""decode.py --export_ct2 / --ct2 end to end on the workdir trained in-test (digit words).

The reference for every CTranslate2 output is our own decoder on the same model
(`--workdir`, with CTranslate2's rules: `--length_penalty=average --stop=count`):
greedy and beam search must give the same lines but at near-ties (tests/parity.py),
and the CTranslate2 backend must keep decode.py's contract (one line per input line,
n-best jsonl, scores, BLEU, long lines, streaming and resuming). Skipped without
ctranslate2 (`pip install '.[serve]'`).
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from attention_jax.backends.ct2 import CT2Translator, groups
from attention_jax.backends.ct2_export import int8_saturates
from attention_jax.inference.output import PARTIAL
from attention_jax.tokens import EOS_ID
from tests.decode_runs import ROOT, run_decode, run_killed
from tests.digits import digit_pairs, hostile_input
from tests.parity import NearTies, source_ids

pytest.importorskip("ctranslate2")

WHOLE = "--read_lines=1000000"  # one chunk


@pytest.fixture(scope="module")
def ct2_dirs(workdir, tmp_path_factory):
    """The trained model exported as float32 and as int8 CTranslate2 directories."""
    d = tmp_path_factory.mktemp("ct2")
    dirs = {}
    for quantization in ("float32", "int8"):
        out = d / quantization
        r = run_decode(f"--workdir={workdir}", f"--export_ct2={out}",
                       f"--quantization={quantization}")  # fmt: skip
        assert r.returncode == 0, r.stderr.decode()
        assert f"wrote the {quantization} CTranslate2 model of step" in r.stderr.decode()
        dirs[quantization] = str(out)
    return dirs


def mixed_input(seed: int, n: int) -> bytes:
    """n digit sentences of 1..14 words (longer than the training's 6), hostile lines too."""
    rng = np.random.default_rng(seed)
    data, _ = hostile_input(seed=seed, n=n // 2)
    longer = [s for s, _ in digit_pairs(rng, n - n // 2, max_words=14)]
    return data + b"\n" + "\n".join(longer).encode() + b"\n"


def test_export_writes_a_directory_plain_ctranslate2_reads(ct2_dirs, tmp_path):
    d = ct2_dirs["float32"]
    assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer.model",
            "decoding.json"} <= set(os.listdir(d))  # fmt: skip
    with open(os.path.join(d, "decoding.json")) as f:
        settings = json.load(f)
    assert settings["length_penalty"] == "average" and settings["quantization"] == "float32"
    assert settings["source"]["checkpoint"].startswith("step ")
    # docs/decoding.md's plain-CTranslate2 snippet runs as written on this directory.
    with open(os.path.join(ROOT, "docs", "decoding.md")) as f:
        doc = f.read()
    snippet = doc.split("A directory also serves without this repository:")[1]
    snippet = snippet.split("```python")[1].split("```")[0].replace('"serve/', f'"{d}/')
    snippet = snippet.replace("Das Haus ist sehr alt.", "drei vier")
    r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == "three four\n"


def hypotheses(r) -> list[list[list[int]]]:
    """Per line of a jsonl run's stdout, its hypotheses' tokens (lines end at "\\n" only:
    a text may hold U+2028 or U+0085, which str.splitlines() would also split at)."""
    lines = [json.loads(x)["hypotheses"] for x in r.stdout.decode().split("\n")[:-1]]
    return [[h["tokens"] for h in hyps] for hyps in lines]


@pytest.fixture(scope="module")
def near_ties(workdir):
    """Our model's scores of two outputs, and each input line's source ids as decode.py
    encodes them."""
    from attention_jax.training.workdir import load_workdir

    model, config, _, tokenizer = load_workdir(workdir)
    ties = NearTies(model, penalty="average", alpha=0.6)
    return ties, lambda data: source_ids(tokenizer, data, config.max_length)


# CTranslate2's rules: its length penalty, and its stop once K hypotheses have finished.
AS_CT2 = ("--length_penalty=average", "--stop=count")


@pytest.mark.parametrize("min_length", [1, 0])
def test_greedy_agrees_with_ours_on_every_line_but_near_ties(
    workdir,
    ct2_dirs,
    near_ties,
    tmp_path,
    min_length,
):
    src = tmp_path / "in.de"
    src.write_bytes(mixed_input(3, 60))
    args = [f"--input={src}", "--beam_size=1", "--output_format=jsonl", "--batch_tokens=64"]
    args.append(f"--min_length={min_length}")
    ours = run_decode(f"--workdir={workdir}", "--length_penalty=average", *args)
    theirs = run_decode(f"--ct2={ct2_dirs['float32']}", "--threads=1", *args)
    assert ours.returncode == 0 and theirs.returncode == 0, theirs.stderr.decode()
    a = [json.loads(x)["hypotheses"] for x in ours.stdout.decode().split("\n")[:-1]]
    b = [json.loads(x)["hypotheses"] for x in theirs.stdout.decode().split("\n")[:-1]]
    assert len(a) == len(b) == len(src.read_bytes().split(b"\n")) - 1
    ties, sources = near_ties
    result = ties.compare(sources(src.read_bytes()), hypotheses(ours), hypotheses(theirs), "greedy")
    assert result.ok, result.report()
    for x, y in zip(a, b, strict=True):
        if [h["tokens"] for h in x] != [h["tokens"] for h in y]:
            continue  # a near-tie
        assert [h["text"] for h in x] == [h["text"] for h in y]
        # Close, not equal: CTranslate2 takes the softmax over the tokens it may emit
        # (<pad> and <s> suppressed first), ours over all, so each token's log-probability
        # differs by -log(1 - P(<pad>) - P(<s>)): up to 0.3% of a score here.
        np.testing.assert_allclose(
            [h["score"] for h in y], [h["score"] for h in x], rtol=1e-2, atol=1e-3
        )
    if min_length:  # no translation ends at once (test_marian has a model that would)
        assert all(x[0]["tokens"] for x in a if x)
    err = theirs.stderr.decode()
    assert "from the CTranslate2 model in" in err and "tokens/s" in err


def test_beam_agrees_with_ours_on_every_line_but_near_ties(
    workdir,
    ct2_dirs,
    near_ties,
    tmp_path,
):
    src = tmp_path / "in.de"
    src.write_bytes(mixed_input(4, 80))
    args = ("--output_format=jsonl", "--n_best=2", f"--input={src}")
    ours = run_decode(f"--workdir={workdir}", *AS_CT2, *args)
    theirs = run_decode(f"--ct2={ct2_dirs['float32']}", *args)
    assert ours.returncode == 0 and theirs.returncode == 0, theirs.stderr.decode()
    ties, sources = near_ties
    a, b = hypotheses(ours), hypotheses(theirs)
    assert len(a) == len(b) == len(src.read_bytes().split(b"\n")) - 1
    result = ties.compare(sources(src.read_bytes()), a, b, "beam")
    assert result.ok, result.report()
    assert result.count("same") > 0.5 * len(a)  # not everything a tie


@pytest.mark.parametrize("beam", [1, 4])
def test_prefixes_agree_with_ours_on_every_line_but_near_ties(
    workdir,
    ct2_dirs,
    near_ties,
    tmp_path,
    beam,
):
    """--prefix through CTranslate2's target_prefix and through our search: every output
    starts with its prefix, and the lines are the same but at near-ties."""
    pairs = digit_pairs(np.random.default_rng(8), 40, max_words=8)
    src, prefix = tmp_path / "in.de", tmp_path / "prefix.en"
    src.write_text("".join(de + "\n" for de, _ in pairs))
    starts = [" ".join(en.split()[: i % 3]) for i, (_, en) in enumerate(pairs)]  # 0-2 words
    starts[5] = "nine nine"  # a start the source does not call for
    prefix.write_text("".join(p + "\n" for p in starts))
    args = [f"--input={src}", f"--prefix={prefix}", f"--beam_size={beam}", "--output_format=jsonl"]
    ours = run_decode(f"--workdir={workdir}", *AS_CT2, *args)
    theirs = run_decode(f"--ct2={ct2_dirs['float32']}", *args)
    assert ours.returncode == 0 and theirs.returncode == 0, theirs.stderr.decode()
    ties, sources = near_ties
    a, b = hypotheses(ours), hypotheses(theirs)
    starts_ids = [x[:-1] for x in sources("".join(p + "\n" for p in starts).encode())]
    for line, want in zip(a, starts_ids, strict=True):
        assert all(h[: len(want)] == want for h in line)
    result = ties.compare(
        sources(src.read_bytes()), a, b, "greedy" if beam == 1 else "beam", starts_ids
    )
    assert result.ok, result.report()
    assert result.count("same") > 0.5 * len(a)


def test_groups_side_by_side_give_what_one_group_at_a_time_gives(ct2_dirs):
    """On a CPU each of --threads workers translates its own group of one output limit;
    that must change nothing but the speed: every source gets the hypotheses, scores and
    order that one worker gives, and the progress counts add up."""
    import sentencepiece as spm

    d = ct2_dirs["float32"]
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    pairs = digit_pairs(np.random.default_rng(11), 60, max_words=14)
    sources = [[*sp.encode(s), EOS_ID] for s, _ in pairs]
    sources[7] = []  # an empty line gets no hypothesis
    one = CT2Translator.load(d, threads=1, search={"n_best": 2})
    three = CT2Translator.load(d, threads=3, search={"n_best": 2})
    assert (one.workers, three.workers) == (1, 3)
    # More groups than the 2 x 3 queued at once, so some wait for a free place.
    assert len(groups([len(s) for s in sources], three._extra, three.max_len)) > 6
    progress = []
    alone = one.translate(sources)
    together = three.translate(sources, progress=lambda i, h: progress.append((list(i), h)))
    assert together == alone and together[7] == [] and all(together[:7])
    done = [i for indices, _ in progress for i in indices]
    assert sorted(done) == [i for i in range(len(sources)) if i != 7]  # each source once
    pairs = [(i, h) for indices, found in progress for i, h in zip(indices, found, strict=True)]
    assert all(alone[i] == h for i, h in pairs)


def test_int8_gives_finite_sensible_translations(ct2_dirs, tmp_path):
    pairs = digit_pairs(np.random.default_rng(5), 40)
    src, ref = tmp_path / "in.de", tmp_path / "ref.en"
    src.write_text("".join(s + "\n" for s, _ in pairs))
    ref.write_text("".join(t + "\n" for _, t in pairs))
    r = run_decode(f"--ct2={ct2_dirs['int8']}", f"--input={src}", f"--reference={ref}",
                   "--n_best=2", "--output_format=jsonl")  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    objects = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert len(objects) == len(pairs)
    for obj in objects:
        scores = [h["score"] for h in obj["hypotheses"]]
        assert 1 <= len(scores) <= 2 and all(np.isfinite(scores)) and all(s < 0 for s in scores)
        assert scores == sorted(scores, reverse=True)
    exact = sum(o["hypotheses"][0]["text"] == t for o, (_, t) in zip(objects, pairs, strict=True))
    assert exact >= 0.9 * len(pairs), f"{exact}/{len(pairs)} exact"
    # (scores go to stderr when stdout holds the translations)
    assert float(r.stderr.decode().split("BLEU = ")[1].split()[0]) > 80
    # A CPU whose int8 kernels saturate is named; others are not warned.
    assert ("has no VNNI" in r.stderr.decode()) == int8_saturates()


@pytest.mark.slow  # ~15 s
def test_n_best_reference_and_long_lines_as_ours(workdir, ct2_dirs, near_ties, tmp_path):
    pairs = digit_pairs(np.random.default_rng(6), 12)
    lines = [s for s, _ in pairs] + ["", " ".join(["eins zwei drei"] * 6)]
    refs = [t for _, t in pairs] + ["", " ".join(["one two three"] * 6)]
    src, ref = tmp_path / "in.de", tmp_path / "ref.en"
    src.write_text("".join(x + "\n" for x in lines))
    ref.write_text("".join(x + "\n" for x in refs))
    args = [f"--input={src}", f"--reference={ref}", "--n_best=3", "--output_format=jsonl",
            "--max_length=7", "--long_lines=split", "--length_penalty=average"]  # fmt: skip
    args.append("--stop=count")
    ours = run_decode(f"--workdir={workdir}", *args)
    theirs = run_decode(f"--ct2={ct2_dirs['float32']}", *args)
    assert ours.returncode == 0 and theirs.returncode == 0, theirs.stderr.decode()
    a = [json.loads(x) for x in ours.stdout.decode().splitlines() if x.startswith("{")]
    b = [json.loads(x) for x in theirs.stdout.decode().splitlines() if x.startswith("{")]
    assert len(b) == len(lines) and b[-2] == {"hypotheses": []}
    assert b[-1]["hypotheses"][0]["text"] == refs[-1]  # split into pieces of <= 7 tokens
    assert all(len(y["hypotheses"]) <= 3 for y in b)
    ties, sources = near_ties  # the lines of one segment (max_length 7: the split one is not)
    one = [
        i for i, line in enumerate(lines) if line and len(sources(line.encode() + b"\n")[0]) <= 7
    ]
    tokens = lambda runs: [[h["tokens"] for h in runs[i]["hypotheses"]] for i in one]
    srcs = [sources(lines[i].encode() + b"\n")[0] for i in one]
    result = ties.compare(srcs, tokens(a), tokens(b), "beam")
    assert result.ok, result.report()
    assert "1 line(s) over 7 tokens split" in theirs.stderr.decode()
    assert "BLEU = 100.00" in theirs.stderr.decode() and "chrF = " in theirs.stderr.decode()


@pytest.mark.slow  # ~23 s; the JAX path's resume is tested in make test
def test_ct2_job_resumes_after_sigkill_and_refuses_a_changed_model(ct2_dirs, tmp_path):
    pairs = digit_pairs(np.random.default_rng(9), 24)
    src = tmp_path / "in.de"
    src.write_text("".join(s + "\n" for s, _ in pairs))
    args = [f"--ct2={ct2_dirs['float32']}", f"--input={src}", "--read_lines=8", "--threads=1"]
    whole = run_decode(*args, WHOLE)
    assert whole.returncode == 0, whole.stderr.decode()
    out = tmp_path / "out.en"
    assert run_killed(16, 1, *args, f"--output={out}").returncode == -signal.SIGKILL
    partial = (tmp_path / f"out.en{PARTIAL}").read_bytes()
    for change, message in (
        (["--beam_size=2"], "settings.beam_size: 4 -> 2"),
        (["--threads=2"], "settings.threads: 1 -> 2"),
    ):
        r = run_decode(*args, *change, f"--output={out}")
        err = r.stderr.decode()
        assert r.returncode == 1 and message in err and "--restart" in err, err
    assert (tmp_path / f"out.en{PARTIAL}").read_bytes() == partial
    r = run_decode(*args, f"--output={out}")
    assert r.returncode == 0 and "8 lines were done" in r.stderr.decode(), r.stderr.decode()
    assert out.read_bytes() == whole.stdout
    # Another model in the same directory (rewritten files): refused.
    assert run_killed(16, 0, *args, f"--output={out}").returncode == -signal.SIGKILL
    settings = os.path.join(ct2_dirs["float32"], "decoding.json")
    os.utime(settings, ns=(os.stat(settings).st_atime_ns, os.stat(settings).st_mtime_ns + 10**9))
    r = run_decode(*args, f"--output={out}")
    assert r.returncode == 1 and "model.files" in r.stderr.decode(), r.stderr.decode()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ct2={ct2}", "--workdir={workdir}"], "--ct2 translates on its own"),
        (["--ct2=/nonexistent/ct2"], "decoding.json is missing"),
        (["--ct2={workdir}"], "decoding.json is missing"),
        (["--ct2={ct2}", "--alignment", "--output_format=jsonl"], "need the trained model"),
        (["--ct2={ct2}", "--length_penalty=gnmt"], "--length_penalty=gnmt needs the JAX"),
        (["--ct2={ct2}", "--stop=heuristic"], "--stop=heuristic is for the JAX decoder"),
        (["--ct2={ct2}", "--device=cuda"], "CTranslate2 sees no CUDA device"),
        (["--ct2={ct2}", "--threads=-1"], "--threads must be >= 0"),
        (["--ct2={ct2}", "--n_best=5"], "--n_best must be in [1, --beam_size=4]"),
        (["--workdir={workdir}", "--quantization=int8"], "--quantization is for --export_ct2"),
        (["--workdir={workdir}", "--threads=2"], "--device and --threads are for --ct2"),
        (["--export_ct2=/tmp/x"], "--export_ct2 converts a trained model: give --workdir"),
        (["--workdir={workdir}", "--export_ct2=/tmp/x", "--quantization=int4"], "int4"),
    ],
)
def test_ct2_user_errors_give_one_clear_line(workdir, ct2_dirs, args, message):
    args = [a.format(ct2=ct2_dirs["float32"], workdir=workdir) for a in args]
    r = run_decode(*args, stdin=b"eins\n")
    err = r.stderr.decode()
    assert r.returncode == 1 and message in err and "Traceback" not in err, err
    assert r.stdout == b""


def test_a_directory_missing_its_model_is_refused(ct2_dirs, tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    for name in ("decoding.json", "shared_vocabulary.json", "tokenizer.model"):
        os.symlink(os.path.join(ct2_dirs["float32"], name), d / name)
    r = run_decode(f"--ct2={d}", stdin=b"eins\n")
    err = r.stderr.decode()
    assert r.returncode == 1 and "model.bin is missing" in err and "Traceback" not in err


def test_without_ctranslate2_the_flags_say_how_to_install_it(workdir, ct2_dirs, tmp_path):
    stub = tmp_path / "stub" / "ctranslate2"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named ctranslate2')\n")
    env_path = f"{tmp_path / 'stub'}{os.pathsep}"
    for args in ([f"--ct2={ct2_dirs['float32']}"], [f"--workdir={workdir}", "--export_ct2=/tmp/x"]):
        r = run_decode(*args, stdin=b"eins\n", pythonpath=env_path)
        err = r.stderr.decode()
        assert r.returncode == 1 and "pip install '.[serve]'" in err, err
        assert "Traceback" not in err


def test_scores_are_score_batchs_for_references_and_beam_outputs(workdir, ct2_dirs, tmp_path):
    """decode.py --score with our model (--workdir) and with CTranslate2 (--ct2), against
    plain CTranslate2's `score_batch` on the same pieces: every line within 1e-3
    (relative), no NaN; for the references, and for our beam search's outputs."""
    import ctranslate2
    import sentencepiece as spm

    pairs = digit_pairs(np.random.default_rng(12), 60, max_words=9)
    src = tmp_path / "in.de"
    src.write_text("".join(s + "\n" for s, _ in pairs))
    beam = run_decode(f"--workdir={workdir}", f"--input={src}", "--output_format=jsonl")
    assert beam.returncode == 0, beam.stderr.decode()
    outputs = [json.loads(x)["hypotheses"][0]["text"] for x in beam.stdout.decode().splitlines()]
    tokenizer = spm.SentencePieceProcessor(model_file=os.path.join(workdir, "tokenizer.model"))
    plain = ctranslate2.Translator(ct2_dirs["float32"], device="cpu")
    sources = [tokenizer.encode(s, out_type=str) for s, _ in pairs]
    for name, targets in (("references", [t for _, t in pairs]), ("beam outputs", outputs)):
        given = tmp_path / f"{name}.en"
        given.write_text("".join(t + "\n" for t in targets))
        want = plain.score_batch(sources, [tokenizer.encode(t, out_type=str) for t in targets])
        want = [float(np.sum(r.log_probs)) for r in want]
        for flag in (f"--workdir={workdir}", f"--ct2={ct2_dirs['float32']}"):
            r = run_decode(flag, f"--input={src}", f"--score={given}")
            assert r.returncode == 0, r.stderr.decode()
            got = [json.loads(x)["score"] for x in r.stdout.decode().splitlines()]
            assert not np.isnan(got).any(), (name, flag)
            np.testing.assert_allclose(got, want, rtol=1e-3, err_msg=f"{name}, {flag}")

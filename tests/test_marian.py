"""OPUS-MT / Marian models imported into our model (backends/marian.py), against an
implementation we did not write: CTranslate2's own OPUS-MT converter and translator.

The tests write small Marian models themselves, with Marian's parameter names,
`special:model.yml`, a joint vocabulary and decoder.yml, as an OPUS-MT release
lays them out.
"""

import json
import os

import jax
import numpy as np
import pytest
import yaml

from attention_jax import EOS_ID, shift_right
from attention_jax.backends import marian
from attention_jax.data.tokenizer import MARIAN_VOCAB
from attention_jax.runtime.errors import UserError
from attention_jax.search.decoding import translate
from attention_jax.search.scoring import EXTRA_DECODE_LEN
from tests.marian_files import (
    PIECES,
    opus_mt_directory,
    vocab_yml,
    write_hugging_face,
    write_marian,
)
from tests.models import forward

ctranslate2 = pytest.importorskip("ctranslate2")


def sentences(seed: int, n: int):
    rng = np.random.default_rng(seed)
    make = lambda: rng.integers(2, len(PIECES), size=rng.integers(1, 9)).tolist()
    return [(make(), make()) for _ in range(n)]


def our_log_probs(model, data):
    """Per pair, log P(token | source, prefix) of each target token and EOS (Marian ids)."""
    ids = marian.our_ids(len(PIECES))
    width = 12
    src = np.zeros((len(data), width), np.int32)
    tgt = np.zeros((len(data), width), np.int32)
    for i, (s, t) in enumerate(data):
        src[i, : len(s) + 1] = [*ids[s], EOS_ID]
        tgt[i, : len(t) + 1] = [*ids[t], EOS_ID]
    logp = np.asarray(jax.nn.log_softmax(forward(model, src, shift_right(tgt))))
    picked = np.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    return [picked[i, : len(t) + 1] for i, (_, t) in enumerate(data)]


def ct2_model(directory, out) -> "ctranslate2.Translator":
    ctranslate2.converters.OpusMTConverter(directory).convert(str(out))
    return ctranslate2.Translator(str(out), device="cpu")


@pytest.mark.parametrize(
    "options",
    [
        dict(eos=1.0),  # OPUS-MT's usual: post-norm, swish, tied, sinusoids
        dict(activation="relu", pre_norm=True, tied=False, wpos=True, logit_bias=False),
    ],
)
def test_an_imported_model_scores_and_translates_as_ctranslate2s_conversion(tmp_path, options):
    directory = write_marian(tmp_path / "opus", 1, **options)
    model, pieces = marian.load_marian(directory)
    assert pieces[:4] == ["<pad>", "</s>", "<s>", "<unk>"] and pieces[4:] == PIECES[2:]
    translator = ct2_model(directory, tmp_path / "ct2")
    data = sentences(2, 16)
    scored = translator.score_batch(
        [[PIECES[i] for i in s] for s, _ in data], [[PIECES[i] for i in t] for _, t in data]
    )
    for want, got in zip(our_log_probs(model, data), scored, strict=True):
        np.testing.assert_allclose(want, got.log_probs, atol=1e-4)
    # Greedy search: the same tokens on every line.
    ids = marian.our_ids(len(PIECES))
    src = np.zeros((len(data), 12), np.int32)
    for i, (s, _) in enumerate(data):
        src[i, : len(s) + 1] = [*ids[s], EOS_ID]
    ours = np.asarray(translate(model, src, beam_size=1))
    theirs = translator.translate_batch(
        [[PIECES[i] for i in s] for s, _ in data], beam_size=1, max_decoding_length=60
    )
    ended = 0
    for (s, _), row, result in zip(data, ours, theirs, strict=True):
        got, want = [pieces[i] for i in row.tolist()], result.hypotheses[0]
        end = got.index("</s>")
        if end < len(s) + EXTRA_DECODE_LEN:  # ended before our length limit: so does theirs
            ended += 1
            assert got[:end] == want
        else:  # the limit (source + 50) came first: the same tokens up to it
            assert got[:end] == want[:end]
    assert ended >= (1 if options.get("eos") else 0)


def test_the_vocabulary_keeps_pieces_yaml_would_retype(tmp_path):
    path = tmp_path / "v.yml"
    path.write_text(vocab_yml(PIECES) + '? "long key"\n: 40\n', encoding="utf-8")
    assert marian.read_vocab(str(path)) == [*PIECES, "long key"]
    path.write_text("a: 0\nb: 2\n")
    with pytest.raises(UserError, match=r"ids are not 0\.\.1"):
        marian.read_vocab(str(path))


def test_quoted_pieces_read_as_yaml_reads_them(tmp_path):
    # Printable text is read without YAML's parser; anything else goes through it.
    pieces = [" lead", "trail ", "it's", "a#b", "- x", "[x]", "{x}", "&a", "*a", "!x", "%x",
              "@x", "`x`", "|", ">", ",", "?", "é", "▁", "tab\there", 'say "hi"',
              "back\\slash", "nbsp\xa0", "''", '"', "'", "line\u2028sep"]  # fmt: skip
    double = [json.dumps(p, ensure_ascii=False) for p in pieces]
    single = ["'" + p.replace("'", "''") + "'" for p in pieces]
    keys = double + single
    path = tmp_path / "v.yml"
    path.write_text("".join(f"{k}: {i}\n" for i, k in enumerate(keys)), encoding="utf-8")
    got = marian.read_vocab(str(path))
    assert got == [str(yaml.safe_load(k)) for k in keys]
    assert got[: len(pieces) - 1] == pieces[:-1]  # YAML folds a line separator


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("transformer-decoder-autoreg", "average-attention", "--transformer-decoder-autoreg"),
        ("type", "s2s", "--type 's2s'"),
        ("right-left", True, "--right-left True"),
        ("transformer-ffn-activation", "gelu", "relu or swish only"),
        ("transformer-postprocess-emb", "dn", "a LayerNorm on embeddings"),
    ],
)
def test_options_we_cannot_honour_are_refused_by_name(tmp_path, option, value, message):
    directory = write_marian(tmp_path / "opus")
    npz = os.path.join(directory, "opus.npz")
    arrays, options = marian.read_npz(npz)
    options[option] = value
    arrays["special:model.yml"] = np.frombuffer(yaml.safe_dump(options).encode() + b"\0", np.int8)
    np.savez(npz, **arrays)
    with pytest.raises(UserError, match="cannot be imported: .*" + message.replace("(", r"\(")):
        marian.load_marian(directory)


def test_untrusted_or_broken_directories_are_one_clear_error(tmp_path):
    directory = write_marian(tmp_path / "opus")
    with open(os.path.join(directory, "opus.vocab.yml"), "a", encoding="utf-8") as f:
        f.write('"extra": 40\n')
    with pytest.raises(UserError, match="vocabulary has 41 tokens, the embedding 40 rows"):
        marian.load_marian(directory)
    pickled = tmp_path / "hf"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(UserError, match="pickle, which is never loaded"):
        marian.load_marian(str(pickled))
    np.save(tmp_path / "bad.npy", np.array([object()], dtype=object), allow_pickle=True)
    objects = tmp_path / "objects"
    objects.mkdir()
    np.savez(objects / "m.npz", x=np.array([{"a": 1}], dtype=object))
    (objects / "m.vocab.yml").write_text(vocab_yml(PIECES), encoding="utf-8")
    with pytest.raises(UserError, match=r"not a readable \.npz of arrays"):
        marian.load_marian(str(objects))
    with pytest.raises(UserError, match="not a directory"):
        marian.load_marian(str(tmp_path / "nothing"))


def at_limit_with_eos(translator, src: list[str], out, most: int) -> list[str]:
    """CTranslate2's best hypothesis once those cut by the length limit are scored with the
    EOS ours forces there (CTranslate2 ranks them without it), as backends/ct2.py does."""
    scores = list(out.scores)
    for k, hyp in enumerate(out.hypotheses):
        if len(hyp) >= most:
            logp = translator.score_batch([src], [hyp])[0].log_probs  # EOS included
            scores[k] = float(np.sum(logp)) / len(logp)  # length penalty 1: the mean
    return out.hypotheses[int(np.argmax(scores))]


@pytest.mark.parametrize(
    ("beam", "min_length"), [(1, 1), (1, 0), (4, 1), pytest.param(4, 0, marks=pytest.mark.slow)]
)
def test_decode_py_translates_an_opus_mt_directory_as_ctranslate2_does(tmp_path, beam, min_length):
    """decode.py --marian end to end (source.spm, the vocabulary, our model, target.spm)
    against CTranslate2's conversion of the same directory, with CTranslate2's rules
    (its length penalty, its stop once K hypotheses have finished, its minimum length):
    every line the same but at near-ties (tests/parity.py). The model favours </s> so
    that translations end, as a trained model's do; at --min_length=0 it ends some at
    once, where 1 forbids it."""
    from tests.decode_runs import run_decode
    from tests.parity import NearTies

    # With a stronger pull to </s>, some lines would end at once.
    directory, lines, procs = opus_mt_directory(tmp_path, eos=2.0 if min_length else 5.0)
    (tmp_path / "in.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    translator = ct2_model(directory, tmp_path / "ct2")
    flags = [] if beam == 1 else ["--length_penalty=average", "--alpha=1.0", "--stop=count"]
    ours = run_decode(
        f"--marian={directory}", f"--input={tmp_path / 'in.de'}", f"--beam_size={beam}",
        f"--min_length={min_length}", "--output_format=jsonl", *flags,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr.decode()[-2000:]
    assert "the Marian model in" in ours.stderr.decode()
    model, tokenizer = marian.load_directory(directory)
    ids = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    theirs, sources = [], []
    for line in lines:
        src = procs[0].encode(line, out_type=str)
        most = len(src) + EXTRA_DECODE_LEN
        out = translator.translate_batch(
            [src], beam_size=beam, num_hypotheses=beam, length_penalty=1.0,
            min_decoding_length=min_length, max_decoding_length=most, return_scores=True,
        )[0]  # fmt: skip
        theirs.append([[ids[p] for p in at_limit_with_eos(translator, src, out, most)]])
        sources.append([*tokenizer.encode(line), EOS_ID])
    got = [
        [h["tokens"] for h in json.loads(x)["hypotheses"]]
        for x in ours.stdout.decode().split("\n")[:-1]
    ]
    ties = NearTies(model, penalty="average" if beam > 1 else "gnmt", alpha=1.0 if beam > 1 else 0)
    result = ties.compare(sources, got, theirs, "beam" if beam > 1 else "greedy")
    assert result.ok, result.report()
    empty = sum(1 for hyps in got if hyps and not hyps[0])
    assert (empty == 0) if min_length else (empty > 0), empty


@pytest.mark.slow  # ~20 s of decode.py runs; the export round trips of a workdir are in make test
def test_an_imported_model_exports_to_ctranslate2_and_stablehlo_and_translates_the_same(
    tmp_path,
):
    """--marian with --export_ct2 and with --export: the exports (their tokenizer is
    Marian's two SentencePiece models and the vocabulary) translate as --marian does."""
    from tests.decode_runs import run_decode

    directory, lines, _ = opus_mt_directory(tmp_path)
    src = tmp_path / "in.de"
    src.write_text("\n".join(lines[:30]) + "\n", encoding="utf-8")
    common = (f"--input={src}", "--beam_size=1")
    want = run_decode(f"--marian={directory}", *common)
    assert want.returncode == 0, want.stderr.decode()[-2000:]
    for flag, use in (("--export_ct2", "--ct2"), ("--export", "--exported")):
        out = tmp_path / flag.strip("-")
        made = run_decode(f"--marian={directory}", f"{flag}={out}", "--beam_size=1")
        assert made.returncode == 0, made.stderr.decode()[-2000:]
        assert (out / "source.spm").is_file() and (out / MARIAN_VOCAB).is_file()
        got = run_decode(f"{use}={out}", *common)  # greedy: no length penalty in play
        assert got.returncode == 0, got.stderr.decode()[-2000:]
        assert got.stdout == want.stdout, use


def test_the_hugging_face_layout_of_the_same_weights_imports_to_identical_parameters(tmp_path):
    from flax import nnx

    directory = write_marian(tmp_path / "opus", 5)
    hf = write_hugging_face(directory, tmp_path / "hf")
    a, pieces_a = marian.load_marian(directory)
    b, pieces_b = marian.load_marian(hf)
    assert pieces_a == pieces_b and a.config == b.config
    flat = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))
    pa, pb = flat(a), flat(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        np.testing.assert_array_equal(pa[key][...], pb[key][...], err_msg=str(key))


def test_decode_py_scores_an_opus_mt_directory_as_ctranslate2_does(tmp_path):
    """decode.py --marian --score (source.spm, target.spm, the vocabulary, our model)
    against `score_batch` of CTranslate2's conversion of the same directory."""
    from tests.decode_runs import run_decode

    directory, lines, procs = opus_mt_directory(tmp_path)
    lines = lines[:40]
    rng = np.random.default_rng(4)
    given = [" ".join(rng.permutation(line.split())) for line in lines]  # any target text
    (tmp_path / "in.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "given.en").write_text("\n".join(given) + "\n", encoding="utf-8")
    r = run_decode(
        f"--marian={directory}", f"--input={tmp_path / 'in.de'}",
        f"--score={tmp_path / 'given.en'}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    got = [json.loads(x) for x in r.stdout.decode().splitlines()]
    translator = ct2_model(directory, tmp_path / "ct2")
    want = translator.score_batch(
        [procs[0].encode(x, out_type=str) for x in lines],
        [procs[1].encode(x, out_type=str) for x in given],
    )
    for row, result in zip(got, want, strict=True):
        assert len(row["token_log_probs"]) == len(result.log_probs)
        np.testing.assert_allclose(row["token_log_probs"], result.log_probs, atol=1e-4)
        assert row["score"] == pytest.approx(float(np.sum(result.log_probs)), rel=1e-3)

"""decode.py --long_lines=sentences: a paragraph translated sentence by sentence, one
output line per input line (inference/sentences.py, inference/lines.py)."""

import numpy as np
import pytest

from attention_jax.inference.sentences import sentence_splitter
from tests.decode_runs import run_decode
from tests.digits import digit_pairs, hostile_input

pytest.importorskip("sentencex")


def test_the_splitter_cuts_at_sentence_ends_not_at_abbreviations():
    split = sentence_splitter("de")
    assert split("Das Haus ist alt. Dr. Müller kommt um 3.30 Uhr! Warum?") == [
        "Das Haus ist alt.",
        "Dr. Müller kommt um 3.30 Uhr!",
        "Warum?",
    ]
    assert split("Mr. Smith went home.") == ["Mr. Smith went home."]
    assert sentence_splitter("en")("Mr. Smith went home. He slept.") == [
        "Mr. Smith went home.",
        "He slept.",
    ]


def test_a_paragraph_gives_the_words_of_its_sentences_translated_one_by_one(workdir, tmp_path):
    rng = np.random.default_rng(31)
    sentences = [s.capitalize() + "." for s, _ in digit_pairs(rng, 15, max_words=5)]
    paragraphs = [" ".join(sentences[i : i + 5]) for i in range(0, 15, 5)]
    (tmp_path / "para.de").write_text("\n".join(paragraphs) + "\n")
    (tmp_path / "one.de").write_text("\n".join(sentences) + "\n")
    para = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'para.de'}",
                      "--long_lines=sentences", "--source_lang=de")  # fmt: skip
    one = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'one.de'}")
    assert para.returncode == 0 and one.returncode == 0, para.stderr.decode()
    got = para.stdout.decode().split("\n")[:-1]
    each = one.stdout.decode().split("\n")[:-1]
    assert got == [" ".join(each[i : i + 5]) for i in range(0, 15, 5)]
    # the workdir's config.source_lang (de) is the default language
    again = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'para.de'}",
                       "--long_lines=sentences")  # fmt: skip
    assert again.stdout == para.stdout


@pytest.mark.slow  # ~15 s (three jobs); one output line per input line: the paragraph test
def test_no_line_is_shifted_or_dropped(workdir, tmp_path):
    """The hostile input (empty, blank, bad UTF-8, CRLF and over-long lines): one output
    line per input line; a line of one sentence as --long_lines=truncate translates it,
    the over-long one as --long_lines=split does."""
    data, expected = hostile_input(seed=4, n=30)
    (tmp_path / "in.de").write_bytes(data)
    runs, errs = {}, {}
    for mode in ("sentences", "truncate", "split"):
        r = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'in.de'}",
                       f"--long_lines={mode}", "--beam_size=2")  # fmt: skip
        assert r.returncode == 0, r.stderr.decode()
        runs[mode], errs[mode] = r.stdout.decode().split("\n")[:-1], r.stderr.decode()
    assert len(runs["sentences"]) == len(expected)
    for i, (got, want) in enumerate(zip(runs["sentences"], runs["truncate"], strict=True)):
        assert got == (runs["split"][i] if i == 13 else want), i  # 13: 100 words
    assert "1 sentence(s) over 64 tokens split" in errs["sentences"]


def test_prefixes_apply_to_a_lines_first_sentence(workdir, tmp_path):
    rng = np.random.default_rng(5)
    pairs = digit_pairs(rng, 6, max_words=4)
    first = " ".join(s.capitalize() + "." for s, _ in pairs[:3])
    (tmp_path / "in.de").write_text(f"{first}\n{pairs[3][0]}.\n")
    (tmp_path / "prefix.en").write_text("nine\n\n")
    r = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'in.de'}",
                   "--long_lines=sentences", f"--prefix={tmp_path / 'prefix.en'}")  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().split("\n")[:-1]
    (tmp_path / "s.de").write_text("".join(s.capitalize() + ".\n" for s, _ in pairs[:3]))
    (tmp_path / "s.en").write_text("nine\n\n\n")
    alone = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 's.de'}",
                       f"--prefix={tmp_path / 's.en'}")  # fmt: skip
    assert lines[0] == " ".join(alone.stdout.decode().split("\n")[:-1])
    assert lines[0].startswith("nine")


def test_a_lines_phrase_is_met_once_in_the_sentence_that_makes_it_likeliest(workdir, tmp_path):
    """Each phrase goes to the sentence under which the model gives its tokens the highest
    log-probability (found here with Translator.score): the line is each sentence
    translated with the phrases it got, and constraints_met is per phrase of the line."""
    import json

    from attention_jax import Translator

    sentences = ["Eins zwei drei.", "Vier sieben fünf.", "Sechs acht."]
    phrases = ["seven", "six"]
    (tmp_path / "para.de").write_text(" ".join(sentences) + "\n")
    (tmp_path / "terms.tsv").write_text("\t".join(phrases) + "\n")
    r = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'para.de'}",
                   "--long_lines=sentences", f"--constraints={tmp_path / 'terms.tsv'}",
                   "--output_format=jsonl")  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()
    best = json.loads(r.stdout.decode())["hypotheses"][0]
    assert best["constraints_met"] == [True, True]
    scorer, given = Translator(workdir), [[] for _ in sentences]
    for phrase in phrases:  # the first of the likeliest, EOS left out
        logp = [sum(r.token_log_probs[:-1]) for r in scorer.score(sentences, [phrase] * 3)]
        given[int(np.argmax(logp))].append(phrase)
    (tmp_path / "one.de").write_text("".join(s + "\n" for s in sentences))
    (tmp_path / "one.tsv").write_text("".join("\t".join(g) + "\n" for g in given))
    alone = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'one.de'}",
                       f"--constraints={tmp_path / 'one.tsv'}")  # fmt: skip
    assert best["text"] == " ".join(alone.stdout.decode().split("\n")[:-1])


def test_scores_of_sentences_are_refused_in_one_line(workdir, tmp_path):
    (tmp_path / "in.de").write_text("Eins. Zwei.\n")
    r = run_decode(f"--workdir={workdir}", f"--input={tmp_path / 'in.de'}",
                   "--long_lines=sentences", f"--score={tmp_path / 'in.de'}")  # fmt: skip
    assert r.returncode == 1 and "drop --long_lines=sentences" in r.stderr.decode()
    assert len(r.stderr.decode().strip().splitlines()) == 1


def test_the_library_splits_sentences_as_decode_py(workdir):
    from attention_jax import Translator

    translator = Translator(workdir)
    rng = np.random.default_rng(8)
    sentences = [s.capitalize() + "." for s, _ in digit_pairs(rng, 4, max_words=4)]
    joined = translator.translate([" ".join(sentences)], long_lines="sentences", source_lang="de")
    assert joined == [" ".join(translator.translate(sentences))]

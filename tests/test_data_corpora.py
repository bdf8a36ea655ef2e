"""Corpora: Ding parsing, splits, cache, TSV and TFDS sources."""

import os

import numpy as np
import pytest
from ml_collections import ConfigDict

from attention_jax.configs import default
from attention_jax.data import corpora, load_split
from attention_jax.runtime.errors import UserError

REAL_DING = corpora.DING_PATH


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTENTION_JAX_DING", raising=False)


def make_config(**kw) -> ConfigDict:
    c = default.get_config()
    c.update(kw)
    return c


# Ding lines in the file's format, with their expected pairs written by hand.
DING_FIXTURE = [
    "# Version :: devel 2023-01-30",
    "Aalsuppe {f} [cook.] | Aalsuppen {pl} :: eel soup | eel soups",
    "Aal {m} :: eel",
    "Aalräucherei {f} | Aalräuchereien {pl} :: eel smokery; eel-smoking business "
    "<eelsmoking business> | eel smokeries; eel-smoking businesses",
    "Endotrachealtubus {m} [med.] | der weiche Tubus :: endotracheal tube /ET/ /ETT/ | "
    "the soft tube /ST/",
    "auf etw. nicht eingehen {vi} | Er ging auf die Lösegeldforderung nicht ein. | "
    "Sie ist auf mein Gegenargument nicht eingegangen. :: to ignore sth. | "
    "He ignored the ransom demand. | She has ignored my counterargument.",
    "Laune {f} | gute Laune haben | schlechte Laune :: temper | to be in a good temper",
    "Das ist Unsinn. [ugs.]; Das ist Quatsch. :: That is nonsense.",
]


def test_clean_ding_text_strips_annotations():
    assert corpora.clean_ding_text("Aalsuppe {f} [cook.]") == "Aalsuppe"
    assert corpora.clean_ding_text("endotracheal tube /ET/ /ETT/") == "endotracheal tube"
    assert corpora.clean_ding_text("eel smokery <eelsmoking>  x") == "eel smokery x"
    assert corpora.clean_ding_text("Er kam [ugs.] .") == "Er kam."


def test_parse_ding_fixture():
    sentences, phrases = corpora.parse_ding(DING_FIXTURE)
    assert sentences == [
        ("Er ging auf die Lösegeldforderung nicht ein.", "He ignored the ransom demand."),
        (
            "Sie ist auf mein Gegenargument nicht eingegangen.",
            "She has ignored my counterargument.",
        ),
    ]
    # Single words ("Aal :: eel") and lines with synonyms on a side give nothing.
    assert phrases == [
        ("der weiche Tubus", "the soft tube"),
        ("auf etw. nicht eingehen", "to ignore sth."),
    ]


def test_parse_ding_drops_unaligned():
    # 3 German sub-entries vs 2 English ones: the whole line is dropped.
    assert corpora.parse_ding_line(DING_FIXTURE[6]) == []
    # Synonyms on one side are not aligned with the other side: dropped.
    assert corpora.parse_ding_line(DING_FIXTURE[7]) == []
    assert corpora.parse_ding_line("# comment :: x") == []
    assert corpora.parse_ding_line("no separator here") == []


def _write_ding(path, n_sentences=120, n_phrases=80):
    lines = ["# Version :: test"]
    for i in range(n_sentences):
        lines.append(f"Satz {{m}} | Das ist Satz Nummer {i}. :: sentence | This is sentence {i}.")
    for i in range(n_phrases):
        lines.append(f"rote Blume {i} {{f}} [bot.] :: red flower {i}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_ding_splits_disjoint_stable_and_cached(tmp_path, monkeypatch):
    path = _write_ding(tmp_path / "de-en")
    monkeypatch.setenv("ATTENTION_JAX_DING", str(path))
    config = make_config()
    splits = {s: load_split(config, s) for s in ("train", "dev", "test")}
    # 120 sentences: dev and test get 120 // 4 = 30 each, all full sentences.
    assert len(splits["dev"]) == len(splits["test"]) == 30
    assert len(splits["train"]) == 120 - 60 + 80
    as_set = {s: {c[i] for i in range(len(c))} for s, c in splits.items()}
    assert not as_set["dev"] & as_set["test"]
    assert not as_set["train"] & (as_set["dev"] | as_set["test"])
    for s in ("dev", "test"):
        assert all(src.startswith("Das ist Satz") for src, _ in as_set[s])

    # Second run: served from the cache, the parser is not called.
    monkeypatch.setattr(corpora, "parse_ding", lambda *a: pytest.fail("parsed again"))
    again = load_split(config, "dev")
    assert [again[i] for i in range(len(again))] == [
        splits["dev"][i] for i in range(len(splits["dev"]))
    ]
    # Direction swap: English -> German.
    rev = load_split(make_config(source_lang="en", target_lang="de"), "dev")
    assert rev[0] == splits["dev"][0][::-1]


def test_ding_cache_invalidated_when_file_changes(tmp_path, monkeypatch):
    path = _write_ding(tmp_path / "de-en", n_sentences=40)
    monkeypatch.setenv("ATTENTION_JAX_DING", str(path))
    n1 = len(load_split(make_config(), "train"))
    _write_ding(path, n_sentences=40, n_phrases=10)
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    assert len(load_split(make_config(), "train")) == n1 - 70


def test_ding_missing_file_message(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTENTION_JAX_DING", str(tmp_path / "nope"))
    with pytest.raises(UserError, match="apt-get install trans-de-en"):
        load_split(make_config(), "train")


def test_unknown_dataset_kind():
    with pytest.raises(UserError, match="Unknown dataset"):
        load_split(make_config(dataset="csv:foo"), "train")
    with pytest.raises(UserError, match="split"):
        load_split(make_config(), "validation")


@pytest.mark.slow  # ~18 s: parses the whole installed dictionary
@pytest.mark.skipif(not os.path.isfile(REAL_DING), reason="trans-de-en not installed")
def test_real_ding_file():
    config = make_config()
    train, dev, test = (load_split(config, s) for s in ("train", "dev", "test"))
    assert len(dev) == len(test) == 1000
    assert 60_000 < len(train) < 120_000
    held_out = {dev[i][0] for i in range(len(dev))} | {test[i][0] for i in range(len(test))}
    assert not held_out & set(train.sources)
    words = np.mean([len(dev[i][0].split()) for i in range(len(dev))])
    assert 5 < words < 12  # full sentences of ~8 words
    for i in range(0, len(train), 997):  # no annotation survives
        for side in train[i]:
            assert "{" not in side and "[" not in side and " :: " not in side


# --- TSV -----------------------------------------------------------------------


def test_tsv_malformed_lines_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "pairs.tsv"
    good = [f"quelle {i}\tziel {i}" for i in range(10)]
    bad = [b"no tab here", b"\tempty source", b"empty target\t", b"a\tb\tc", b"\xff\xfe\tx"]
    path.write_bytes(b"\n".join([g.encode() for g in good] + bad + [b""]))
    corpus, n_bad = corpora.read_tsv(str(path))
    assert n_bad == 5
    assert [corpus[i] for i in range(len(corpus))] == [
        (f"quelle {i}", f"ziel {i}") for i in range(10)
    ]
    assert "skipped 5 malformed" in capsys.readouterr().err


def test_tsv_mostly_malformed_is_an_error(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("a\tb\nno tab\nnone\nnada\n", encoding="utf-8")
    with pytest.raises(UserError, match="3 of 4 lines are malformed"):
        load_split(make_config(dataset=f"tsv:{path}"), "train")
    with pytest.raises(UserError, match="not found"):
        load_split(make_config(dataset=f"tsv:{tmp_path}/missing.tsv"), "train")


def test_tsv_dev_split_carved_out(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"s{i}\tt{i}\n" for i in range(200)), encoding="utf-8")
    config = make_config(dataset=f"tsv:{path}")
    parts = {s: load_split(config, s) for s in ("train", "dev", "test")}
    assert len(parts["dev"]) == len(parts["test"]) == 10  # 5% each
    ids = {s: {c[i][0] for i in range(len(c))} for s, c in parts.items()}
    assert ids["train"] | ids["dev"] | ids["test"] == {f"s{i}" for i in range(200)}
    assert len(ids["train"]) == 180
    assert not ids["dev"] & ids["test"]
    # With an explicit eval file, train is the whole file and dev is that file.
    eval_path = tmp_path / "dev.tsv"
    eval_path.write_text("x\ty\n", encoding="utf-8")
    config = make_config(dataset=f"tsv:{path}", eval_dataset=f"tsv:{eval_path}")
    assert len(load_split(config, "train")) == 200
    assert load_split(config, "dev")[0] == ("x", "y")


# --- TFDS --------------------------------------------------------------------------


class FakeDataSource:
    """Stands in for `tfds.data_source` (ArrayRecord): random access to dicts of bytes.

    `tfds.testing.mock_data` needs TensorFlow, which this project does not
    install, so the test replaces `tfds.data_source` itself.
    """

    def __init__(self, n):
        self.rows = [
            {"de": f"Hallo Welt {i}".encode(), "en": f"hello world {i}".encode()} for i in range(n)
        ]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_tfds_wmt_path(monkeypatch):
    import tensorflow_datasets as tfds

    calls = []

    def fake_data_source(name, split, data_dir=None):
        calls.append((name, split, data_dir))
        return FakeDataSource(7 if split == "train" else 3)

    monkeypatch.setattr(tfds, "data_source", fake_data_source)
    config = make_config(
        dataset="tfds:wmt14_translate/de-en",
        source_lang="en",
        target_lang="de",
        tfds_data_dir="/data/tfds",
    )
    train = load_split(config, "train")
    dev = load_split(config, "dev")
    assert len(train) == 7 and len(dev) == 3
    assert train[5] == ("hello world 5", "Hallo Welt 5")
    assert calls == [
        ("wmt14_translate/de-en", "train", "/data/tfds"),
        ("wmt14_translate/de-en", "validation", "/data/tfds"),
    ]
    with pytest.raises(UserError, match="languages"):
        load_split(make_config(dataset="tfds:x", source_lang="pt"), "train")


def test_tfds_missing_dataset_is_a_clear_error(monkeypatch):
    import tensorflow_datasets as tfds

    def missing(*a, **k):
        raise FileNotFoundError("no such dataset")

    monkeypatch.setattr(tfds, "data_source", missing)
    with pytest.raises(UserError, match="tfds build"):
        load_split(make_config(dataset="tfds:wmt17_translate/de-en"), "train")

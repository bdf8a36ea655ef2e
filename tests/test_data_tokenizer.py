"""SentencePiece tokenizers (ours and OPUS-MT's): special ids, round trips, deterministic
training, reuse, and encoding in the cache's worker processes."""

import os

import pytest
from ml_collections import ConfigDict

from attention_jax import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from attention_jax.configs import default
from attention_jax.data import Tokenizer, get_tokenizer
from attention_jax.data.corpora import ParallelCorpus
from attention_jax.runtime.errors import UserError

GERMAN = [
    "Grüße aus Köln, die Straße ist groß.",
    "Über den Fluss fährt eine Fähre.",
    "Die Bäume im Süden blühen früh.",
    "Wir müssen schnell nach Hause gehen.",
    "Das Mädchen isst gern süße Äpfel.",
]
ENGLISH = [
    "Greetings from Cologne, the street is big.",
    "A ferry crosses the river.",
    "The trees in the south blossom early.",
    "We must go home quickly.",
    "The girl likes to eat sweet apples.",
]


def corpus(repeat: int = 40) -> ParallelCorpus:
    # Numbered variants so that the text has enough distinct pieces.
    src = [f"{s} {i}" for i in range(repeat) for s in GERMAN]
    tgt = [f"{t} {i}" for i in range(repeat) for t in ENGLISH]
    return ParallelCorpus(src, tgt)


def config(**kw) -> ConfigDict:
    c = default.get_config()
    c.update(dict(vocab_size=320, tokenizer_type="unigram", tokenizer_sample_size=1000, seed=0))
    c.update(kw)
    return c


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return get_tokenizer(config(), str(tmp_path_factory.mktemp("wd")), corpus())


def test_special_ids(tokenizer):
    assert (PAD_ID, EOS_ID, BOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert tokenizer.id_to_piece(EOS_ID) == "</s>"
    assert tokenizer.id_to_piece(BOS_ID) == "<s>"
    assert tokenizer.id_to_piece(UNK_ID) == "<unk>"
    assert tokenizer.vocab_size == 320


@pytest.mark.parametrize(
    "text",
    [
        "Grüße aus Köln, die Straße ist groß.",
        "ÄÖÜ äöü ß ẞ",
        "Das Wetter ist schön 😀🎉",
        "Unbekannt: 漢字 ☃ Ω ∮ — «guillemets»",
        "",
    ],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert EOS_ID not in ids and BOS_ID not in ids
    assert tokenizer.decode(ids) == text
    # Characters never seen in training still round-trip (byte fallback, not <unk>).
    assert UNK_ID not in ids


def test_decode_stops_at_eos_and_skips_pad_bos(tokenizer):
    ids = tokenizer.encode("Die Bäume")
    tail = tokenizer.encode("blühen")
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID, *tail]) == "Die Bäume"
    assert tokenizer.decode([*ids, PAD_ID, PAD_ID]) == "Die Bäume"
    assert tokenizer.encode_batch(["Die Bäume", "blühen"]) == [ids, tail]


def test_training_deterministic_saved_and_reused(tmp_path):
    a = get_tokenizer(config(), str(tmp_path / "a"), corpus())
    b = get_tokenizer(config(), str(tmp_path / "b"), corpus())
    with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
        assert fa.read() == fb.read()
    assert a.path == os.path.join(str(tmp_path / "a"), "tokenizer.model")
    assert not [f for f in os.listdir(tmp_path / "a") if f.endswith(".tmp")]
    # Second call loads: an empty corpus would make training impossible.
    again = get_tokenizer(config(), str(tmp_path / "a"), ParallelCorpus([], []))
    assert again.encode("Fähre") == a.encode("Fähre")
    # A saved tokenizer larger than the config's vocabulary cannot be used (its ids would
    # not fit the embedding); a smaller one can (ids beyond it are never produced).
    with pytest.raises(UserError, match=r"vocabulary of 320, but config\.vocab_size is 310"):
        get_tokenizer(config(vocab_size=310), str(tmp_path / "a"), corpus())
    assert get_tokenizer(config(vocab_size=330), str(tmp_path / "a"), corpus()).vocab_size == 320


def test_a_vocabulary_below_what_the_corpus_needs_names_the_minimum(tmp_path):
    with pytest.raises(UserError) as e:
        get_tokenizer(config(vocab_size=262), str(tmp_path / "a"), corpus())
    msg = str(e.value)
    need = int(msg.split("need at least ")[1].split()[0])
    assert f"set --config.vocab_size={need} or more" in msg and "\n" not in msg
    assert 262 < need <= 320
    assert get_tokenizer(config(vocab_size=need), str(tmp_path / "b"), corpus()).vocab_size == need
    with pytest.raises(UserError):
        get_tokenizer(config(vocab_size=need - 1), str(tmp_path / "c"), corpus())


def test_a_vocabulary_above_what_the_corpus_supports_trains_at_the_most_it_has(tmp_path, capsys):
    tok = get_tokenizer(config(vocab_size=8000), str(tmp_path), corpus())
    assert 320 < tok.vocab_size < 8000
    err = capsys.readouterr().err
    assert f"supports only {tok.vocab_size} pieces, fewer than config.vocab_size=8000" in err
    assert os.path.isfile(os.path.join(tmp_path, "tokenizer.model"))  # saved; resumes load it
    assert (
        get_tokenizer(config(vocab_size=8000), str(tmp_path), corpus()).vocab_size == tok.vocab_size
    )


def test_bpe_option(tmp_path):
    tok = get_tokenizer(config(tokenizer_type="bpe"), str(tmp_path), corpus())
    assert tok.decode(tok.encode("Grüße 😀")) == "Grüße 😀"
    # An unknown tokenizer_type is caught by training.config.validate (tests/test_configs.py).


def test_an_opus_mt_tokenizer_cuts_targets_with_its_target_model_in_workers_too(
    tmp_path, monkeypatch
):
    """A MarianTokenizer (two SentencePiece models, one vocabulary) rebuilt in the worker
    processes from its files: the same arrays as in-process, targets cut by target.spm."""
    from attention_jax.data import cache
    from attention_jax.data.cache import ShardSpec, tokenized_shard
    from attention_jax.data.tokenizer import MarianTokenizer, train_tokenizer

    pairs = corpus()
    source = train_tokenizer(pairs.sources, 320)
    target = train_tokenizer(pairs.targets, 1000)  # whole words: it cuts otherwise
    probe = MarianTokenizer(source, target, [])
    pieces = ["<pad>", "</s>", "<s>", "<unk>"]
    for sp in (probe._source, probe._target):
        pieces += [p for p in map(sp.id_to_piece, range(sp.get_piece_size())) if p not in pieces]
    marian = MarianTokenizer(source, target, pieces)
    spec = ShardSpec(0, 1, 32, "drop")
    alone = tokenized_shard(pairs, marian, spec, cache_dir=None, workers=1)
    monkeypatch.setattr(cache, "PARALLEL_MIN_PAIRS", 0)
    monkeypatch.setattr(cache, "CHUNK_PAIRS", 50)
    pooled = tokenized_shard(pairs, marian, spec, cache_dir=None, workers=2)
    for field in ("src_flat", "src_len", "tgt_flat", "tgt_len", "index"):
        assert getattr(pooled, field).tolist() == getattr(alone, field).tolist(), field
    text = pairs.targets[alone.index[0]]
    want = [pieces.index(p) for p in marian._target.encode(text, out_type=str)]
    assert alone.tgt_flat[: alone.tgt_len[0]].tolist() == want
    assert want != marian.encode_batch([text])[0]  # the source model cuts it otherwise

"""Translate strings from Python, as decode.py does: a model directory in, texts out.

    from attention_jax import Translator

    translator = Translator("workdir/tiny")           # a training workdir, an export, ...
    translator.translate(["Das Haus ist klein."])     # ['The house is small.']
    results = translator.translate_batch(lines, beam_size=4, n_best=2)
    results[0].hypotheses, results[0].scores          # best first
    translator.score(lines, translations)[0].score    # log P(translation | line)

A `Translator` opens the directory with decode.py's own openers (inference/
translators.py: a training workdir, an exported translator, a CTranslate2 model, or
an OPUS-MT / Marian directory, npz or Hugging Face's safetensors), and translates a
list of lines with decode.py's own steps (inference/lines.py): each line stripped,
encoded, cut or truncated at `max_length`, batched by a token budget over every
local device, searched, and decoded. So its texts, scores and tokens are decode.py's
for the same lines and settings, byte for byte. Search settings are
search/settings.py `SearchSettings` fields, given when the translator is made or per
call (an exported translator fixes its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from attention_jax.inference.options import LONG_LINES, DecodeOptions
from attention_jax.inference.scores import encode_pairs, score_segments
from attention_jax.inference.sentences import splitter_for
from attention_jax.inference.stream import translate_encoded
from attention_jax.inference.targets import EncodedLines, encode_chunk
from attention_jax.inference.translators import Loaded, open_translator, reconfigure
from attention_jax.runtime.errors import UserError
from attention_jax.search.settings import SearchSettings

# What a directory holds -> the kind of model it is (the first that matches).
KINDS = ("exported", "ct2", "marian", "workdir")


@dataclasses.dataclass(frozen=True)
class TranslationResult:
    """One line's translations, best first (none for an empty line): as decode.py's jsonl
    gives them. scores: the length-normalized log-probabilities the search ranks by."""

    hypotheses: list[str]
    scores: list[float]
    tokens: list[list[int]]
    constraints_met: list[list[bool]] | None = None  # with constraints: per phrase


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """A given translation scored, as decode.py --score writes it: score = log P(tokens +
    EOS | line), natural log, unnormalized (None for an empty line: nothing to score);
    token_log_probs: one per token, EOS's last; tokens: the translation's ids."""

    score: float | None
    token_log_probs: list[float]
    tokens: list[int]


def model_kind(path: str) -> str:
    """Which of KINDS the directory `path` is, by the files it holds (ValueError if none)."""
    if not os.path.isdir(path):
        raise UserError(f"{path} is not a directory")
    names = set(os.listdir(path))
    if "metadata.json" in names and "params.npz" in names:
        return "exported"
    if {"model.bin", "decoding.json"} <= names:
        return "ct2"
    if "decoder.yml" in names or "model.safetensors" in names or "pytorch_model.bin" in names:
        return "marian"
    if "checkpoints" in names or "config.json" in names:
        return "workdir"
    raise UserError(
        f"{path} holds no model this library reads: a training workdir (config.json, "
        "checkpoints/), an exported translator, a CTranslate2 model or an OPUS-MT directory"
    )


class Translator:
    """A model directory, ready to translate lists of strings.

    Args:
      path: a training workdir (train.py's), an exported translator (decode.py
        --export), a CTranslate2 model (--export_ct2) or an OPUS-MT / Marian
        directory (the release's npz, decoder.yml, vocabulary and .spm files, or
        Hugging Face's MarianMT layout); or a list of training workdirs of one
        tokenizer, which translate and score as an ensemble (model/ensemble.py).
      kind: one of KINDS; None: from the files in `path`.
      checkpoint, checkpoint_step, average_last: a workdir's checkpoint ("best": the
        one of the best dev evaluation; else checkpoint_step, None: the newest), and
        how many of the last ones to average.
      device, threads: a CTranslate2 model's ("cpu" or "cuda"; 0 = one per core).
      compilation_cache: a directory where compiled programs are kept for the next
        process, as decode.py keeps them ("default": decode.py's own,
        ~/.cache/attention-jax/xla); it sets JAX's compilation cache for the process.
        None: programs live as long as this process.
      settings: SearchSettings fields (beam_size, alpha, n_best, length_penalty, stop,
        min_length, batch_tokens, max_constraints, constraint_tokens, ...): the
        defaults of every call.
    Raises:
      ValueError (attention_jax.runtime.errors.UserError) saying what is wrong.
    """

    def __init__(
        self,
        path: str | Sequence[str],
        *,
        kind: str | None = None,
        checkpoint: str = "last",
        checkpoint_step: int | None = None,
        average_last: int = 1,
        device: str | None = None,
        threads: int = 0,
        compilation_cache: str | None = None,
        **settings: Any,
    ):
        if not isinstance(path, str):  # several workdirs: an ensemble
            paths = list(path)
            for p in paths:
                if model_kind(p) != "workdir":
                    raise UserError(f"{p}: an ensemble is made of training workdirs")
            path, kind = ",".join(paths), "workdir"
        self.kind = kind or model_kind(path)
        if self.kind not in KINDS:
            raise UserError(f"kind must be one of {KINDS}, got {self.kind!r}")
        self._options = DecodeOptions(
            **{self.kind: path},
            checkpoint=checkpoint,
            checkpoint_step=checkpoint_step,
            average_last=average_last,
            device=device,
            threads=threads,
            output_format="jsonl",  # every hypothesis, as translate_batch returns them
            search=settings,
        )
        with _plain_errors():
            self._options.check()
            if compilation_cache is not None:
                _keep_programs(compilation_cache)
            self._loaded: Loaded = open_translator(self._options)

    @property
    def settings(self) -> SearchSettings:
        """The search every call runs unless it says otherwise."""
        return self._loaded.translator.settings

    @property
    def max_len(self) -> int:
        """The longest source the model takes, in tokens with EOS."""
        return self._loaded.translator.max_len

    def translate_batch(
        self,
        lines: Sequence[str],
        *,
        prefixes: Sequence[str] | None = None,
        constraints: Sequence[Sequence[str]] | None = None,
        max_length: int | None = None,
        long_lines: str = "truncate",
        source_lang: str | None = None,
        **settings: Any,
    ) -> list[TranslationResult]:
        """Each line's translations, in order, as decode.py --output_format=jsonl gives them.

        Args:
          lines: the sources, one sentence each (a newline inside one is a space).
          prefixes: per line, the text its translation must start with ("" : none).
          constraints: per line, the phrases its translation must contain.
          max_length: the longest source in tokens with EOS (None: the model's).
          long_lines: "truncate" a longer line, or "split" it into pieces translated
            one after another and joined; "sentences": translate every line sentence by
            sentence, joined with a space (docs/decoding.md).
          source_lang: the lines' language, for "sentences" (None: the workdir's).
          settings: SearchSettings fields for this call (e.g. beam_size=2, n_best=2).
        """
        with _plain_errors():
            loaded = self._searching(settings)
            chunk = _encode(
                loaded, lines, prefixes, constraints, max_length=max_length,
                long_lines=long_lines, source_lang=source_lang,
            )  # fmt: skip
            done = translate_encoded(loaded.translator, loaded.tokenizer, chunk)
        return [_result(line) for line in done.hypotheses]

    def _searching(self, settings: dict[str, Any]) -> Loaded:
        """The model, searching with these settings over the translator's own."""
        if not settings:
            return self._loaded
        options = dataclasses.replace(self._options, search={**self._options.search, **settings})
        options.check()
        return reconfigure(self._loaded, options)

    def score(
        self,
        lines: Sequence[str],
        translations: Sequence[str],
        *,
        max_length: int | None = None,
        batch_tokens: int | None = None,
    ) -> list[ScoreResult]:
        """Each translation's log-probability under the model, given its line: as
        decode.py --score writes them (inference/scores.py).

        Args:
          lines: the sources, one sentence each.
          translations: translations[i] is scored as a translation of lines[i].
          max_length: the longest source in tokens with EOS (None: the model's); a
            translation is cut at the model's max_len.
          batch_tokens: the padded tokens of a batch's wider side (None: the translator's).
        """
        if len(translations) != len(lines):
            raise UserError(f"{len(translations)} translations for {len(lines)} lines")
        with _plain_errors():
            loaded = self._searching({} if batch_tokens is None else {"batch_tokens": batch_tokens})
            max_len = loaded.translator.max_len
            pairs = encode_pairs(
                loaded.tokenizer,
                [line.replace("\n", " ") for line in lines],
                [t.replace("\n", " ") for t in translations],
                max_length=_max_length(max_length, max_len),
                max_len=max_len,
            )
            done = score_segments(loaded.translator, pairs)
        unscored = ScoreResult(None, [], [])
        return [ScoreResult(**line[0]) if line else unscored for line in done.hypotheses]

    def translate(self, lines: Sequence[str], **kwargs: Any) -> list[str]:
        """Each line's best translation ("" for an empty line): decode.py's text output.
        Takes `translate_batch`'s arguments."""
        results = self.translate_batch(lines, **kwargs)
        return [r.hypotheses[0] if r.hypotheses else "" for r in results]


def _encode(
    loaded: Loaded,
    lines: Sequence[str],
    prefixes: Sequence[str] | None,
    constraints: Sequence[Sequence[str]] | None,
    *,
    max_length: int | None,
    long_lines: str,
    source_lang: str | None = None,
) -> EncodedLines:
    """The lines as decode.py encodes a chunk (inference/targets.py `encode_chunk`)."""
    if long_lines not in LONG_LINES:
        raise UserError(f"long_lines must be one of {LONG_LINES}, got {long_lines!r}")
    if (prefixes or constraints) and long_lines == "split":
        raise UserError("prefixes and constraints need long_lines='truncate' or 'sentences'")
    max_length = _max_length(max_length, loaded.translator.max_len)
    phrases = None if constraints is None else ["\t".join(c) for c in constraints]
    return encode_chunk(
        loaded.tokenizer,
        [line.replace("\n", " ") for line in lines],
        prefixes,
        phrases,
        max_length=max_length,
        split=long_lines == "split",
        settings=loaded.translator.settings,
        sentences=splitter_for(long_lines, source_lang, loaded.config),
    )


def _max_length(max_length: int | None, max_len: int) -> int:
    """The longest source in tokens with EOS: `max_length`, at most the model's max_len."""
    max_length = min(max_length or max_len, max_len)
    if max_length < 2:
        raise UserError(f"max_length must be >= 2, got {max_length}")
    return max_length


def _keep_programs(directory: str) -> None:
    """JAX's compilation cache and the search's program store in `directory`, as decode.py
    sets them ("default": its own)."""
    from attention_jax.runtime import xla
    from attention_jax.search import programs

    cache = xla.default_cache_dir() if directory == "default" else directory
    programs.enable_beside(xla.enable_compilation_cache(cache))


def _result(hypotheses: list[dict[str, Any]]) -> TranslationResult:
    """A line's hypotheses as inference/lines.py `line_hypotheses` gives them."""
    met = [h["constraints_met"] for h in hypotheses if "constraints_met" in h]
    return TranslationResult(
        hypotheses=[h["text"] for h in hypotheses],
        scores=[h["score"] for h in hypotheses],
        tokens=[h["tokens"] for h in hypotheses],
        constraints_met=met or None,
    )


@contextlib.contextmanager
def _plain_errors() -> Iterator[None]:
    """decode.py's messages name its flags (--n_best); from Python they name the
    arguments (n_best)."""
    try:
        yield
    except UserError as e:
        raise UserError(re.sub(r"--(?=[a-z])", "", str(e))) from e

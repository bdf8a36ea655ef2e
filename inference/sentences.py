"""decode.py --long_lines=sentences: a line cut into sentences, each translated alone.

    split = sentence_splitter("de")
    split("Das Haus ist alt. Der Hund bellt!")   # ['Das Haus ist alt.', 'Der Hund bellt!']

A line that holds a paragraph is translated sentence by sentence (inference/lines.py
`encode_lines`), and the translations are joined with a space into one output line,
so a model trained on sentences never sees more than one, and the output keeps one
line per input line. The segmenter is sentencex (Wikimedia's; rules and abbreviation
lists for many languages, with fallbacks between related ones), chosen by the source
language: --source_lang, or the workdir's config.source_lang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attention_jax.common.errors import UserError


def sentence_splitter(language: str) -> Callable[[str], list[str]]:
    """text -> its sentences, stripped, none empty (UserError without sentencex)."""
    try:
        import sentencex
    except ImportError as e:
        raise UserError(
            "--long_lines=sentences needs sentencex: pip install 'attention-jax[translate]'"
        ) from e

    def split(text: str) -> list[str]:
        return [s.strip() for s in sentencex.segment(language, text) if s.strip()]

    return split


def splitter_for(
    long_lines: str, source_lang: str | None, config: Any = None
) -> Callable[[str], list[str]] | None:
    """For long_lines "sentences": the splitter of `source_lang`, or of a workdir's
    config.source_lang (UserError without either); None for the other modes."""
    if long_lines != "sentences":
        return None
    language = source_lang or (config.get("source_lang") if config is not None else None)
    if not language:
        raise UserError("--long_lines=sentences: give --source_lang (the input's language)")
    return sentence_splitter(language)

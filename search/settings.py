"""A search's settings, declared once: `SearchSettings` gives each its name, type, default
and help, and decode.py's flags, the options object, the training config's `search`
block and the compiled search's `Rule` are derived from it (a plain module, no JAX:
decode.py's flags read it before JAX loads).

    settings = SearchSettings(beam_size=4, alpha=0.6, n_best=2, batch_tokens=512)
    hyps = translate_ids(model, sources, settings)       # search/translate.py
    rule = settings.rule(vocab_limit=None)               # what a compiled search depends on

The paper (section 6.1) decodes with beam 4, length penalty alpha 0.6, and at most
source length + 50 output tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attention_jax.data import MIN_ROWS

# How scores are normalized by length: "gnmt" (the paper's setup: ((5 + len) / 6)^alpha)
# or "average" (CTranslate2's and OpenNMT's: len^alpha); search/scoring.py.
LENGTH_PENALTIES = ("gnmt", "average")
# When a source's beam search ends (search/beam.py `done`): "bound" (exact),
# "heuristic" or "count" (CTranslate2's and OpenNMT's).
BEAM_STOPS = ("bound", "heuristic", "count")
# A source of n tokens may produce at most n + this many output tokens (paper 6.1).
EXTRA_DECODE_LEN = 50
# Padded source tokens per batch, by platform. A CPU's batch is the queue of a pooled
# search (search/pool.py): a few slots search its sources in turn, so a bigger batch
# wastes no steps, and costs only the encoding of its filler. An accelerator's are made
# big enough to keep it busy (beam search holds K x as many tokens, each with a key and
# a value per layer in its cache). docs/searching.md has the measurements.
BATCH_TOKENS = {"cpu": 2048, "gpu": 32768, "cuda": 32768, "rocm": 32768, "tpu": 32768}
# CTranslate2's (decode.py --ct2: its max_batch_size, batch_type "tokens"), by --device.
CT2_BATCH_TOKENS = {"cpu": 4096, "cuda": 32768}


def _platform(platform: str | None) -> str:
    """`platform`, or JAX's default backend (JAX is imported only then)."""
    if platform is not None:
        return platform
    import jax

    return jax.default_backend()


def default_batch_tokens(platform: str | None = None) -> int:
    """BATCH_TOKENS of `platform` (default: JAX's default backend; a CPU's if unlisted)."""
    return BATCH_TOKENS.get(_platform(platform), BATCH_TOKENS["cpu"])


def _setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    program: bool = False,
    config: bool = False,
    flag: bool = True,
) -> Any:
    """A field of SearchSettings. program: a compiled search depends on it (it is in
    `Rule`); config: training's evaluations read it (configs/default.py's `search`
    block); flag: decode.py has a flag of its name (inference/cli.py)."""
    meta = dict(help=help, choices=choices, program=program, config=config, flag=flag)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    """A search's settings; every translator (live, exported, CTranslate2) has one."""

    beam_size: int = _setting(4, "Beam size K; 1 = greedy search.", program=True, config=True)
    alpha: float = _setting(0.6, "Length penalty exponent: score = log P / lp(len).", config=True)
    n_best: int = _setting(
        1, "Hypotheses per line, best first (<= beam_size; jsonl).", program=True
    )
    length_penalty: str = _setting(
        "gnmt",
        "gnmt: lp = ((5 + len) / 6)^alpha (the default). average: lp = len^alpha "
        "(CTranslate2's; the default of --ct2). len counts EOS.",
        choices=LENGTH_PENALTIES,
        program=True,
        config=True,
    )
    stop: str = _setting(
        "bound",
        "When a source's beam search ends. bound: once no live beam can win, however long "
        "it grows (exact; the default). heuristic: once none would win if it ended at the "
        "next step (about half the steps; Hugging Face's default rule). count: once K "
        "hypotheses have ended (CTranslate2's; with K = 1, greedy search).",
        choices=BEAM_STOPS,
        program=True,
        config=True,
    )
    min_length: int = _setting(
        1,
        "Fewest tokens before EOS: 1 = no empty translation of a non-empty line (as "
        "CTranslate2 and fairseq); 0 = a translation may end at once.",
        program=True,
        config=True,
    )
    max_constraints: int = _setting(4, "--constraints: the most phrases a line.")
    constraint_tokens: int = _setting(8, "--constraints: the most tokens a phrase.")
    batch_tokens: int | None = _setting(
        None,
        "Padded source tokens per batch, a CPU's searched a few sources at a time (x beam "
        "in memory; default: "
        f"{BATCH_TOKENS['cpu']} on a CPU, {BATCH_TOKENS['gpu']} on a GPU or TPU; --ct2: "
        f"{CT2_BATCH_TOKENS['cpu']} on a CPU, {CT2_BATCH_TOKENS['cuda']} on CUDA).",
    )
    min_rows: int = _setting(
        MIN_ROWS,
        "The rows of every batch of an input of at most this many sources (data/plans.py "
        "`plan_translation`); every other batch is full.",
        flag=False,
    )

    def __post_init__(self) -> None:
        for name in ("beam_size", "n_best", "max_constraints", "constraint_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"n_best must be in [1, beam_size={self.beam_size}]: {self.n_best}")
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        for name, allowed in (("length_penalty", LENGTH_PENALTIES), ("stop", BEAM_STOPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.min_length < 0:
            raise ValueError(f"min_length must be >= 0, got {self.min_length}")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {self.batch_tokens}")

    @property
    def tokens_per_batch(self) -> int:
        """batch_tokens, or the platform's default."""
        return default_batch_tokens() if self.batch_tokens is None else self.batch_tokens

    def rule(self, vocab_limit: int | None = None) -> Rule:
        """The compiled search's static part: these settings' program fields (beam_size 1 is
        greedy search: stop "count"), never emitting ids >= vocab_limit."""
        values = {name: getattr(self, name) for name in PROGRAM_FIELDS}
        if self.beam_size == 1:
            values["stop"] = "count"
        return Rule(**values, vocab_limit=vocab_limit)

    def replace(self, **changes: Any) -> SearchSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls, **which: bool) -> list[dataclasses.Field]:
        """The settings' fields, in order; e.g. fields(flag=True): those decode.py has a
        flag for, fields(config=True): those of the training config's `search` block."""
        return [
            f
            for f in dataclasses.fields(cls)
            if all(f.metadata[key] == value for key, value in which.items())
        ]


DEFAULTS = SearchSettings()
PROGRAM_FIELDS = tuple(f.name for f in SearchSettings.fields(program=True))


def config_block() -> dict[str, Any]:
    """The training config's `search` block: the fields its evaluations read, with their
    defaults (configs/default.py)."""
    return {f.name: f.default for f in SearchSettings.fields(config=True)}


# The static settings of a compiled search (hashable: part of its program's key):
# SearchSettings' program fields and the vocabulary limit, derived, not declared again.
Rule = dataclasses.make_dataclass(
    "Rule",
    [
        *((f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
          for f in SearchSettings.fields(program=True)),
        ("vocab_limit", "int | None", dataclasses.field(default=None)),
    ],
    frozen=True,
    namespace={"__module__": __name__},
)  # fmt: skip

"""What decode.py is asked to do: one typed, frozen options object, and its checks.

    options = DecodeOptions(workdir="workdir/tiny", input="test.de", output_format="jsonl",
                            search={"beam_size": 4, "n_best": 4})
    options.check()          # UserError for combinations that cannot work
    inference.run.run(options)

decode.py fills it from its flags. The search settings are only those given (`search`,
SearchSettings' fields by name): an exported translator has its own beam, alpha and
n_best, and CTranslate2 its own length penalty.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from attention_jax.backends.ct2_export import DEVICES, QUANTIZATIONS
from attention_jax.runtime.errors import UserError
from attention_jax.search.settings import CT2_BATCH_TOKENS, SearchSettings, default_batch_tokens

LONG_LINES = ("truncate", "split", "sentences")
CHECKPOINTS = ("last", "best")
OUTPUT_FORMATS = ("text", "jsonl")
SPLITS = ("train", "dev", "test")
# Lines per chunk of a streamed job, by default: enough that the batches of a chunk
# (data/plans.py: a width's last batch is padded with filler rows) cost little more
# than those of the whole file, measured on Ding sources for --batch_tokens from 1k to
# 32k (docs/jobs.md, bench/decode_file.py --measure=memory --plans).
READ_LINES_PER_BATCH_TOKEN = 2.5
MIN_READ_LINES = 10_000


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Every setting of decode.py (its flags; docs/decoding.md says what each does)."""

    workdir: str | None = None  # a training workdir (config.json, checkpoints/, tokenizer.model),
    # or several, comma-separated, that decode as an ensemble
    exported: str | None = None  # or an exported translator's directory
    input: str = "-"  # '-' = stdin
    output: str = "-"  # '-' = stdout; a file is written atomically
    reference: str | None = None  # print BLEU and chrF against it
    split: str | None = None  # translate and score this split of the workdir's dataset
    checkpoint: str = "last"  # or "best": the checkpoint of the best dev evaluation
    checkpoint_step: int | None = None  # None: the newest checkpoint
    average_last: int = 1  # average the parameters of the last N checkpoints
    max_length: int | None = None  # longest source in tokens with EOS (None: the model's)
    long_lines: str = "truncate"  # or "split" into segments of max_length, or "sentences"
    source_lang: str | None = None  # the input's language, for "sentences" (None: the workdir's)
    output_format: str = "text"  # or "jsonl": n-best texts, scores, tokens
    alignment: bool = False  # jsonl: add word alignments
    plot_attention: str | None = None  # write cross-attention PNGs into this directory
    num_plots: int = 4
    export: str | None = None  # write a self-contained translator into this directory
    export_platforms: tuple[str, ...] = ()  # backends to lower for (default: this one)
    prefix: str | None = None  # line i: the start translation i must have (target side)
    constraints: str | None = None  # line i: tab-separated phrases translation i must hold
    score: str | None = None  # line i: a translation of line i, scored instead of translating
    export_ct2: str | None = None  # write a CTranslate2 model into this directory
    quantization: str = "float32"  # its weight type
    ct2: str | None = None  # or translate with a CTranslate2 model directory
    marian: str | None = None  # or with an OPUS-MT / Marian model directory
    device: str | None = None  # --ct2: "cpu" (None) or "cuda"
    threads: int = 0  # --ct2: CTranslate2's threads, on a CPU one batch each (0 = per core)
    read_lines: int | None = None  # lines per chunk (None: see `chunk_lines`)
    restart: bool = False  # ignore a partial output of an earlier run and start over
    dry_run: bool = False  # read, tokenize, plan and write without running the model
    stats: str | None = None  # write where the wall time went (JSON) into this file
    # The search settings given (SearchSettings' fields by name); the backend has the others.
    search: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def backend(self) -> str:
        """What translates: 'exported', 'ct2', 'marian' or 'workdir' (the live model)."""
        for name in ("exported", "ct2", "marian"):
            if getattr(self, name):
                return name
        return "workdir"

    @property
    def workdirs(self) -> tuple[str, ...]:
        """--workdir's directories: one, or several (A,B,...) that decode as an ensemble."""
        return tuple(d for d in (self.workdir or "").split(",") if d)

    @property
    def step(self) -> int | str | None:
        """The checkpoint a workdir is read at: --checkpoint_step, "best", or None (newest)."""
        return "best" if self.checkpoint == "best" else self.checkpoint_step

    @property
    def settings(self) -> SearchSettings:
        """The search these options ask for: the settings given, the backend's defaults for
        the others (CTranslate2's length penalty and batch size for --ct2). ValueError for
        a bad one (`check` says it as a UserError)."""
        given = dict(self.search)
        given.setdefault("batch_tokens", self.tokens_per_batch)
        if self.ct2:
            given.setdefault("length_penalty", "average")
        return SearchSettings(**given)

    @property
    def chunk_lines(self) -> int:
        """Lines per chunk: --read_lines, or max(10000, 2.5 x --batch_tokens)."""
        if self.read_lines is not None:
            return self.read_lines
        return max(MIN_READ_LINES, round(READ_LINES_PER_BATCH_TOKEN * self.tokens_per_batch))

    @property
    def tokens_per_batch(self) -> int:
        """--batch_tokens, or the default of the platform the search runs on
        (search/settings.py BATCH_TOKENS; CTranslate2's for --ct2: CT2_BATCH_TOKENS)."""
        if self.search.get("batch_tokens") is not None:
            return self.search["batch_tokens"]
        if self.ct2:
            return CT2_BATCH_TOKENS[self.device or "cpu"]
        return default_batch_tokens()

    def check(self) -> None:
        """Combinations that cannot work, before anything slow happens (UserError)."""
        if self.exported and (self.workdir or self.export):
            raise UserError("--exported translates on its own: drop --workdir and --export")
        self._check_ct2()
        self._check_marian()
        if not (self.exported or self.workdir or self.ct2 or self.marian):
            raise UserError(
                "--workdir is required (the directory train.py wrote), or --exported, --ct2 "
                "or --marian"
            )
        unknown = sorted(set(self.search) - {f.name for f in SearchSettings.fields()})
        if unknown:
            raise UserError(f"no search setting named {', '.join(unknown)}")
        try:  # the settings given, unresolved: no platform default (JAX stays unstarted)
            n_best = SearchSettings(**self.search).n_best
        except ValueError as e:  # SearchSettings names its fields: here they are flags
            names = "|".join(f.name for f in SearchSettings.fields())
            raise UserError(re.sub(rf"\b({names})\b", r"--\1", str(e))) from e
        scoring_or_export = self.score or self.export or self.export_ct2
        if self.output_format == "text" and n_best > 1 and not scoring_or_export:
            raise UserError(
                "--n_best > 1 needs --output_format=jsonl (text is the best translation)"
            )
        if self.alignment and self.output_format != "jsonl":
            raise UserError("--alignment needs --output_format=jsonl")
        needs_model = ["alignment", "plot_attention", "split", "checkpoint_step"]
        used = [f"--{n}" for n in needs_model if getattr(self, n)]
        used += ["--average_last"] if self.average_last != 1 else []
        used += ["--checkpoint=best"] if self.checkpoint == "best" else []
        if (self.exported or self.ct2) and used:
            raise UserError(f"{', '.join(used)} need the trained model: use --workdir")
        if self.checkpoint == "best" and (
            self.checkpoint_step is not None or self.average_last != 1
        ):
            raise UserError(
                "--checkpoint=best decodes the best checkpoint alone: drop --checkpoint_step "
                "and --average_last"
            )
        if self.split and (self.input != "-" or self.reference):
            raise UserError("--split replaces --input and --reference; give one or the other")
        if self.read_lines is not None and self.read_lines < 1:
            raise UserError(f"--read_lines must be >= 1, got {self.read_lines}")
        if self.dry_run and (self.alignment or self.plot_attention):
            raise UserError("--dry_run runs no model: drop --alignment and --plot_attention")
        self._check_targets()
        self._check_score()
        self._check_ensemble()
        self._check_choices()

    def _check_ensemble(self) -> None:
        """--workdir=A,B,...: an ensemble translates and scores; it has no one model to
        export, align or plot."""
        if len(self.workdirs) < 2:
            return
        one_model = [f"--{n}" for n in ("export", "export_ct2", "alignment", "plot_attention")
                     if getattr(self, n)]  # fmt: skip
        if one_model:
            raise UserError(
                f"{', '.join(one_model)} need one model: give --workdir a single directory "
                "(several decode as an ensemble)"
            )

    def _check_score(self) -> None:
        """--score: given translations, scored line by line, as JSON lines."""
        if not self.score:
            return
        if self.export or self.export_ct2:
            raise UserError("--score is for scoring translations: drop it to export")
        clash = [f"--{n}" for n in ("reference", "split", "prefix", "constraints",
                                    "alignment", "plot_attention") if getattr(self, n)]  # fmt: skip
        clash += [f"--long_lines={self.long_lines}"] if self.long_lines != "truncate" else []
        if clash:
            raise UserError(
                f"--score scores the given translations of --input: drop {', '.join(clash)}"
            )

    def _check_targets(self) -> None:
        """--prefix and --constraints: with a backend that honours them, for translating."""
        given = [f"--{n}" for n in ("prefix", "constraints") if getattr(self, n)]
        if not given:
            return
        if self.export or self.export_ct2:
            raise UserError(f"{', '.join(given)} are for translating: drop them to export")
        if self.exported:
            raise UserError(
                f"an exported translator takes no {' or '.join(given)}: use --workdir (or "
                "--ct2 for --prefix)"
            )
        if self.ct2 and self.constraints:
            raise UserError(
                "CTranslate2 (--ct2) has no terminology constraints: use --workdir or "
                "--marian for --constraints (it honours --prefix)"
            )
        if self.long_lines == "split":
            raise UserError(
                f"{', '.join(given)} need --long_lines=truncate or sentences (not split)"
            )

    def _check_marian(self) -> None:
        """--marian: an OPUS-MT / Marian model instead of a workdir's."""
        if not self.marian:
            return
        others = [f"--{n}" for n in ("workdir", "exported", "ct2")]
        given = [flag for flag in others if getattr(self, flag[2:])]
        if given:
            raise UserError(f"--marian translates on its own: drop {', '.join(given)}")
        if self.split or self.checkpoint_step is not None or self.average_last != 1:
            raise UserError("--split, --checkpoint_step and --average_last are for --workdir")
        if self.checkpoint == "best":
            raise UserError("--checkpoint=best is for --workdir")

    def _check_ct2(self) -> None:
        """The CTranslate2 flags: --export_ct2 from a workdir, --ct2 on its own."""
        if self.ct2 and (self.workdir or self.exported or self.export or self.export_ct2):
            raise UserError(
                "--ct2 translates on its own: drop --workdir, --exported, --export and --export_ct2"
            )
        if self.export_ct2 and not (self.workdir or self.marian):
            raise UserError("--export_ct2 converts a trained model: give --workdir (or --marian)")
        if self.export_ct2 and self.export:
            raise UserError("--export and --export_ct2: one export at a time")
        if self.quantization != "float32" and not self.export_ct2:
            raise UserError("--quantization is for --export_ct2")
        if (self.device is not None or self.threads) and not self.ct2:
            raise UserError("--device and --threads are for --ct2 (CTranslate2)")
        if self.threads < 0:
            raise UserError(
                f"--threads must be >= 0 (0 = CTranslate2's default), got {self.threads}"
            )
        stop = self.search.get("stop")
        if self.ct2 and stop not in (None, "count"):
            raise UserError(
                f"--stop={stop} is for the JAX decoder: CTranslate2 (--ct2) stops a "
                "source once K hypotheses have finished (--stop=count)"
            )
        if self.ct2 and self.search.get("length_penalty") == "gnmt":
            raise UserError(
                "CTranslate2 ranks by log P / len^alpha (--length_penalty=average); "
                "--length_penalty=gnmt needs the JAX backend (--workdir or --exported)"
            )

    def _check_choices(self) -> None:
        for name, allowed in (
            ("long_lines", LONG_LINES),
            ("checkpoint", CHECKPOINTS),
            ("output_format", OUTPUT_FORMATS),
            ("split", (None, *SPLITS)),
            ("quantization", QUANTIZATIONS),
            ("device", (None, *DEVICES)),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name} must be one of {allowed}, got {getattr(self, name)!r}")

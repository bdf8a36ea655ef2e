"""What decode.py is asked to do: one typed, frozen options object, and its checks.

    options = DecodeOptions(workdir="workdir/tiny", input="test.de", n_best=4,
                            output_format="jsonl")
    options.check()          # UserError for combinations that cannot work
    inference.run.run(options)

decode.py fills it from its flags (a setting left at its default is None where
"not given" matters: an exported translator has its own beam, alpha and n_best).
"""

from __future__ import annotations

import dataclasses

from attention_jax.backends.ct2_export import DEVICES, QUANTIZATIONS
from attention_jax.common.errors import UserError
from attention_jax.search.defaults import (
    BEAM_STOPS,
    CT2_BATCH_TOKENS,
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_CONSTRAINT_TOKENS,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_MAX_CONSTRAINTS,
    DEFAULT_MIN_LENGTH,
    DEFAULT_STOP,
    LENGTH_PENALTIES,
    default_batch_tokens,
)
from attention_jax.search.settings import SearchSettings

LONG_LINES = ("truncate", "split")
OUTPUT_FORMATS = ("text", "jsonl")
SPLITS = ("train", "dev", "test")
# Lines per chunk of a streamed job, by default: enough that the batches of a chunk
# (data/plans.py: a width's last batch is padded with filler rows) cost ~2% more than
# those of the whole file, measured on Ding sources for --batch_tokens from 1k to 32k
# (docs/decoding.md, bench/decode_file.py --measure=memory --plans).
READ_LINES_PER_BATCH_TOKEN = 2.5
MIN_READ_LINES = 10_000


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Every setting of decode.py (its flags; docs/decoding.md says what each does)."""

    workdir: str | None = None  # a training workdir: config.json, checkpoints/, tokenizer.model
    exported: str | None = None  # or an exported translator's directory
    input: str = "-"  # '-' = stdin
    output: str = "-"  # '-' = stdout; a file is written atomically
    reference: str | None = None  # print BLEU and chrF against it
    split: str | None = None  # translate and score this split of the workdir's dataset
    beam_size: int | None = None  # None: 4, or the export's
    alpha: float | None = None  # None: 0.6, or the export's
    n_best: int | None = None  # None: 1, or the export's
    checkpoint_step: int | None = None  # None: the newest checkpoint
    average_last: int = 1  # average the parameters of the last N checkpoints
    batch_tokens: int | None = None  # padded source tokens per batch (None: the platform's)
    max_length: int | None = None  # longest source in tokens with EOS (None: the model's)
    long_lines: str = "truncate"  # or "split" into segments of max_length
    output_format: str = "text"  # or "jsonl": n-best texts, scores, tokens
    alignment: bool = False  # jsonl: add word alignments
    plot_attention: str | None = None  # write cross-attention PNGs into this directory
    num_plots: int = 4
    export: str | None = None  # write a self-contained translator into this directory
    export_platforms: tuple[str, ...] = ()  # backends to lower for (default: this one)
    length_penalty: str | None = None  # "gnmt" or "average"; None: gnmt, or the backend's
    stop: str | None = None  # "bound" (None) or "heuristic": when a beam search ends
    min_length: int | None = None  # fewest tokens before EOS (None: 1, or the backend's)
    prefix: str | None = None  # line i: the start translation i must have (target side)
    constraints: str | None = None  # line i: tab-separated phrases translation i must hold
    max_constraints: int = DEFAULT_MAX_CONSTRAINTS  # phrases a line at most
    constraint_tokens: int = DEFAULT_CONSTRAINT_TOKENS  # tokens a phrase at most
    export_ct2: str | None = None  # write a CTranslate2 model into this directory
    quantization: str = "float32"  # its weight type
    ct2: str | None = None  # or translate with a CTranslate2 model directory
    marian: str | None = None  # or with an OPUS-MT / Marian model directory
    device: str | None = None  # --ct2: "cpu" (None) or "cuda"
    threads: int = 0  # --ct2: CTranslate2's threads, on a CPU one batch each (0 = per core)
    read_lines: int | None = None  # lines per chunk (None: see `chunk_lines`)
    restart: bool = False  # ignore a partial output of an earlier run and start over
    dry_run: bool = False  # read, tokenize, plan and write without running the model
    steps_per_check: int | None = None  # search steps per stopping test (None: the platform's)
    stats: str | None = None  # write where the wall time went (JSON) into this file

    @property
    def _search(self) -> tuple[int, float, int]:
        """(beam_size, alpha, n_best), defaults filled in."""
        beam = DEFAULT_BEAM_SIZE if self.beam_size is None else self.beam_size
        alpha = DEFAULT_ALPHA if self.alpha is None else self.alpha
        return beam, alpha, 1 if self.n_best is None else self.n_best

    @property
    def backend(self) -> str:
        """What translates: 'exported', 'ct2', 'marian' or 'workdir' (the live model)."""
        for name in ("exported", "ct2", "marian"):
            if getattr(self, name):
                return name
        return "workdir"

    @property
    def fewest_tokens(self) -> int:
        """--min_length, or its default (search/defaults.py)."""
        return DEFAULT_MIN_LENGTH if self.min_length is None else self.min_length

    @property
    def settings(self) -> SearchSettings:
        """The search these options ask for, defaults filled in (once `check` passed)."""
        beam_size, alpha, n_best = self._search
        return SearchSettings(
            beam_size=beam_size,
            alpha=alpha,
            n_best=n_best,
            length_penalty=self.penalty,
            stop=self.stop or DEFAULT_STOP,
            steps_per_check=self.steps_per_check,
            batch_tokens=self.tokens_per_batch,
            min_length=self.fewest_tokens,
            max_constraints=self.max_constraints,
            constraint_tokens=self.constraint_tokens,
        )

    @property
    def penalty(self) -> str:
        """The length penalty: as given, else CTranslate2's for --ct2, else gnmt."""
        if self.length_penalty is not None:
            return self.length_penalty
        return "average" if self.ct2 else DEFAULT_LENGTH_PENALTY

    @property
    def chunk_lines(self) -> int:
        """Lines per chunk: --read_lines, or max(10000, 2.5 x --batch_tokens)."""
        if self.read_lines is not None:
            return self.read_lines
        return max(MIN_READ_LINES, round(READ_LINES_PER_BATCH_TOKEN * self.tokens_per_batch))

    @property
    def tokens_per_batch(self) -> int:
        """--batch_tokens, or the default of the platform the search runs on
        (search/defaults.py BATCH_TOKENS; CTranslate2's for --ct2: CT2_BATCH_TOKENS)."""
        if self.batch_tokens is not None:
            return self.batch_tokens
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
        beam_size, alpha, n_best = self._search
        if beam_size < 1 or alpha < 0 or (self.batch_tokens is not None and self.batch_tokens < 1):
            raise UserError("need --beam_size >= 1, --alpha >= 0 and --batch_tokens >= 1")
        if self.steps_per_check is not None and self.steps_per_check < 1:
            raise UserError(
                f"--steps_per_check must be >= 1 (or 0: the platform's), got {self.steps_per_check}"
            )
        if self.steps_per_check is not None and (self.ct2 or self.exported):
            raise UserError("--steps_per_check is for --workdir (an export fixes its own)")
        if not 1 <= n_best <= beam_size:
            raise UserError(f"--n_best must be in [1, --beam_size={beam_size}]")
        if self.fewest_tokens < 0:
            raise UserError(f"--min_length must be >= 0, got {self.min_length}")
        if self.output_format == "text" and n_best > 1 and not (self.export or self.export_ct2):
            raise UserError(
                "--n_best > 1 needs --output_format=jsonl (text is the best translation)"
            )
        if self.alignment and self.output_format != "jsonl":
            raise UserError("--alignment needs --output_format=jsonl")
        needs_model = ["alignment", "plot_attention", "split", "checkpoint_step"]
        used = [f"--{n}" for n in needs_model if getattr(self, n)]
        used += ["--average_last"] if self.average_last != 1 else []
        if (self.exported or self.ct2) and used:
            raise UserError(f"{', '.join(used)} need the trained model: use --workdir")
        if self.split and (self.input != "-" or self.reference):
            raise UserError("--split replaces --input and --reference; give one or the other")
        if self.read_lines is not None and self.read_lines < 1:
            raise UserError(f"--read_lines must be >= 1, got {self.read_lines}")
        if self.dry_run and (self.alignment or self.plot_attention):
            raise UserError("--dry_run runs no model: drop --alignment and --plot_attention")
        self._check_targets()
        self._check_choices()

    def _check_targets(self) -> None:
        """--prefix and --constraints: with a backend that honours them, for translating."""
        given = [f"--{n}" for n in ("prefix", "constraints") if getattr(self, n)]
        if self.max_constraints < 1 or self.constraint_tokens < 1:
            raise UserError("need --max_constraints >= 1 and --constraint_tokens >= 1")
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
            raise UserError(f"{', '.join(given)} need --long_lines=truncate (one piece a line)")

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
        if self.ct2 and self.stop not in (None, "count"):
            raise UserError(
                f"--stop={self.stop} is for the JAX decoder: CTranslate2 (--ct2) stops a "
                "source once K hypotheses have finished (--stop=count)"
            )
        if self.ct2 and self.length_penalty == "gnmt":
            raise UserError(
                "CTranslate2 ranks by log P / len^alpha (--length_penalty=average); "
                "--length_penalty=gnmt needs the JAX backend (--workdir or --exported)"
            )

    def _check_choices(self) -> None:
        for name, allowed in (
            ("long_lines", LONG_LINES),
            ("output_format", OUTPUT_FORMATS),
            ("split", (None, *SPLITS)),
            ("length_penalty", (None, *LENGTH_PENALTIES)),
            ("stop", (None, *BEAM_STOPS)),
            ("quantization", QUANTIZATIONS),
            ("device", (None, *DEVICES)),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name} must be one of {allowed}, got {getattr(self, name)!r}")

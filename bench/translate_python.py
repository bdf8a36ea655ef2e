"""Translating from Python against decode.py: the same bytes, and what each costs.

    python bench/translate_python.py --workdir=workdir/tiny          # the Ding test set
    python bench/translate_python.py --marian=opus-mt-de-en --input=news.de

decode.py runs as a user runs it (a fresh process, --input to --output); the library's
`attention_jax.Translator` opens the same model in this process and translates the
same lines with the same settings (one `translate` call of all of them, then a second
one: compiled programs kept). Reports the lines, how many are identical byte for byte
(the goal: all), decode.py's wall time and translation rate, and the library's open
and translate times. Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness


def source_lines(args: argparse.Namespace) -> list[str]:
    """--input's lines, or the workdir's split's sources (decode.py --split's)."""
    if args.input:
        from attention_jax.inference.lines import read_lines

        return read_lines(args.input)[0]
    from attention_jax.inference.run import split_lines
    from attention_jax.training.config import load_config

    return split_lines(load_config(args.workdir), args.split)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--workdir", help="a training workdir")
    where.add_argument("--marian", help="an OPUS-MT / Marian directory")
    p.add_argument("--input", default=None, help="source lines (default: --split's)")
    p.add_argument("--split", default="test", choices=["train", "dev", "test"])
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--scratch", default=None, help="where the input and output go")
    args = p.parse_args()
    scratch = args.scratch or tempfile.mkdtemp(prefix="translate-python-")
    os.makedirs(scratch, exist_ok=True)
    lines = source_lines(args)
    src = os.path.join(scratch, "source.txt")
    with open(src, "w", encoding="utf-8") as f:
        f.write("".join(line.replace("\n", " ") + "\n" for line in lines))
    model = {"workdir": args.workdir} if args.workdir else {"marian": args.marian}
    ((kind, path),) = model.items()
    out = os.path.join(scratch, "decode_py.txt")
    flags = [f"--{kind}={path}", f"--input={src}", f"--output={out}"]
    ran = harness.run_decode([*flags, f"--beam_size={args.beam_size}"])
    with open(out, encoding="utf-8") as f:
        want = f.read().split("\n")[:-1]

    from attention_jax import Translator
    from attention_jax.inference.lines import output_text

    t0 = time.perf_counter()
    translator = Translator(
        path, kind=kind, beam_size=args.beam_size, compilation_cache="default"
    )  # decode.py's programs, kept: as a user's second process finds them
    opened = time.perf_counter() - t0
    runs = []
    for _ in range(2):  # the first compiles (or loads) the programs; the second reuses them
        t0 = time.perf_counter()
        got = translator.translate(lines)
        runs.append(time.perf_counter() - t0)
    got = output_text(got).split("\n")[:-1]
    identical = sum(a == b for a, b in zip(got, want, strict=True))
    row = {
        "model": kind,
        "lines": len(lines),
        "identical_lines": identical,
        "decode_py_wall_s": round(ran["wall_s"], 2),
        "decode_py_tokens_per_s": round(ran.get("tokens_per_s", 0)),
        "library_open_s": round(opened, 2),
        "library_first_s": round(runs[0], 2),
        "library_second_s": round(runs[1], 2),
        "beam_size": args.beam_size,
        "cpu": platform.processor() or platform.machine(),
    }
    columns = ["model", "lines", "identical_lines", "decode_py_wall_s", "decode_py_tokens_per_s"]
    columns += ["library_open_s", "library_first_s", "library_second_s"]
    harness.report("translate_python", {"command": " ".join(sys.argv)}, [row], columns)
    if identical != len(lines):
        raise SystemExit(f"{len(lines) - identical} line(s) differ from decode.py's: see {scratch}")


if __name__ == "__main__":
    main()

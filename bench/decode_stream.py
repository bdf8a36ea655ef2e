"""decode.py at corpus scale: peak RSS and throughput of the whole process, per input size.

    # memory: read, tokenize, plan and write 10k and 1M lines without the model
    python bench/decode_stream.py --workdir=workdir/tiny --dry_run --sizes=10000,1000000
    # throughput on the Ding test set for some --read_lines (and one chunk for all of it)
    python bench/decode_stream.py --workdir=workdir/tiny --test_set --read_lines=250,1000,0
    # ... or of another decode.py (e.g. a checkout of the code before it streamed)
    python bench/decode_stream.py --workdir=workdir/tiny --test_set --decode_py=/tmp/old/decode.py
    # the batches chunks make (no decode.py run): filler rows and padding per --read_lines
    python bench/decode_stream.py --workdir=workdir/tiny --plans --sizes=100000 \
        --read_lines=1000,10000,0

Inputs are the Ding sources (data/corpora.py: the training split's German side,
repeated up to the size asked; or the test split), written to a scratch directory.
Each run is `decode.py` in a fresh process; its peak RSS is the kernel's
ru_maxrss of that child (os.wait4), its wall time covers start-up to exit (as
does cpu_s, the CPU seconds of all its threads, the measure to compare when other
processes share the cores), and
the translation rates are decode.py's own summary line (encoding, translating,
writing; no start-up). Runs are repeated (--repeats) and the median wall time
and rates kept, with the largest RSS. --read_lines=0 means one chunk for the
whole input (the batches decode.py made before it streamed). Prints one JSON
object, then a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ding_sources(split: str) -> list[str]:
    """The German side of a split of the Ding corpus (parsed once, cached by data/)."""
    from data.corpora import prepare_ding

    return [de for de, _ in prepare_ding()[split]]


def write_input(path: str, sources: list[str], lines: int) -> None:
    """`lines` lines: `sources` repeated, written a block at a time."""
    block = "".join(s.replace("\n", " ") + "\n" for s in sources)
    with open(path, "w", encoding="utf-8") as f:
        full, rest = divmod(lines, len(sources))
        for _ in range(full):
            f.write(block)
        f.writelines(s + "\n" for s in sources[:rest])


def run_decode(decode_py: str, args: list[str]) -> dict:
    """One decode.py process: wall and CPU seconds, peak RSS (MB), its summary's rates."""
    row = common.run_decode(args, decode_py=decode_py)
    return {k: v for k, v in row.items() if k not in ("stdout", "stderr")}


def measure(decode_py: str, args: list[str], repeats: int) -> dict:
    runs = [run_decode(decode_py, args) for _ in range(repeats)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "peak_rss_mb"}
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    out["lines"] = int(out["lines"])
    return out


def plan_costs(workdir: str, sources: list[str], chunks: list[int], batch_tokens: int) -> list:
    """Per chunk size, the batches `data.plans.plan_translation` makes of the sources read
    in chunks of that many lines: batches, rows (with the filler that pads a width's last
    batch), padded source tokens; compared with one chunk for everything."""
    from data import Tokenizer
    from data.plans import plan_translation
    from training.config import load_config

    max_len = load_config(workdir).model.max_len
    tokenizer = Tokenizer.load(os.path.join(workdir, "tokenizer.model"))
    lengths = [min(len(ids) + 1, max_len) for ids in tokenizer.encode_batch(sources)]
    rows = []
    for chunk in chunks:
        size = chunk or len(lengths)
        batches = filled = slots = 0
        for start in range(0, len(lengths), size):
            plan = plan_translation(
                lengths[start : start + size], batch_tokens=batch_tokens, max_len=max_len
            )
            batches += len(plan)
            filled += sum(r for _, _, r in plan)
            slots += sum(r * w for _, w, r in plan)
        rows.append(
            {"read_lines": chunk, "batches": batches, "rows": filled, "padded_tokens": slots}
        )
    whole = rows[-1] if chunks[-1] == 0 else None
    for r in rows:
        r["filler_rows_pct"] = 100 * (r["rows"] - len(lengths)) / r["rows"]
        if whole:
            r["rows_vs_one_chunk_pct"] = 100 * (r["rows"] / whole["rows"] - 1)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="workdir/tiny")
    p.add_argument("--dry_run", action="store_true", help="decode.py --dry_run (no model)")
    p.add_argument("--sizes", default="10000,1000000", help="input lines (training sources)")
    p.add_argument("--test_set", action="store_true", help="the Ding test set, not --sizes")
    p.add_argument("--read_lines", default="", help="chunk sizes; 0 = one chunk; '' = default")
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--decode_py", default=os.path.join(ROOT, "decode.py"))
    p.add_argument("--scratch", default=None, help="where inputs and outputs go (default: tmp)")
    p.add_argument("--plans", action="store_true", help="count the batches of each chunk size")
    p.add_argument("--batch_tokens", type=int, default=4096)
    args = p.parse_args(argv)
    if args.plans:
        size = int(args.sizes.split(",")[0])
        sources = ding_sources("test" if args.test_set else "train")
        sources = (sources * (size // len(sources) + 1))[:size]
        chunks = [int(x) for x in (args.read_lines or "1000,10000,0").split(",")]
        rows = plan_costs(args.workdir, sources, chunks, args.batch_tokens)
        columns = ["read_lines", "batches", "rows", "filler_rows_pct", "rows_vs_one_chunk_pct"]
        meta = {"input_lines": len(sources), "batch_tokens": args.batch_tokens}
        return common.report("decode_stream_plans", meta, rows, [*columns, "padded_tokens"])

    scratch = args.scratch or tempfile.mkdtemp(prefix="decode_stream_")
    os.makedirs(scratch, exist_ok=True)
    if args.test_set:
        sources = ding_sources("test")
        sizes = [len(sources)]
    else:
        sources = ding_sources("train")
        sizes = [int(s) for s in args.sizes.split(",")]
    chunks = [int(x) for x in args.read_lines.split(",")] if args.read_lines else [None]
    rows = []
    for size in sizes:
        src = os.path.join(scratch, f"in_{size}.de")
        if not os.path.isfile(src) or os.path.getsize(src) == 0:
            write_input(src, sources, size)
        for chunk in chunks:
            out = os.path.join(scratch, f"out_{size}.txt")
            flags = [
                f"--workdir={os.path.abspath(args.workdir)}",
                f"--input={src}",
                f"--output={out}",
                f"--beam_size={args.beam_size}",
            ]
            if chunk is not None:
                flags.append(f"--read_lines={chunk or max(size, 1)}")
            flags += ["--dry_run"] if args.dry_run else []
            r = measure(args.decode_py, flags, args.repeats)
            rows.append({"input_lines": size, "read_lines": chunk, **r})
            print(f"# {size} lines, read_lines={chunk}: {r}", file=sys.stderr)
    meta = {
        "decode_py": os.path.abspath(args.decode_py),
        "workdir": args.workdir,
        "dry_run": args.dry_run,
        "input": "ding test sources" if args.test_set else "ding training sources, repeated",
        "beam_size": args.beam_size,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
    }
    columns = ["input_lines", "read_lines", "peak_rss_mb", "wall_s", "cpu_s", "translate_s"]
    common.report("decode_stream", meta, rows, [*columns, "sentences_per_s", "tokens_per_s"])


if __name__ == "__main__":
    main()

"""How long importing an OPUS-MT-sized Marian model takes (backends/marian.py).

    python bench/marian_import.py [--vocab 58101] [--repeats 3]

Writes a random Marian model of OPUS-MT's shape (6 + 6 layers, 512 wide, 8 heads,
2048 feed-forward, a 58k joint vocabulary, as opus-mt-de-en) in the layout of an
OPUS-MT release, then times `load_marian` on it: reading the .npz, building our
model and placing every weight. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=58101)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from attention_jax.backends.marian import load_marian
    from tests.marian_files import write_marian

    pieces = ["</s>", "<unk>", *(f"▁p{i}" for i in range(args.vocab - 2))]
    with tempfile.TemporaryDirectory() as scratch:
        t0 = time.perf_counter()
        directory = write_marian(
            os.path.join(scratch, "opus"), d=512, heads=8, ff=2048, layers=(6, 6), pieces=pieces
        )
        write_s = time.perf_counter() - t0
        npz_mb = os.path.getsize(os.path.join(directory, "opus.npz")) / 2**20
        rows = []
        for run in range(args.repeats):
            t0 = time.perf_counter()
            model, _ = load_marian(directory)
            rows.append({"run": run, "load_s": round(time.perf_counter() - t0, 2)})
            del model
    meta = {
        "shape": "6+6 layers, d 512, 8 heads, ff 2048",
        "vocab": args.vocab,
        "npz_mb": round(npz_mb, 1),
        "write_s": round(write_s, 1),
        "cpus": os.cpu_count(),
    }
    harness.report("marian_import", meta, rows, ["run", "load_s"])


if __name__ == "__main__":
    main()

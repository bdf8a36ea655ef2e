"""decode.py --constraints and --prefix on a workdir's test split: how often the outputs
honour them, what they do to BLEU, and what they cost.

    python bench/constraints.py --workdir=workdir/tiny            # the Ding test set
    python bench/constraints.py --workdir=W --ct2=serve/          # + prefixes vs CTranslate2

Per reference, its one or two longest words (alternating) are the constraints of its
line, and its first word the prefix of its line. Four decode.py runs, each after an
untimed one that fills the compilation cache: plain, --constraints, --prefix, and
(with --ct2) --prefix through CTranslate2. Per run: BLEU and chrF, the translation
seconds (decode.py's summary), and for constraints the share of phrases met (the
jsonl's constraints_met, and the phrases found in the text), for prefixes the share
of outputs that start with theirs and the lines equal to CTranslate2's. One JSON
object ("benchmark": "constraints"), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import harness  # noqa: E402

WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")


def wanted(reference: str, i: int) -> list[str]:
    """Line i's constraints: the longest word of its reference (two when i is odd)."""
    words = sorted(dict.fromkeys(WORD.findall(reference)), key=lambda w: (-len(w), w))
    return words[: 1 + i % 2]


def first_word(reference: str) -> str:
    return reference.split()[0] if reference.split() else ""


def run(backend: str, source: str, reference: str, *flags: str) -> dict:
    """decode.py (`backend`: --workdir=W or --ct2=DIR) on the test sources, jsonl, after a
    run that fills the cache: its figures and per line its best hypothesis."""
    args = [backend, f"--input={source}", f"--reference={reference}", "--output_format=jsonl"]
    args += list(flags)
    harness.run_decode(args)  # programs compiled and kept
    out = harness.run_decode(args)
    lines = [json.loads(x)["hypotheses"] for x in out["stdout"].split("\n")[:-1]]
    scores = dict(re.findall(r"(BLEU|chrF) = ([\d.]+)", out["stderr"]))
    return {
        "bleu": float(scores["BLEU"]),
        "chrf": float(scores["chrF"]),
        "translate_s": out["translate_s"],
        "best": [hyps[0] if hyps else {"text": "", "tokens": []} for hyps in lines],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--ct2", default=None, help="a CTranslate2 export of the workdir's model")
    p.add_argument("--scratch", default=None)
    args, rest = p.parse_known_args(argv)
    extra = [a for a in rest if a != "--"]
    from attention_jax.data import load_split
    from attention_jax.training.config import load_config

    corpus = load_split(load_config(args.workdir), "test")
    pairs = [corpus[i] for i in range(len(corpus))]
    refs = [ref for _, ref in pairs]
    scratch = args.scratch or tempfile.mkdtemp(prefix="constraints-")
    os.makedirs(scratch, exist_ok=True)
    terms, starts = os.path.join(scratch, "terms.tsv"), os.path.join(scratch, "prefix.txt")
    source, reference = os.path.join(scratch, "test.src"), os.path.join(scratch, "test.ref")
    for path, lines in ((source, [s for s, _ in pairs]), (reference, refs)):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(line.replace("\n", " ") + "\n" for line in lines)
    phrases = [wanted(r, i) for i, r in enumerate(refs)]
    prefixes = [first_word(r) for r in refs]
    with open(terms, "w", encoding="utf-8") as f:
        f.writelines("\t".join(ps) + "\n" for ps in phrases)
    with open(starts, "w", encoding="utf-8") as f:
        f.writelines(p + "\n" for p in prefixes)

    ours = f"--workdir={args.workdir}"
    plain = run(ours, source, reference, *extra)
    constrained = run(ours, source, reference, f"--constraints={terms}", *extra)
    prefixed = run(ours, source, reference, f"--prefix={starts}", *extra)
    met = [m for h in constrained["best"] for m in h.get("constraints_met", [])]
    in_text = [
        p in h["text"] for h, ps in zip(constrained["best"], phrases, strict=True) for p in ps
    ]
    row = {
        "benchmark": "constraints",
        "lines": len(refs),
        "phrases": len(met),
        "met_share": round(sum(met) / max(len(met), 1), 4),
        "in_text_share": round(sum(in_text) / max(len(in_text), 1), 4),
        "bleu_plain": plain["bleu"],
        "bleu_constrained": constrained["bleu"],
        "bleu_prefixed": prefixed["bleu"],
        "chrf_plain": plain["chrf"],
        "chrf_constrained": constrained["chrf"],
        "translate_s_plain": plain["translate_s"],
        "translate_s_constrained": constrained["translate_s"],
        "translate_s_prefixed": prefixed["translate_s"],
        "cost_constrained": round(constrained["translate_s"] / plain["translate_s"], 3),
        "prefix_share": round(
            sum(h["text"].startswith(p) for h, p in zip(prefixed["best"], prefixes, strict=True))
            / len(refs),
            4,
        ),
        "decode_flags": extra,
    }
    if args.ct2:
        flags = (f"--prefix={starts}", "--length_penalty=average")
        theirs = run(f"--ct2={args.ct2}", source, reference, *flags)
        same_rule = run(ours, source, reference, *flags, "--stop=count")
        pairs_best = zip(same_rule["best"], theirs["best"], strict=True)
        same = sum(a["tokens"] == b["tokens"] for a, b in pairs_best)
        row["prefix_equal_to_ct2"] = round(same / len(refs), 4)
    print(json.dumps(row), flush=True)
    cols = ["lines", "phrases", "met_share", "in_text_share", "bleu_plain", "bleu_constrained"]
    cols += ["bleu_prefixed", "cost_constrained", "prefix_share"]
    harness.table([row], cols + (["prefix_equal_to_ct2"] if args.ct2 else []))


if __name__ == "__main__":
    main()

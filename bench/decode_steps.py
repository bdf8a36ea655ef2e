"""How many beam-row steps decode.py's batching runs, against each source searched alone.

    python bench/decode_steps.py --workdir=workdir/tiny            # Ding test set, beam 4
    python bench/decode_steps.py --workdir=workdir/tiny --stops=bound --limit=200

A beam-row step is one row of one decoder step (a source's K beams are K rows).
The count is exact, not timed: rows x K x the steps each search program ran (the
state's step before and after it), filler rows included. `batched` is what
decode.py runs (search.translate.translate_ids, its default batch_tokens);
`alone` runs every source in a batch of its own, which leaves the search at the
step the source is done: the fewest steps any batching could run with that rule.
Their ratio bounds what continuous batching could save (docs/decoding.md). The
output tokens (EOS included) are the same in both, as are the translations.
`s` is each translation's seconds, its programs' compilation included (nothing
is kept on disk here): the counts are the measure. Prints one JSON object, then a
table. On the Ding test set, the model `make train` writes, beam 4: 119,680
against 85,744 (bound), 69,248 against 44,424 (heuristic).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common


@dataclasses.dataclass
class CountingSearch:
    """An search.stages.Search that counts the beam-row steps of the one it wraps."""

    search: object
    steps: int = 0
    calls: int = 0

    n_best = property(lambda self: self.search.n_best)
    beam_size = property(lambda self: self.search.beam_size)
    program_key = property(lambda self: self.search.program_key)

    def _count(self, out, before: int):
        import jax

        state, _ = out
        rows, k, _room = state.live_seqs.shape
        self.steps += rows * k * (int(jax.device_get(state.step)) - before)
        self.calls += 1
        return out

    def start(self, src, room, keep=0, until=0):
        return self._count(self.search.start(src, room, keep, until), 0)

    def resume(self, state, room, keep=0, until=0):
        import jax

        before = int(jax.device_get(state.step))
        return self._count(self.search.resume(state, room, keep, until), before)


def count(model, sources, rule, alpha: float, alone: bool) -> dict:
    """Beam-row steps, search calls, output tokens and seconds of one translation."""
    from inference.options import DecodeOptions
    from search.stages import run_stages
    from search.translate import LiveSearch

    search = CountingSearch(LiveSearch(model, rule, alpha))
    default = dict(batch_tokens=DecodeOptions.batch_tokens)  # decode.py's --batch_tokens
    batching = dict(batch_tokens=1, min_rows=1) if alone else default
    t0 = time.perf_counter()
    hyps = run_stages(search, sources, max_len=model.config.max_len, **batching)
    seconds = time.perf_counter() - t0
    tokens = sum(len(h[0].tokens) + 1 for h in hyps if h)
    return dict(beam_row_steps=search.steps, calls=search.calls, out_tokens=tokens, s=seconds)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="workdir/tiny", help="a trained workdir")
    p.add_argument("--stops", default="bound,heuristic", help="stopping rules to count")
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--limit", type=int, default=None, help="only the first N test sentences")
    args = p.parse_args(argv)

    from data.corpora import prepare_ding
    from inference.restore import load_workdir
    from model import EOS_ID
    from search.translate import search_rule, vocab_limit

    model, config, step, tok = load_workdir(args.workdir)
    pairs = prepare_ding()["test"][: args.limit]
    sources = [[*ids, EOS_ID] for ids in tok.encode_batch([de for de, _ in pairs])]
    limit = vocab_limit(tok.vocab_size, config)
    rows = []
    for stop in args.stops.split(","):
        rule = search_rule(args.beam_size, 1, limit, stop=stop)
        batched = count(model, sources, rule, args.alpha, alone=False)
        alone = count(model, sources, rule, args.alpha, alone=True)
        for name, r in (("batched", batched), ("alone", alone)):
            rows.append({"stop": stop, "batching": name, **r})
        rows[-2]["batched_per_alone"] = batched["beam_row_steps"] / alone["beam_row_steps"]
    meta = {"workdir": os.path.abspath(args.workdir), "step": step, "sentences": len(sources),
            "beam_size": args.beam_size, "alpha": args.alpha}  # fmt: skip
    columns = ["stop", "batching", "beam_row_steps", "calls", "out_tokens", "s",
               "batched_per_alone"]  # fmt: skip
    common.report("decode_steps", meta, rows, columns)


if __name__ == "__main__":
    main()

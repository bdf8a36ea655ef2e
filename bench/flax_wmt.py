"""Our beam search against the Flax WMT example's, on the same model, weights and shapes.

    python bench/flax_wmt.py --flax_wmt=DIR [--configs=tiny] [--batch_sizes=8,32,128]
        [--src_len=32] [--beam_size=4] [--alpha=0.6] [--iters=3]
    python bench/flax_wmt.py --flax_wmt=DIR --workdir=workdir/tiny [--split=test]
        [--batch_tokens=256,1024,4096] [--limit=N]

DIR holds Flax's examples/wmt/decode.py; get it with
`git clone https://github.com/google/flax` and pass `--flax_wmt=flax/examples/wmt`.
The file is loaded at run time and never copied into this repository.

Set-up as bench/decode.py's: random-weight models of the configs' sizes (dropout 0,
float32 on CPU), sources of 10..src_len tokens ending in EOS, the same RNG
scheme, and L = S + 50 output columns (capped at the model's max_len). Both
searches drive the same `Transformer.decode_step` with the same weights, the same
K, alpha, EOS and L, each inside one jax.jit: only the search differs.

- "ours": `model.decoding.beam_search` (K rows per source share one copy of the
  cross-attention keys/values; each source stops when its best is final; EOS
  forced at each row's limit, source length + 50).
- "flax-wmt": Flax's `beam_search` with our `decode_step` as tokens_to_logits and
  `init_cache(src, L)` as the cache. As in the Flax example, `beam_init` tiles
  every non-scalar cache leaf K times, so each beam carries (and every step
  gathers) its own copy of the cross-attention keys/values and source mask.
  Flax feeds id 0 first (their BOS); we feed our BOS there, and ban PAD and BOS
  (and ids past the tokenizer's) from its logits as our search does. Its sequences
  [B, K, L] are sorted worst to best with a dummy 0 in column 0, so the best is
  [:, -1, 1:] (at most L - 1 tokens); it stops the whole batch once every
  source's worst finished beats its best live.

With --workdir, the workload decode.py's goals are stated on instead: a trained
model (`inference.restore.load_workdir`), the Ding --split sentences, and for
each --batch_tokens the batches decode.py forms (`data.plans.plan_translation`).
"ours" is decode.py's own search over them (`search.stages.run_stages`:
sources leave when done, the cache grows stage by stage); "flax-wmt" runs
Flax's `beam_search` on each of the same batches, its cache L = width + 50
columns from the start. Both are compiled by a first pass, then the second is
timed; BLEU and chrF of both against the references.

Tokens counted, for both: the best hypothesis's tokens up to and including its
first EOS (all of its columns if it has none). `same_best` is the share of
sources whose best hypotheses are identical token for token; `same_prefix` the
share where one is a prefix of the other once their final EOS is dropped (a
random model rarely emits EOS by itself, so each search's length limit decides
where it ends: ours forces EOS at source length + 50, Flax stops at L - 1
tokens). Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import os
import sys
import time
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common
from model.tokens import BOS_ID, EOS_ID  # imports nothing (no JAX)

_HOW_TO_GET = (
    "needs Flax's examples/wmt/decode.py: `git clone https://github.com/google/flax` "
    "and pass --flax_wmt=flax/examples/wmt"
)


def flax_decode_path(directory: str) -> str:
    """DIR/decode.py as an absolute path; exits with how to get it if absent."""
    path = os.path.abspath(os.path.join(directory, "decode.py")) if directory else ""
    if not path or not os.path.isfile(path):
        sys.exit(f"bench/flax_wmt.py: {_HOW_TO_GET} (got --flax_wmt={directory!r})")
    return path


def load_flax_decode(path: str) -> ModuleType:
    """Flax's decode.py, imported from `path` under a private module name."""
    spec = importlib.util.spec_from_file_location("_flax_wmt_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _build_model(name: str, src_len: int, on_cpu: bool) -> tuple[Any, dict[str, Any]]:
    """A random-weight Transformer of configs/NAME.py's sizes, as bench/decode.py builds it."""
    from flax import nnx

    from model import Transformer, TransformerConfig

    cfg = importlib.import_module(f"configs.{name}").get_config()
    fields = {**cfg.model.to_dict(), "vocab_size": cfg.vocab_size}
    fields.update(dropout_rate=0.0, max_len=max(cfg.model.max_len, src_len + 50))
    if on_cpu:
        fields["dtype"] = "float32"
    tc = TransformerConfig.from_dict(fields)
    meta = {k: fields[k] for k in ("d_model", "num_heads", "d_ff", "dtype", "vocab_size")}
    meta["layers"] = f"{tc.num_encoder_layers}+{tc.num_decoder_layers}"
    return Transformer(tc, rngs=nnx.Rngs(0)), meta


def _make_src(rng, batch: int, src_len: int, vocab_size: int):
    """[B, S] int32 sources of 10..src_len tokens, the last one EOS, 0-padded."""
    import numpy as np

    lengths = rng.integers(10, src_len + 1, size=batch)
    src = np.zeros((batch, src_len), np.int32)  # [B, S]
    for i, n in enumerate(lengths):
        src[i, : n - 1] = rng.integers(4, vocab_size, size=n - 1)
        src[i, n - 1] = EOS_ID
    return src


def make_flax_search(flax_decode: ModuleType):
    """A jitted (graphdef, state, src) -> best tokens [B, L - 1] of Flax's beam_search."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.scoring import restrict

    static = ("graphdef", "beam_size", "alpha", "length", "vocab_limit")

    @functools.partial(jax.jit, static_argnames=static)
    def search(graphdef, state, src, *, beam_size, alpha, length, vocab_limit=None):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(src, length)  # rows [B, ...]; Flax tiles them to [B*K, ...]

        def tokens_to_logits(flat_ids, flat_cache):
            ids = flat_ids[:, 0]  # [B*K, 1] -> [B*K]
            # Flax's first input is its BOS, id 0; ours is BOS_ID.
            ids = jnp.where(flat_cache.index == 0, BOS_ID, ids)
            logits, flat_cache = model.decode_step(ids, flat_cache)  # [B*K, V], cache
            never = jnp.zeros(ids.shape, bool)  # Flax ends rows at its own length limit
            return restrict(logits, never, vocab_limit), flat_cache

        seqs, _ = flax_decode.beam_search(
            src,
            cache,
            tokens_to_logits,
            beam_size=beam_size,
            alpha=alpha,
            eos_id=EOS_ID,
            max_decode_len=length,
        )
        return seqs[:, -1, 1:]  # [B, K, L] worst..best, dummy column 0 -> best [B, L - 1]

    return search


def _out_lengths(tokens):
    """[B, T] -> [B]: tokens up to and including the first EOS, or T if none."""
    import numpy as np

    is_eos = tokens == EOS_ID
    return np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, tokens.shape[1])


def _time(run, batch: int, iters: int) -> tuple[dict[str, float], Any]:
    """Throughput figures of run() -> best tokens [B, T], and those tokens (first call)."""
    import jax
    import numpy as np

    t0 = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(run()))
    first_call_s = time.perf_counter() - t0
    seconds = common.time_fn(run, warmup=0, iters=iters)
    lengths = _out_lengths(tokens)
    figures = {
        "sentences_per_s": batch / seconds,
        "tokens_per_s": float(lengths.sum()) / seconds,
        "mean_out_len": float(lengths.mean()),
        "ms_per_step": 1e3 * seconds / float(lengths.max()),
        "seconds": seconds,
        "first_call_s": first_call_s,
    }
    return figures, tokens


def _agreement(ours, theirs) -> dict[str, float]:
    """same_best: share of rows whose best tokens, up to and including the first EOS, are
    identical; same_prefix: share where, without that EOS, one is a prefix of the other
    (a random model rarely ends by itself, so the two searches' length limits decide)."""
    a, b = _out_lengths(ours), _out_lengths(theirs)
    same, prefix = [], []
    for i, (n, m) in enumerate(zip(a, b, strict=True)):
        x, y = ours[i, :n], theirs[i, :m]
        same.append(n == m and bool((x == y).all()))
        x, y = x[:-1] if x[-1] == EOS_ID else x, y[:-1] if y[-1] == EOS_ID else y
        k = min(len(x), len(y))
        prefix.append(bool((x[:k] == y[:k]).all()))
    return {"same_best": sum(same) / len(same), "same_prefix": sum(prefix) / len(prefix)}


def compare(model, src, flax_search, *, beam_size: int, alpha: float, iters: int) -> list[dict]:
    """Rows for "ours" and "flax-wmt" at one batch: the same src [B, S], K, alpha and L."""
    import jax.numpy as jnp
    from flax import nnx

    from model.decoding import beam_search
    from model.scoring import decode_shape

    src = jnp.asarray(src, jnp.int32)
    length, _ = decode_shape(model, src, None)
    graphdef, state = nnx.split(model)

    def ours():
        tokens, _ = beam_search(model, src, beam_size=beam_size, alpha=alpha)
        return tokens[:, 0]  # [B, K, L] best first -> [B, L]

    def flax_wmt():
        return flax_search(graphdef, state, src, beam_size=beam_size, alpha=alpha, length=length)

    b = src.shape[0]
    our_figures, our_tokens = _time(ours, b, iters)
    flax_figures, flax_tokens = _time(flax_wmt, b, iters)
    return [
        {
            "decoder": "ours",
            **our_figures,
            "speedup": flax_figures["seconds"] / our_figures["seconds"],
            **_agreement(our_tokens, flax_tokens),
        },
        {"decoder": "flax-wmt", **flax_figures},
    ]


def _best_tokens(row) -> list[int]:
    """One best hypothesis [T] -> its ids before the first EOS."""
    ids = [int(t) for t in row]
    return ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids


def _flax_over_plan(model, sources, plan, flax_search, *, beam_size, alpha, vocab_limit):
    """Flax's beam_search over decode.py's batches: per source, its best ids (no EOS)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from search.stages import batch_of, stage_rooms

    graphdef, state = nnx.split(model)
    out: list[list[int]] = [[] for _ in sources]
    nonempty = [i for i, s in enumerate(sources) if len(s)]
    for chunk, width, rows in plan:
        picked = [nonempty[j] for j in chunk]
        src = jnp.asarray(batch_of(sources, picked, rows, width))  # [rows, width]
        length = stage_rooms(width, model.config.max_len)[-1]  # ours ends here too
        best = flax_search(graphdef, state, src, beam_size=beam_size, alpha=alpha,
                           length=length, vocab_limit=vocab_limit)  # fmt: skip
        for row, i in zip(np.asarray(best), picked, strict=False):
            out[i] = _best_tokens(row)
    return out


def workload(args, flax_search) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(meta, rows): ours and Flax's search on decode.py's batches of a trained model."""
    import sacrebleu

    from data.corpora import prepare_ding
    from data.plans import plan_translation
    from inference.restore import load_workdir
    from search.stages import run_stages
    from search.translate import LiveSearch, search_rule, vocab_limit

    model, config, step, tok = load_workdir(args.workdir)
    pairs = prepare_ding()[args.split][: args.limit]
    sources = [[*ids, EOS_ID] for ids in tok.encode_batch([de for de, _ in pairs])]
    refs = [en for _, en in pairs]
    limit = vocab_limit(tok.vocab_size, config)
    search = LiveSearch(model, search_rule(args.beam_size, 1, limit), args.alpha)
    max_len = model.config.max_len
    rows = []
    for bt in (int(x) for x in args.batch_tokens.split(",")):
        plan = plan_translation([len(x) for x in sources if x], batch_tokens=bt, max_len=max_len)

        def ours(bt=bt):
            hyps = run_stages(search, sources, max_len=max_len, batch_tokens=bt)
            return [list(h[0].tokens) if h else [] for h in hyps]

        def flax_wmt(plan=plan):
            return _flax_over_plan(model, sources, plan, flax_search, beam_size=args.beam_size,
                                   alpha=args.alpha, vocab_limit=limit)  # fmt: skip

        got = {}
        for name, run in (("ours", ours), ("flax-wmt", flax_wmt)):
            t0 = time.perf_counter()
            run()  # compiles every batch shape's programs
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            best = run()
            seconds = time.perf_counter() - t0
            hyps = [tok.decode(b) for b in best]
            tokens = sum(len(b) + 1 for b in best)  # EOS included
            got[name] = best
            rows.append({"decoder": name, "batch_tokens": bt, "batches": len(plan),
                         "rows": sorted({r for _, _, r in plan}), "seconds": seconds,
                         "first_call_s": first, "tokens_per_s": tokens / seconds,
                         "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
                         "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score})  # fmt: skip
        same = sum(a == b for a, b in zip(got["ours"], got["flax-wmt"], strict=True))
        rows[-2]["speedup"] = rows[-1]["seconds"] / rows[-2]["seconds"]
        rows[-2]["same_best"] = same / len(sources)
        print(f"# batch_tokens={bt}: ours {rows[-2]['seconds']:.2f} s, flax-wmt "
              f"{rows[-1]['seconds']:.2f} s, same best {same / len(sources):.1%}",
              file=sys.stderr)  # fmt: skip
    meta = {"workdir": os.path.abspath(args.workdir), "step": step, "split": args.split,
            "sentences": len(sources), "beam_size": args.beam_size,
            "alpha": args.alpha}  # fmt: skip
    return meta, rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flax_wmt", default="", help="directory holding Flax's wmt decode.py")
    p.add_argument("--configs", default="tiny")
    p.add_argument("--batch_sizes", default="8,32,128")
    p.add_argument("--src_len", type=int, default=32)
    p.add_argument("--beam_size", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--workdir", default="", help="a trained workdir: decode.py's workload")
    p.add_argument("--split", default="test", help="with --workdir: the Ding split")
    p.add_argument("--batch_tokens", default="256,1024,4096", help="with --workdir")
    p.add_argument("--limit", type=int, default=None, help="with --workdir: first N lines")
    args = p.parse_args(argv)
    flax_path = flax_decode_path(args.flax_wmt)
    common.set_gpu_flags()
    flax_decode = load_flax_decode(flax_path)  # imports JAX: after the XLA flags

    import jax
    import numpy as np

    flax_search = make_flax_search(flax_decode)
    flax_meta = {"flax_decode_py": flax_path, "flax_decode_sha256": _sha256(flax_path)}
    if args.workdir:
        meta, rows = workload(args, flax_search)
        columns = ["decoder", "batch_tokens", "batches", "seconds", "first_call_s"]
        columns += ["tokens_per_s", "speedup", "same_best", "bleu", "chrf"]
        common.report("flax_wmt_workload", {**common.device_info(), **meta, **flax_meta},
                      rows, columns)  # fmt: skip
        return
    on_cpu = jax.default_backend() == "cpu"
    rows, meta_configs, lengths = [], {}, {}
    for name in args.configs.split(","):
        model, meta_configs[name] = _build_model(name, args.src_len, on_cpu)
        lengths[name] = min(args.src_len + 50, model.config.max_len)
        rng = np.random.default_rng(0)
        for b in (int(x) for x in args.batch_sizes.split(",")):
            src = _make_src(rng, b, args.src_len, model.config.vocab_size)
            pair = compare(
                model,
                src,
                flax_search,
                beam_size=args.beam_size,
                alpha=args.alpha,
                iters=args.iters,
            )
            for r in pair:
                rows.append({"config": name, "beam": args.beam_size, "batch": b, **r})
            print(
                f"# {name} batch={b}: ours {pair[0]['seconds']:.3f} s, "
                f"flax-wmt {pair[1]['seconds']:.3f} s, same best {pair[0]['same_best']:.0%}, "
                f"same prefix {pair[0]['same_prefix']:.0%}",
                file=sys.stderr,
            )
    meta = {
        **common.device_info(),
        "src_len": args.src_len,
        "max_decode_len": lengths,
        "alpha": args.alpha,
        **flax_meta,
        "configs": meta_configs,
    }
    columns = ["config", "decoder", "beam", "batch", "sentences_per_s", "tokens_per_s"]
    columns += ["mean_out_len", "ms_per_step", "seconds", "first_call_s", "speedup"]
    common.report("flax_wmt", meta, rows, [*columns, "same_best", "same_prefix"])


if __name__ == "__main__":
    main()

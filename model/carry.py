"""Sources moved between beam-search batches, on the host (numpy): the carry-over of
search/stages.py takes a batch's unfinished sources out of its state and joins
them with others of the same step into a batch of their own.

    kept = take_sources(fetch(state), np.array([3, 7]))     # sources 3 and 7 of a batch
    joined = join_sources([kept, other], width=16, rows=8, room=48)
"""

from __future__ import annotations

import jax
import numpy as np

from model.beam import BeamState


def take_sources(s: BeamState, idx: np.ndarray) -> BeamState:
    """The sources `idx` of a batch's state (numpy arrays, e.g. a fetched state)."""
    k = s.live_seqs.shape[1]
    per_source = lambda x: x[idx]
    per_beam = lambda x: x.reshape(-1, k, *x.shape[1:])[idx].reshape(-1, *x.shape[1:])
    cache = s.cache.replace(
        self_kv=jax.tree.map(per_beam, s.cache.self_kv),  # [B*K, ...] -> [n*K, ...]
        cross_kv=jax.tree.map(per_source, s.cache.cross_kv),
        src_valid=per_source(s.cache.src_valid),
    )
    fields = ("live_seqs", "live_logp", "fin_seqs", "fin_scores", "limits")
    return s._replace(cache=cache, **{f: per_source(getattr(s, f)) for f in fields})


def join_sources(
    parts: list[BeamState], width: int, rows: int, room: int | None = None
) -> BeamState:
    """Sources taken from batches at the same step, as one batch of `rows` sources of
    source width `width` (numpy): cross-attention keys/values [B, N, S, H] and the
    source mask padded to the width, then filler sources that are already done;
    with `room`, sequences and self-attention caches padded to that many tokens."""
    steps = {int(p.step) for p in parts}
    if len(steps) != 1:
        raise ValueError(f"sources at different steps {sorted(steps)} cannot share a batch")
    n = sum(p.live_seqs.shape[0] for p in parts)
    k = parts[0].live_seqs.shape[1]
    fill = rows - n

    def cat(xs, axis_width=None, value=0, per_beam=False, axis_room=None):
        x = np.concatenate(xs)
        pad = [(0, fill * (k if per_beam else 1))] + [(0, 0)] * (x.ndim - 1)
        if axis_width is not None:
            pad[axis_width] = (0, width - x.shape[axis_width])
        if axis_room is not None and room is not None:
            pad[axis_room] = (0, room - x.shape[axis_room])
        return np.pad(x, pad, constant_values=value)

    def field(name, **kw):
        return cat([getattr(p, name) for p in parts], **kw)

    def kv(name, axis_width=None, per_beam=False, axis_room=None):
        layers = zip(*[getattr(p.cache, name) for p in parts], strict=True)
        return tuple(
            type(kvs[0])(
                cat([x.k for x in kvs], axis_width, per_beam=per_beam, axis_room=axis_room),
                cat([x.v for x in kvs], axis_width, per_beam=per_beam, axis_room=axis_room),
            )
            for kvs in layers
        )

    cache = parts[0].cache.replace(
        self_kv=kv("self_kv", per_beam=True, axis_room=2),  # [n*K, N, C, H] -> [rows*K, N, room, H]
        cross_kv=kv("cross_kv", axis_width=2),  # [n, N, S', H] -> [rows, N, width, H]
        src_valid=cat([p.cache.src_valid for p in parts], axis_width=1, value=False),
    )
    return parts[0]._replace(
        live_seqs=field("live_seqs", axis_room=2),  # [n, K, C] -> [rows, K, room]
        live_logp=field("live_logp", value=-np.inf),  # filler: no live beam ...
        fin_seqs=field("fin_seqs", axis_room=2),
        fin_scores=field("fin_scores", value=-np.inf),  # ... and nothing left to find
        limits=field("limits", value=1),
        cache=cache,
    )

"""The batch size a search runs with when none is given, declared once (a plain module,
no JAX: decode.py's flags read it before JAX loads).

    default_batch_tokens()          # 512 on a CPU, 32768 on a GPU or TPU
    CT2_BATCH_TOKENS["cpu"]         # decode.py --ct2's
"""

from __future__ import annotations

# Padded source tokens per batch, by platform. A CPU's batches stay small: a search
# step's time grows with its rows, and a batch runs until its slowest source is done
# (on the Ding train sources with the tiny model, 512 gave 2,290-2,370 target tokens/s
# against 1,520-1,580 at 4096). An accelerator's are made big enough to keep it busy
# (beam search holds K x as many tokens, each with a key and a value per layer in its
# cache).
BATCH_TOKENS = {"cpu": 512, "gpu": 32768, "cuda": 32768, "rocm": 32768, "tpu": 32768}
# CTranslate2's (decode.py --ct2: its max_batch_size, batch_type "tokens"), by --device.
CT2_BATCH_TOKENS = {"cpu": 4096, "cuda": 32768}


def default_batch_tokens(platform: str | None = None) -> int:
    """BATCH_TOKENS of `platform` (default: JAX's default backend; a CPU's if unlisted)."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return BATCH_TOKENS.get(platform, BATCH_TOKENS["cpu"])

"""Sinusoidal positional encodings (paper section 3.5)."""

import numpy as np


def sinusoidal_positions(length: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)).

    Returns a float32 array [length, d_model]; even columns hold sines and odd
    columns cosines, interleaved exactly as in the paper's formula.
    """
    pos = np.arange(length, dtype=np.float64)[:, None]  # [L, 1]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # [1, ceil(D/2)]
    angle = pos / np.power(10000.0, two_i / d_model)  # [L, ceil(D/2)]
    pe = np.zeros((length, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe.astype(np.float32)

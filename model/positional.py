"""Sinusoidal positional encodings (paper section 3.5)."""

import numpy as np


def sinusoidal_positions(length: int, d_model: int, halves: bool = False) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)).

    Returns a float32 array [length, d_model]; even columns hold sines and odd
    columns cosines, interleaved exactly as in the paper's formula. With `halves`,
    Marian's layout of the same waves: the D/2 sines first, then the D/2 cosines.
    """
    pos = np.arange(length, dtype=np.float64)[:, None]  # [L, 1]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # [1, ceil(D/2)]
    angle = pos / np.power(10000.0, two_i / d_model)  # [L, ceil(D/2)]
    pe = np.zeros((length, d_model), dtype=np.float64)
    if halves:
        half = d_model // 2
        pe[:, :half], pe[:, half:] = np.sin(angle[:, :half]), np.cos(angle[:, : d_model - half])
    else:
        pe[:, 0::2] = np.sin(angle)
        pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe.astype(np.float32)


def plot(path: str, length: int = 50, d_model: int = 128) -> None:
    """Draw the encoding matrix [length, d_model] as a heatmap (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pe = sinusoidal_positions(length, d_model)  # [L, D]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    im = ax.imshow(pe, cmap="RdBu", vmin=-1.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xlabel("dimension i (even: sin, odd: cos)")
    ax.set_ylabel("position")
    ax.set_title(f"Sinusoidal positional encoding, {length} positions x {d_model} dimensions")
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Draw the positional-encoding matrix (paper 3.5).")
    p.add_argument("--plot", required=True, help="output image, e.g. PE.png")
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--d_model", type=int, default=128)
    args = p.parse_args()
    if args.length < 1 or args.d_model < 1:
        p.error("--length and --d_model must be positive")
    plot(args.plot, args.length, args.d_model)
    print(f"wrote {args.plot}")

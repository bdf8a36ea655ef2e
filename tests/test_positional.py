"""Sinusoidal positional encodings against the paper's formula (section 3.5)."""

import math

import numpy as np
import pytest

from attention_jax.positional import sinusoidal_positions


@pytest.mark.parametrize("length,d_model", [(1, 2), (50, 16), (7, 9), (128, 512)])
def test_matches_paper_formula(length, d_model):
    pe = sinusoidal_positions(length, d_model)
    assert pe.shape == (length, d_model)
    assert pe.dtype == np.float32
    for pos in range(0, length, max(1, length // 7)):
        for j in range(d_model):
            i = j // 2
            angle = pos / 10000 ** (2 * i / d_model)
            expected = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert pe[pos, j] == pytest.approx(expected, abs=1e-6)


def test_relative_position_is_linear():
    # The paper's motivation: PE(pos + k) is a fixed rotation of PE(pos) per frequency.
    d, k = 8, 3
    pe = sinusoidal_positions(20, d).astype(np.float64)
    for i in range(d // 2):
        w = 1 / 10000 ** (2 * i / d)
        c, s = math.cos(k * w), math.sin(k * w)
        rot = np.array([[c, -s], [s, c]])  # sin(a+b), cos(a+b) from sin a, cos a
        pair = pe[:, 2 * i : 2 * i + 2]  # [sin, cos]
        np.testing.assert_allclose(pair[:-k] @ rot, pair[k:], atol=1e-5)


def test_the_picture_command_draws_the_matrix(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "PE.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "attention_jax.positional",
            f"--plot={out}",
            "--length=50",
            "--d_model=128",
        ],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # no runpy warning: `import model` does not load model.positional
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

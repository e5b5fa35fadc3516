"""The read noise an MVM's outputs should carry, from the physics (DEVICE_MODEL section 3), for the
tests that check it in sidra_core and at both bridges."""

from __future__ import annotations

import numpy as np

import sidra_core as sc
from sidra_core.quant import quantise_rows

# The chip these checks use: INT8 codes with read noise and no ADC, so an output's spread is the read
# noise alone: sum_i (x_i code)^2 var_ij, scaled by the row's DAC scale and the column's weight scale.
NOISY_INT8 = dict(noise__read_sigma=0.01, adc__enabled=False)


def read_variance(w, x, spec) -> np.ndarray:
    """Per-output variance (rows, N) of `x @ w` (w: K x N) read once on `spec`'s chip, from the
    physics alone: each cell's read noise is read_sigma x its conductance, so a weight (G+, G-) read
    by DAC code q adds q^2 (read_sigma / dG)^2 (G+^2 + G-^2) code units^2, dG the conductance of one
    code; the row's DAC scale and the column's weight scale take codes to outputs."""
    k, n = w.shape
    st = sc.program(w, spec)
    dg = (spec.tile.g_max - spec.tile.g_min) / 127
    g2 = (st.g_plus.astype(np.float64) ** 2 + st.g_minus.astype(np.float64) ** 2)[:k, :n]
    q, xs = (np.asarray(a, np.float64) for a in quantise_rows(np.asarray(x, np.float32), 8))
    code_var = (q ** 2) @ g2 * (spec.noise.read_sigma / dg) ** 2
    return code_var * (xs * st.scale[None, :].astype(np.float64)) ** 2


def assert_read_variance(reads: np.ndarray, expected: np.ndarray, within: float = 0.04) -> None:
    """`reads` (S, rows, N): S reads of the same outputs. Each output's variance over the reads,
    divided by the physics' variance, has relative sd sqrt(2 / (S - 1)); their mean over M outputs
    has sd sqrt(2 / (S - 1) / M). `within` must be several of those sd (it is asserted), so a
    sigma wired 10 % off (a ratio of 1.21) fails and a right one never does."""
    s, m = reads.shape[0], expected.size
    sd = np.sqrt(2 / (s - 1) / m)
    assert within >= 5 * sd, f"{s} reads of {m} outputs: sd {sd:.4f} is too large for +-{within}"
    ratio = reads.var(axis=0, ddof=1) / expected
    assert abs(ratio.mean() - 1) < within, ratio.mean()

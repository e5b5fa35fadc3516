"""Counter-based random numbers: distribution and independence of rng.normal, normal_pair,
box_muller and uniform."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from sidra_core import rng

N = 200_000


def _normal(seed, n=N):
    return np.asarray(rng.normal(jnp.uint32(seed), jnp.arange(n, dtype=jnp.uint32)), np.float64)


def _assert_standard_normal(z, max_abs: float) -> None:
    """N draws of a standard normal, bounded by max_abs."""
    assert np.all(np.isfinite(z))
    # n = 2e5: sd of the mean 0.0022, of the std 0.0016, of the kurtosis ~0.011; bounds are ~5 sd
    assert abs(z.mean()) < 0.011
    assert abs(z.std() - 1) < 0.008
    assert abs(scipy_stats.skew(z)) < 0.03
    assert abs(scipy_stats.kurtosis(z)) < 0.06
    ks = scipy_stats.kstest(z, "norm")
    assert ks.pvalue > 1e-4, ks  # deterministic for a fixed seed; a broken generator gives p ~ 0
    # tails: P(|z| > 3) = 0.0027 -> 540 +- 23 expected
    assert 400 < (np.abs(z) > 3).sum() < 680
    assert np.abs(z).max() < max_abs


@pytest.mark.parametrize("seed", [0, 1, 12345, 0xFFFFFFFF])
def test_normal_moments_and_ks(seed):
    _assert_standard_normal(_normal(seed), 6)


def test_normal_shape_and_determinism():
    a = np.asarray(rng.normal(jnp.uint32(7), jnp.arange(60, dtype=jnp.uint32).reshape(3, 4, 5)))
    assert a.shape == (3, 4, 5) and a.dtype == np.float32
    np.testing.assert_array_equal(a, np.asarray(rng.normal(jnp.uint32(7), jnp.arange(60, dtype=jnp.uint32).reshape(3, 4, 5))))
    # counters 0..size-1: the same draws whatever the shape
    np.testing.assert_array_equal(a.ravel(), np.asarray(rng.normal(jnp.uint32(7), jnp.arange(60, dtype=jnp.uint32))))


@pytest.mark.parametrize("pair", [(0, 1), (1, 2), (5, 5 ^ 1), (0, 1 << 31), (123, 124)])
def test_seeds_independent(pair):
    a, b = _normal(pair[0]), _normal(pair[1])
    assert not np.array_equal(a, b)
    # Pearson correlation of independent streams: sd 1/sqrt(n) = 0.0022; 5 sd
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.011
    # also no shifted overlap (a stream of one seed reappearing at an offset of another)
    assert abs(np.corrcoef(a[1:], b[:-1])[0, 1]) < 0.011
    assert (a == b).sum() < 10  # 23-bit draws: P(equal) ~ 2^-23 per position -> ~0.02 expected


def test_adjacent_counters_uncorrelated():
    z = _normal(3)
    for lag in (1, 2, 256):
        assert abs(np.corrcoef(z[:-lag], z[lag:])[0, 1]) < 0.011


def test_uniform():
    u = np.asarray(rng.uniform(jnp.uint32(9), jnp.arange(N, dtype=jnp.uint32)), np.float64)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.004  # sd 0.00065
    assert scipy_stats.kstest(u, "uniform").pvalue > 1e-4
    counts = np.bincount((u * 16).astype(int), minlength=16)
    chi2 = ((counts - N / 16) ** 2 / (N / 16)).sum()
    assert chi2 < 50  # 15 dof: P(chi2 > 50) ~ 1e-5


def test_seed32_mixes_parts():
    assert rng.seed32(1, 2) != rng.seed32(2, 1)
    assert rng.seed32(0, 1) != rng.seed32(0, 2)
    assert len({rng.seed32(0, i) for i in range(10000)}) == 10000
    assert 0 <= rng.seed32(2**64 + 5, -1) < 2**32


@pytest.mark.parametrize("seed", [0, 77, 0xFFFFFFFF])
def test_normal_pair_draws_are_independent_standard_normals(seed):
    """The programming model's normals: two 16-bit inverse-CDF draws from one hash."""
    z1, z2 = (np.asarray(z, np.float64) for z in rng.normal_pair(jnp.uint32(seed), jnp.arange(N, dtype=jnp.uint32)))
    for z in (z1, z2):
        _assert_standard_normal(z, 4.5)  # 16 bits: the outermost bin centre is at 4.4 sd
        assert len(np.unique(z)) <= 1 << 16
    # independent halves of one hash: no correlation, in value or in magnitude (sd 0.0022)
    assert abs(np.corrcoef(z1, z2)[0, 1]) < 0.011
    assert abs(np.corrcoef(np.abs(z1), np.abs(z2))[0, 1]) < 0.011
    assert abs(np.corrcoef(z1[:-1], z1[1:])[0, 1]) < 0.011


@pytest.mark.parametrize("seed", [0, 77, 0xFFFFFFFF])
def test_box_muller_pairs_are_independent_standard_normals(seed):
    z1, z2 = (np.asarray(z, np.float64) for z in rng.box_muller(jnp.uint32(seed), jnp.arange(N, dtype=jnp.uint32)))
    for z in (z1, z2):
        _assert_standard_normal(z, 6)
    # the pair: uncorrelated, also in magnitude, and its squared radius chi-square with 2 dof
    assert abs(np.corrcoef(z1, z2)[0, 1]) < 0.011
    assert abs(np.corrcoef(z1 ** 2, z2 ** 2)[0, 1]) < 0.011
    assert scipy_stats.kstest(z1 ** 2 + z2 ** 2, "chi2", args=(2,)).pvalue > 1e-4
    # and neither repeats the inverse-CDF stream of the same seed
    assert abs(np.corrcoef(z1, _normal(seed))[0, 1]) < 0.011

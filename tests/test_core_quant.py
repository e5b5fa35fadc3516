"""INT8 weight quantisation, existing INT8 codes, dynamic per-row activation quantisation."""

from __future__ import annotations

import numpy as np
import pytest

import sidra_core as sc
from sidra_core import from_int8, quantise_rows, quantise_weight

INT8 = sc.preset("int8")


def _w(k=300, n=40, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, n)) * rng.uniform(0.01, 5.0, n)).astype(np.float32)


def test_per_channel_codes():
    w = _w()
    q = quantise_weight(w, INT8)
    assert q.codes.dtype == np.int8 and q.codes.shape == w.shape
    assert q.scale.dtype == np.float32 and q.scale.shape == (w.shape[1],)
    np.testing.assert_allclose(q.scale, np.abs(w).max(axis=0) / 127, rtol=1e-6)
    assert np.abs(q.codes).max() <= 127
    # every column uses its full range: the largest |w| of each column maps to +-127
    assert np.all(np.abs(q.codes).max(axis=0) == 127)
    np.testing.assert_array_equal(q.codes, np.rint(w / q.scale[None, :]).astype(np.int8))
    # dequantised error at most half a code
    err = np.abs(q.dequantise() - w)
    assert np.all(err <= q.scale[None, :] * (0.5 + 1e-5))


def test_per_tensor_codes():
    w = _w()
    spec = sc.preset("int8", quant__granularity="per_tensor")
    q = quantise_weight(w, spec)
    s = np.abs(w).max() / 127
    np.testing.assert_allclose(q.scale, np.full(w.shape[1], s), rtol=1e-6)
    assert np.abs(q.codes).max() == 127
    # small-magnitude columns use only a few codes under a per-tensor scale
    small = np.argmin(np.abs(w).max(axis=0))
    assert np.abs(q.codes[:, small]).max() < 127
    np.testing.assert_array_equal(q.codes, np.rint(w / s).astype(np.int8))


def test_zero_column():
    w = _w(50, 4)
    w[:, 2] = 0
    q = quantise_weight(w, INT8)
    assert np.all(q.codes[:, 2] == 0)
    assert np.isfinite(q.scale).all() and q.scale[2] > 0


def test_clip_percentile_saturates_outliers():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((1000, 8)).astype(np.float32)
    w[0, :] = 50.0  # one huge outlier per column
    spec = sc.preset("int8", quant__clip_percentile=99.0)
    q = quantise_weight(w, spec)
    ref = np.percentile(np.abs(w), 99.0, axis=0) / 127
    np.testing.assert_allclose(q.scale, ref, rtol=1e-5)
    assert np.all(q.codes[0, :] == 127)  # the outlier saturates
    # about 1 % of each column saturates (the percentile definition; 1000 rows -> ~10 each)
    sat = (np.abs(q.codes) == 127).sum(axis=0)
    assert np.all((sat >= 5) & (sat <= 15))
    # non-saturated values keep half-code accuracy, finer than the unclipped quantiser
    q100 = quantise_weight(w, INT8)
    inside = np.abs(q.codes) < 127
    e_clip = np.abs(q.dequantise() - w)[inside].mean()
    e_full = np.abs(q100.dequantise() - w)[inside].mean()
    assert e_clip < 0.2 * e_full


def test_from_int8_keeps_codes():
    rng = np.random.default_rng(2)
    k, n = 300, 20
    codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.1, n).astype(np.float32)
    q = from_int8(codes, scale)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scale, scale)
    st = sc.program(spec=INT8, quantised=q, seed=0)
    np.testing.assert_array_equal(st.codes[:k, :n], codes)
    assert np.all(st.codes[k:, :] == 0) and np.all(st.codes[:, n:] == 0)
    np.testing.assert_array_equal(st.scale, scale)
    # the chip then computes with exactly these codes: with the ADC off the only other rounding is
    # the DAC's, so y equals (DAC-quantised x) @ (codes * scale) up to float32 summation error
    spec = sc.preset("int8", adc__enabled=False)
    st = sc.program(spec=spec, quantised=q, seed=0)
    x = rng.standard_normal((4, k)).astype(np.float32)
    y = np.asarray(sc.linear(st, x, spec), np.float64)
    xq, xs = (np.asarray(a, np.float64) for a in quantise_rows(x, 8))
    ref = (xq @ codes.astype(np.float64)) * xs * scale
    scale_ref = (np.abs(xq) @ np.abs(codes.astype(np.float64))) * xs * scale
    assert np.all(np.abs(y - ref) <= 1e-5 * scale_ref)


def test_from_int8_scalar_scale_and_minus_128():
    codes = np.array([[-128, 5], [127, -127]], np.int8)
    q = from_int8(codes, 0.5)
    np.testing.assert_array_equal(q.codes, [[-127, 5], [127, -127]])
    np.testing.assert_array_equal(q.scale, [0.5, 0.5])


def test_from_int8_with_int8_preset_is_not_requantised():
    """Codes that do not use the full +-127 range stay as given (no per-channel re-scaling)."""
    codes = np.array([[1, -3], [2, 0], [-1, 3]], np.int8)
    st = sc.program(spec=INT8, quantised=from_int8(codes, [0.25, 2.0]))
    np.testing.assert_array_equal(st.codes[:3, :2], codes)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_weights_rejected(bad):
    w = _w(10, 10)
    w[3, 4] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantise_weight(w, INT8)
    with pytest.raises(ValueError, match="NaN or Inf"):
        sc.program(w, INT8)


def test_wrong_shapes_and_dtypes_rejected():
    with pytest.raises(ValueError, match="2-D"):
        quantise_weight(np.ones(5, np.float32), INT8)
    with pytest.raises(ValueError, match="dtype int8"):
        from_int8(np.ones((3, 3), np.int16), 1.0)
    with pytest.raises(ValueError, match="dtype int8"):
        from_int8(np.ones((3, 3), np.float32), 1.0)
    with pytest.raises(ValueError, match="2-D"):
        from_int8(np.ones(3, np.int8), 1.0)
    for bad_scale in (0.0, -1.0, np.nan, [1.0, np.inf, 1.0]):
        with pytest.raises(ValueError, match="finite and positive"):
            from_int8(np.ones((3, 3), np.int8), bad_scale)


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_quantise_rows(bits):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 50)) * rng.uniform(0.01, 100, (6, 1))).astype(np.float32)
    x[4] = 0.0
    q, s = quantise_rows(x, bits)
    q, s = np.asarray(q), np.asarray(s)
    qmax = 2 ** (bits - 1) - 1
    assert s.shape == (6, 1)
    amax = np.abs(x).max(axis=1, keepdims=True)
    np.testing.assert_allclose(s[[0, 1, 2, 3, 5]], amax[[0, 1, 2, 3, 5]] / qmax, rtol=1e-6)
    assert s[4, 0] == 1.0 and np.all(q[4] == 0)  # all-zero row: scale 1
    assert np.all(q == np.round(q)) and np.abs(q).max() <= qmax
    assert np.all(np.abs(q).max(axis=1)[[0, 1, 2, 3, 5]] == qmax)  # each row uses its own full range
    assert np.all(np.abs(q * s - x) <= s * (0.5 + 1e-5))


def test_quantise_rows_leading_dims():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)
    q, s = quantise_rows(x, 8)
    assert q.shape == x.shape and s.shape == (2, 3, 1)
    q2, s2 = quantise_rows(x.reshape(6, 16), 8)
    np.testing.assert_array_equal(np.asarray(q).reshape(6, 16), np.asarray(q2))

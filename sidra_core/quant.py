"""INT8 quantisation: per-channel weight codes and dynamic per-row activations."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from .spec import ChipSpec

QMAX = 127  # signed INT8, symmetric: codes in [-127, 127]


@dataclass(frozen=True)
class QuantisedWeight:
    """INT8 codes of a K x N weight and the float value of one code per output column."""

    codes: np.ndarray  # int8, (K, N)
    scale: np.ndarray  # float32, (N,)

    def dequantise(self) -> np.ndarray:
        return self.codes.astype(np.float32) * self.scale[None, :]


def quantise_weight(w, spec: ChipSpec) -> QuantisedWeight:
    """Symmetric INT8 codes for a K x N weight (output channels are columns).

    `scale_j = percentile(|W[:, j]|, p) / 127` per channel (or one scale per
    tensor); values beyond the clipping percentile saturate at +-127.

    Args:
        w: The K x N float weight.
        spec: The chip, for its granularity and clipping percentile (`spec.quant`).

    Returns:
        The QuantisedWeight: int8 codes (K, N) and float32 scales (N,).

    Raises:
        ValueError: The weight is not 2-D, or holds NaN or Inf.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"a crossbar weight is 2-D (K x N), got shape {w.shape}")
    a = np.abs(w)
    per_channel = spec.quant.granularity == "per_channel"
    p = spec.quant.clip_percentile
    axis = 0 if per_channel else None
    ref = a.max(axis=axis) if p >= 100.0 else None
    # (a NaN or an infinity makes its column's largest |w| NaN or infinite)
    if not np.all(np.isfinite(a if ref is None else ref)):
        raise ValueError("weight contains NaN or Inf; it cannot be programmed into a crossbar")
    if ref is None:
        ref = np.percentile(a, p, axis=axis)
    ref = np.broadcast_to(np.asarray(ref, np.float32), (w.shape[1],))
    scale = np.where(ref > 0, ref / QMAX, 1.0).astype(np.float32)
    q = np.divide(w, scale[None, :], out=a)  # in |w|'s buffer, in w's memory order
    np.rint(q, out=q)
    np.clip(q, -QMAX, QMAX, out=q)
    codes = q.astype(np.int8)
    return QuantisedWeight(codes=codes, scale=scale)


def from_int8(codes, scale) -> QuantisedWeight:
    """Wrap existing INT8 codes and per-column (or scalar) scales, e.g. from a quantised model.

    Args:
        codes: int8 codes (K, N); -128 saturates to -127 (the differential pair is symmetric).
        scale: The float value of one code, per output column (N,) or one for all.

    Returns:
        The QuantisedWeight.

    Raises:
        ValueError: The codes are not 2-D int8, or a scale is not finite and positive.
    """
    codes = np.asarray(codes)
    if codes.dtype != np.int8:
        raise ValueError(f"INT8 codes must have dtype int8, got {codes.dtype}")
    if codes.ndim != 2:
        raise ValueError(f"INT8 codes are 2-D (K x N), got shape {codes.shape}")
    if np.any(codes == -128):
        # The differential pair is symmetric: -128 has no conductance pair; it saturates to -127.
        codes = np.maximum(codes, -QMAX).astype(np.int8)
    scale = np.broadcast_to(np.asarray(scale, np.float32), (codes.shape[1],)).copy()
    if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
        raise ValueError("INT8 scales must be finite and positive")
    return QuantisedWeight(codes=codes, scale=scale)


def quantise_rows(x, bits: int, axis: int = -1):
    """Dynamic per-row symmetric quantisation of activations (traceable).

    Args:
        x: The activations.
        bits: Signed code width: codes lie in +-(2^(bits-1) - 1).
        axis: The axis a row runs along (-2: per column of a matrix).

    Returns:
        (codes, scale): the integer-valued float codes and the per-row scale (kept dims), so that
        `codes * scale ~= x`; an all-zero row gets scale 1.
    """
    qmax = float(2 ** (bits - 1) - 1)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    return jnp.clip(jnp.round(x / scale), -qmax, qmax), scale

"""Counter-based random numbers for the hot paths.

`jax.random.normal` (threefry) is costly per sample on a CPU; the MVM
needs one fresh normal per row, tile and column on every read, which would
cost more than the matmul itself. A two-round integer hash of (seed, counter)
followed by the inverse normal CDF is cheaper and stateless, so a cell's
draw depends only on its identity (chip seed, cell id, pulse), not on how the
arrays were batched or compacted.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

_GOLDEN = 0x9E3779B9


def mix32(x):
    """lowbias32 integer hash (Wellons): a bijection on uint32 with good avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def seed32(*parts: int) -> int:
    """Fold Python integers (seed, stream, pulse, ...) into one uint32 seed, on the host."""
    h = 0x811C9DC5
    for p in parts:
        p = int(p) & 0xFFFFFFFFFFFFFFFF
        for shift in (0, 32):
            h = ((h ^ ((p >> shift) & 0xFFFFFFFF)) * 0x01000193) & 0xFFFFFFFF
            h ^= h >> 15
    return h


def bits(seed, counter):
    """Random uint32 for each counter value under `seed` (both uint32)."""
    seed = jnp.asarray(seed, jnp.uint32)
    c = jnp.asarray(counter, jnp.uint32)
    return mix32(mix32(c * jnp.uint32(_GOLDEN) ^ seed) + (seed ^ jnp.uint32(0x68E31DA4)))


def uniform(seed, counter):
    """Uniform in [0, 1) with 23 random bits."""
    b = bits(seed, counter)
    return lax.bitcast_convert_type((b >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0


def _log(x):
    """Natural log from the float's exponent and a degree-8 polynomial of its mantissa.

    Max abs error ~1e-6; cheaper than XLA:CPU's log, which dominated the MVM's noise cost.
    """
    b = lax.bitcast_convert_type(x, jnp.int32)
    e = ((b >> 23) & 0xFF) - 127
    t = lax.bitcast_convert_type((b & 0x007FFFFF) | 0x3F800000, jnp.float32) - 1.0  # mantissa - 1, [0, 1)
    p = jnp.float32(-0.0064535442)
    for c in (0.0360884937, -0.0953293897, 0.1676540711, -0.2407338084, 0.3317990258, -0.4998741238, 0.9999964239):
        p = c + p * t
    return e.astype(jnp.float32) * jnp.float32(0.6931471805599453) + p * t


def _erfinv(x):
    """Giles' single-precision erfinv (2010), with the log above."""
    w = -_log((1.0 - x) * (1.0 + x))
    w1 = w - 2.5
    p1 = jnp.float32(2.81022636e-08)
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        p1 = c + p1 * w1
    w2 = jnp.sqrt(w) - 3.0
    p2 = jnp.float32(-0.000200214257)
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        p2 = c + p2 * w2
    return jnp.where(w < 5.0, p1, p2) * x


def normal(seed, counter):
    """Standard normal by the inverse CDF of a uniform on the open interval (0, 1)."""
    b = bits(seed, counter)
    # 23-bit uniform centred in its bin, so never exactly 0 or 1 (|z| <= 5.3).
    u = ((b >> 9).astype(jnp.float32) + 0.5) * (2.0 / (1 << 23)) - 1.0
    return jnp.float32(1.4142135623730951) * _erfinv(u)


def normal_pair(seed, counter):
    """Two standard normals from one hash, 16 random bits each (|z| <= 4.4).

    For the programming model (pulse-to-pulse variation, verify reads), where
    a 1-in-65536 resolution of the distribution is far below what matters.
    """
    b = bits(seed, counter)
    scale = jnp.float32(2.0 / (1 << 16))
    u1 = ((b >> 16).astype(jnp.float32) + 0.5) * scale - 1.0
    u2 = ((b & jnp.uint32(0xFFFF)).astype(jnp.float32) + 0.5) * scale - 1.0
    root2 = jnp.float32(1.4142135623730951)
    return root2 * _erfinv(u1), root2 * _erfinv(u2)


# sin(pi t) and cos(pi t) for t in [-1/2, 1/2]: Taylor series in (pi t)^2, truncation error
# < 6e-8 at the ends (next terms a^13/13! and a^14/14! at a = pi/2).
_SIN = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(6))
_COS = tuple((-1) ** k / math.factorial(2 * k) for k in range(7))


def _series(a2, coeffs):
    p = jnp.float32(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = jnp.float32(c) + p * a2
    return p


def box_muller(seed, counter):
    """Two independent standard normals per counter by Box-Muller, for the read-noise hot path.

    One log and one square root serve two draws, and sine and cosine come from two short
    polynomials with the double-angle formulas: ~1/3 of the inverse-CDF transform's arithmetic
    per draw. The radius uses 23 hashed bits (|z| <= 5.77, as `normal`'s 5.3), the angle 23
    further bits from the hash re-mixed.
    """
    b = bits(seed, counter)
    u1 = ((b >> 9).astype(jnp.float32) + 0.5) * jnp.float32(1.0 / (1 << 23))  # (0, 1)
    r = jnp.sqrt(jnp.float32(-2.0) * _log(u1))
    # the angle 2 pi t, t uniform on [-1/2, 1/2); half of it, a = pi t, is within [-pi/2, pi/2]
    t = ((mix32(b ^ jnp.uint32(0x5BD1E995)) >> 9).astype(jnp.float32) + 0.5) * jnp.float32(1.0 / (1 << 23)) - 0.5
    a = jnp.float32(math.pi) * t
    a2 = a * a
    sin_a, cos_a = a * _series(a2, _SIN), _series(a2, _COS)
    return r * (cos_a * cos_a - sin_a * sin_a), r * (2.0 * sin_a * cos_a)

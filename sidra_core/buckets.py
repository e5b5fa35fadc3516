"""Shape buckets: the few sizes an eager op's kernel is compiled for.

XLA compiles a program per input shape, so an op called with every row count
a model meets (batch x sequence length) would compile at each new one. The
chip runs each op at the bucket above its row count instead: powers of two up
to 32, then steps of 1.5x and 4/3x (48, 64, 96, 128, 192, ...), at most 1.5x
the real work and two programs per doubling of the range. Padding is done in
host memory (a copy, no program) and padded rows are zeros that each kernel
treats row by row, so they never change the real rows (see crossbar.mvm's
noise counters); the chip prices the real rows only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import dlpack

_EXACT = 32  # every power of two up to here; past it, a half step between powers of two


def size(n: int) -> int:
    """The bucket (kernel size) for `n` rows: the smallest 2^k >= n up to 32, else 2^k or 1.5 x 2^k."""
    n = int(n)
    if n <= 1:
        return max(n, 0)
    p = 1 << (n - 1).bit_length()
    if p <= _EXACT:
        return p
    return p * 3 // 4 if n <= p * 3 // 4 else p


def xp(x):
    """The array module to reshape x with off the kernels: numpy for a concrete array (a host
    view or copy, no program), jax.numpy inside a trace (a dry run: abstract shapes compile nothing)."""
    return jnp if isinstance(x, jax.core.Tracer) else np


def pad(x, axes=(0,), shape=None) -> jax.Array:
    """x, reshaped to `shape` if given, with each of `axes` zero-padded to its bucket. The copy is
    made in host memory and handed to JAX by `put`: a jnp pad, reshape or even jnp.asarray would
    itself compile a program per shape."""
    m = xp(x)
    a = m.asarray(x)
    if shape is not None:
        a = a.reshape(shape)
    if m is jnp:
        return a
    target = list(a.shape)
    for ax in axes:
        target[ax] = size(target[ax])
    if tuple(target) == a.shape:
        return x if isinstance(x, jax.Array) and x.committed and x.shape == a.shape else put(a)
    out = np.zeros(target, a.dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return put(out)


def take(y, shape, out_shape=None) -> jax.Array:
    """The leading `shape` block of a padded result, reshaped to `out_shape` (host copies, as `pad`)."""
    if tuple(y.shape) == tuple(shape) and (out_shape is None or tuple(out_shape) == tuple(shape)):
        return y
    m = xp(y)
    a = m.asarray(y)[tuple(slice(0, s) for s in shape)]
    a = a if out_shape is None else a.reshape(out_shape)
    return a if m is jnp else put(a)


def put(a: np.ndarray) -> jax.Array:
    """A host array as a jax.Array through DLPack (a fresh writeable copy is shared, a view copied):
    committed to the CPU as the bridges' arrays are, since a kernel's compiled program is cached per
    argument placement too; faster than jax.device_put."""
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = np.array(a)
    return dlpack.to_jax(a)

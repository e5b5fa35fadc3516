"""Convolutions on the crossbar: im2col patches through the same MVM kernel.

A convolution weight (C_out, C_in / groups, *kernel) becomes one matrix of
shape (C_in * prod(kernel), C_out): block-diagonal over the groups, because
each group's output channels see only that group's input channels. The zero
blocks are cells at G_min, exactly as a naive group mapping would program them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import host
from .crossbar import Snapshot, mvm


def weight_matrix(w, groups: int = 1) -> np.ndarray:
    """(C_out, C_in/g, *k) conv weight -> (C_in * prod(k), C_out) crossbar matrix.

    Args:
        w: The convolution weight (C_out, C_in / groups, *kernel).
        groups: Channel groups; the matrix is block-diagonal over them.

    Returns:
        The float32 (C_in * prod(kernel), C_out) matrix.

    Raises:
        ValueError: `groups` does not divide the output channels.
    """
    w = np.asarray(w, np.float32)
    c_out, c_in_g = w.shape[:2]
    if groups < 1 or c_out % groups:
        raise ValueError(f"groups = {groups} must divide the {c_out} output channels")
    k = int(np.prod(w.shape[2:], dtype=np.int64))
    kg, ng = c_in_g * k, c_out // groups
    flat = w.reshape(groups, ng, kg)  # group, out-channel in group, (c_in, *kernel)
    m = np.zeros((groups, kg, groups, ng), np.float32)
    g = np.arange(groups)
    m[g, :, g, :] = flat.transpose(0, 2, 1)
    return m.reshape(groups * kg, c_out)


def _norm(v, nd: int, name: str) -> tuple[int, ...]:
    v = (v,) * nd if isinstance(v, int) else tuple(int(a) for a in v)
    if len(v) != nd:
        raise ValueError(f"{name} needs {nd} values for a {nd}-d convolution, got {v}")
    return v


@host.jit(static_argnames=("kernel", "stride", "padding", "dilation", "lhs_dilation", "dac_bits", "adc_bits"))
def conv(snap: Snapshot, x, seed=None, bias=None, *, kernel, stride, padding, dilation, lhs_dilation=None,
         dac_bits=8, adc_bits=8):
    """N-d convolution (x: (N, C_in, *spatial)) as crossbar MVMs over im2col patches.

    Args:
        snap: The snapshot of the weight's crossbar matrix (`conv_weight_matrix`).
        x: Inputs (N, C_in, *spatial).
        seed: The read's uint32 noise seed, as `mvm` takes it.
        bias: Added per output channel, as `mvm` takes it.
        kernel: The kernel's spatial shape.
        stride: Window strides, one per spatial axis.
        padding: A width per axis, or (low, high) pairs.
        dilation: Kernel dilation, one per spatial axis.
        lhs_dilation: Input dilation (JAX's transposed conv): the zeros between input positions
            are zero DAC inputs.
        dac_bits: DAC resolution; None: no DAC.
        adc_bits: ADC resolution.

    Returns:
        y (N, C_out, *out_spatial), float32.
    """
    patches = lax.conv_general_dilated_patches(
        x.astype(jnp.float32), filter_shape=kernel, window_strides=stride,
        padding=tuple(p if isinstance(p, tuple) else (p, p) for p in padding), lhs_dilation=lhs_dilation,
        rhs_dilation=dilation, precision=lax.Precision.HIGHEST,
    )  # (N, C_in * prod(kernel), *out)
    n, f = patches.shape[:2]
    out_sp = patches.shape[2:]
    rows = jnp.moveaxis(patches.reshape(n, f, -1), 1, 2)  # (N, positions, features)
    y = mvm(snap, rows, seed, bias, dac_bits=dac_bits, adc_bits=adc_bits)  # (N, positions, C_out)
    return jnp.moveaxis(y, 2, 1).reshape(n, -1, *out_sp)


def conv_args(w_shape, stride=1, padding=0, dilation=1) -> dict:
    """Normalise conv hyper-parameters for `conv` from the weight shape.

    Args:
        w_shape: The weight's shape (C_out, C_in / groups, *kernel), 1-, 2- or 3-d.
        stride: One int for every axis, or one per axis.
        padding: One int for every axis, or one per axis.
        dilation: One int for every axis, or one per axis.

    Returns:
        `conv`'s keyword arguments: kernel, stride, padding and dilation as tuples.

    Raises:
        ValueError: The weight is not 3-, 4- or 5-d, or a parameter has the wrong length.
    """
    nd = len(w_shape) - 2
    if nd not in (1, 2, 3):
        raise ValueError(f"convolution weight must be 3-, 4- or 5-d, got shape {tuple(w_shape)}")
    return {
        "kernel": tuple(int(k) for k in w_shape[2:]),
        "stride": _norm(stride, nd, "stride"),
        "padding": _norm(padding, nd, "padding"),
        "dilation": _norm(dilation, nd, "dilation"),
    }


def output_positions(x_shape, w_shape, stride=1, padding=0, dilation=1) -> int:
    """Number of output positions (MVM rows per image) of a convolution."""
    a = conv_args(w_shape, stride, padding, dilation)
    pos = 1
    for size, k, s, p, d in zip(x_shape[2:], a["kernel"], a["stride"], a["padding"], a["dilation"]):
        pos *= (size + 2 * p - d * (k - 1) - 1) // s + 1
    return pos

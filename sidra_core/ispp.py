"""ISPP write-verify programming, vectorised over cells (a loop over pulses only).

Cells are handled as flat arrays. A jitted kernel applies a chunk of pulses to
every still-active cell at once; between chunks the finished cells are
compacted away on the host, so the work is proportional to the pulses really
given, not to (cells x slowest cell). Every random draw is keyed by (seed, cell
id, pulse number), so results do not depend on the compaction.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import rng
from .spec import ChipSpec

_CHUNK = 4  # pulses per kernel call between compactions
_BLOCK = 1 << 17  # cells per kernel call
_POOL = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))


@dataclass(frozen=True)
class ISPPResult:
    """Final conductances (S) and pulses given per cell, in the order of the inputs."""

    g: np.ndarray  # float32
    pulses: np.ndarray  # int32

    @property
    def total_pulses(self) -> int:
        return int(self.pulses.sum(dtype=np.int64))


def _in_blocks(fn, arrays, fills, size=_BLOCK):
    """Apply a jitted kernel to flat arrays in fixed-size blocks (one compiled shape).

    XLA runs one elementwise fusion on one core; two blocks in flight use both.
    """
    n = arrays[0].size

    def run(lo):
        part = [a[lo:lo + size] for a in arrays]
        k = part[0].size
        if k < size:
            part = [np.concatenate([a, np.full(size - k, f, a.dtype)]) for a, f in zip(part, fills)]
        res = fn(*part)
        res = res if isinstance(res, tuple) else (res,)
        return [np.asarray(r)[:k] for r in res]

    outs = list(_POOL.map(run, range(0, n, size)))
    return [np.concatenate(cols) if len(cols) > 1 else cols[0] for cols in zip(*outs)]


@partial(jax.jit, static_argnames=("tol_u", "read_sigma", "g_min_u"))
def _first_verify(u, target, ids, seed, tol_u, read_sigma, g_min_u):
    # Most cells (the idle half of each pair, zero weights) pass the first verify with no pulse.
    g_read = u + (u + g_min_u) * read_sigma * rng.normal(rng.mix32(seed), ids)
    return jnp.abs(target - g_read) <= tol_u


@partial(jax.jit, static_argnames=("params",))
def _pulse_chunk(u, target, ramp_n, last_dir, pulses, done, stuck, ids, seed, params):
    tol_u, read_sigma, step0, ramp, c2c, max_pulses, g_min_u = params

    def body(_, st):
        u, ramp_n, last_dir, pulses, done = st
        # Verify read of the conductance in normalised units: read noise is relative to G.
        g_read = u + (u + g_min_u) * read_sigma * rng.normal(rng.mix32(seed + pulses.astype(jnp.uint32) * jnp.uint32(2654435761)), ids)
        err = target - g_read
        done = done | (jnp.abs(err) <= tol_u) | (pulses >= max_pulses)
        direction = jnp.where(err > 0, jnp.int8(1), jnp.int8(-1))
        ramp_n = jnp.where(direction == last_dir, ramp_n + 1, 0)
        c2c_draw = rng.normal(rng.mix32(seed ^ jnp.uint32(0x5BD1E995) + pulses.astype(jnp.uint32) * jnp.uint32(40503)), ids)
        step = step0 * (1.0 + ramp * ramp_n.astype(jnp.float32)) * jnp.maximum(1.0 + c2c * c2c_draw, 0.0)
        du = jnp.where(direction > 0, step * (1.0 - u), -step * u)
        active = ~done
        u = jnp.where(active & ~stuck, jnp.clip(u + du, 0.0, 1.0), u)
        pulses = pulses + active.astype(jnp.int32)
        last_dir = jnp.where(active, direction, last_dir)
        return u, ramp_n, last_dir, pulses, done

    # Unrolled: every pulse is elementwise, so XLA fuses the whole chunk into one loop over cells.
    state = (u, ramp_n, last_dir, pulses, done)
    for i in range(_CHUNK):
        state = body(i, state)
    return state


@partial(jax.jit, static_argnames=("relax",))
def _relax(u, g_min_u, ids, seed, relax):
    # Conductance relaxation right after the last verify: relative Gaussian jitter.
    return jnp.clip(u + (u + g_min_u) * relax * rng.normal(seed, ids), 0.0, 1.0)


def program_cells(g_start, g_target, stuck, cell_ids, spec: ChipSpec, seed: int) -> ISPPResult:
    """Write-verify every cell from `g_start` towards `g_target` (siemens, flat arrays).

    `stuck` cells never move (but are pulsed until they pass verify or hit
    `max_pulses`, as a real controller would). With ISPP disabled the targets
    are written exactly with one pulse per cell that changes.
    """
    g_start = np.asarray(g_start, np.float32)
    g_target = np.asarray(g_target, np.float32)
    stuck = np.asarray(stuck, bool)
    cell_ids = np.asarray(cell_ids, np.uint32)
    t, n = spec.tile, spec.ispp
    span = t.g_max - t.g_min
    if not n.enabled:
        g = np.where(stuck, g_start, g_target).astype(np.float32)
        return ISPPResult(g=g, pulses=(g_start != g_target).astype(np.int32))

    if g_start.size == 0:
        return ISPPResult(g=g_start.copy(), pulses=np.zeros(0, np.int32))
    u = (g_start - t.g_min) / span
    target = (g_target - t.g_min) / span
    m = u.size
    out_pulses = np.zeros(m, np.int32)
    params = (
        float(n.tolerance * t.g_max / span),
        float(spec.noise.read_sigma),
        float(n.step0),
        float(n.ramp),
        float(n.c2c_sigma),
        int(n.max_pulses),
        float(t.g_min / span),
    )
    seed_u = np.uint32(rng.seed32(seed, 0x15BB))
    g_min_u = float(t.g_min / span)
    (passed,) = _in_blocks(
        lambda a, b, i: _first_verify(a, b, i, seed_u, params[0], params[1], g_min_u),
        [u, target, cell_ids], [0, 0, 0], size=_BLOCK * 4)
    # Active set: indices into the flat arrays, with the per-cell loop state.
    idx = np.flatnonzero(~passed)
    ramp_n = np.zeros(idx.size, np.int32)
    last_dir = np.zeros(idx.size, np.int8)
    pulses = np.zeros(idx.size, np.int32)

    def chunk(u_, tgt, rn, ld, pl, dn, st, ids):
        return _pulse_chunk(u_, tgt, rn, ld, pl, dn, st, ids, seed_u, params)

    while idx.size:
        nu, nramp, ndir, npulses, ndone = _in_blocks(
            chunk, [u[idx], target[idx], ramp_n, last_dir, pulses, np.zeros(idx.size, bool), stuck[idx], cell_ids[idx]],
            [0, 0, 0, 0, 0, True, False, 0])
        u[idx] = nu
        out_pulses[idx] = npulses
        keep = ~ndone
        idx, ramp_n, last_dir, pulses = idx[keep], nramp[keep], ndir[keep], npulses[keep]
    moved = np.flatnonzero((out_pulses > 0) & ~stuck)
    if spec.noise.prog_relax_sigma > 0 and moved.size:
        relax_seed = np.uint32(rng.seed32(seed, 0x4E1A))
        (u[moved],) = _in_blocks(
            lambda a, i: _relax(a, g_min_u, i, relax_seed, float(spec.noise.prog_relax_sigma)),
            [u[moved], cell_ids[moved]], [0, 0])
    g = g_start.copy()
    touched = out_pulses > 0
    g[touched] = (t.g_min + u[touched] * span).astype(np.float32)
    return ISPPResult(g=g, pulses=out_pulses)

"""ISPP write-verify programming, vectorised over cells (a loop over pulses only).

Cells are handled as flat arrays. A jitted kernel applies a chunk of pulses to
every still-active cell at once; between chunks the finished cells are
compacted away on the host, so the work is proportional to the pulses really
given, not to (cells x slowest cell). Every random draw is keyed by (seed, cell
id, pulse number), so results do not depend on the compaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import rng
from .blocks import BLOCK, map_blocks
from .spec import ChipSpec

_CHUNK = 6  # pulses per kernel call between compactions


@dataclass(frozen=True)
class ISPPResult:
    """Final conductances (S) and pulses given per cell, in the order of the inputs."""

    g: np.ndarray  # float32
    pulses: np.ndarray  # int32

    @property
    def total_pulses(self) -> int:
        return int(self.pulses.sum(dtype=np.int64))


@partial(jax.jit, static_argnames=("tol_u", "read_sigma", "g_min_u"))
def _first_verify(u, target, ids, seed, tol_u, read_sigma, g_min_u):
    # Most cells (the idle half of each pair, zero weights) pass the first verify with no pulse.
    g_read = u + (u + g_min_u) * read_sigma * rng.normal(rng.mix32(seed), ids)
    return jnp.abs(target - g_read) <= tol_u


@partial(jax.jit, static_argnames=("params",))
def _pulse_chunk(u, target, ramp_n, last_dir, pulses, done, ids, seed, params):
    tol_u, read_sigma, step0, ramp, c2c, max_pulses, g_min_u = params

    def body(_, st):
        u, ramp_n, last_dir, pulses, done = st
        # One hash per cell and pulse gives the verify-read noise and the pulse's variation.
        read_draw, c2c_draw = rng.normal_pair(seed + pulses.astype(jnp.uint32) * jnp.uint32(2654435761), ids)
        # Verify read of the conductance in normalised units: read noise is relative to G.
        g_read = u + (u + g_min_u) * read_sigma * read_draw
        err = target - g_read
        done = done | (jnp.abs(err) <= tol_u) | (pulses >= max_pulses)
        direction = jnp.where(err > 0, jnp.int8(1), jnp.int8(-1))
        ramp_n = jnp.where(direction == last_dir, ramp_n + 1, 0)
        step = step0 * (1.0 + ramp * ramp_n.astype(jnp.float32)) * jnp.maximum(1.0 + c2c * c2c_draw, 0.0)
        du = jnp.where(direction > 0, step * (1.0 - u), -step * u)
        active = ~done
        u = jnp.where(active, jnp.clip(u + du, 0.0, 1.0), u)
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

    `stuck` cells never move: one that fails its first verify is pulsed
    `max_pulses` times (a controller gives up only then), without simulating
    each pulse. With ISPP disabled the targets
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
    # The first verify read: a cell whose distance to its target is below the window by
    # more than 8 read-noise sigmas passes with certainty (p < 1e-15), so only the others
    # are read here (most of the idle halves of the pairs sit exactly on target).
    gap = np.abs(target - u)
    unsure = np.flatnonzero(gap > params[0] - 8 * params[1] * (np.maximum(u, target) + g_min_u))
    (passed,) = map_blocks(
        lambda a, b, i: _first_verify(a, b, i, seed_u, params[0], params[1], g_min_u),
        [u[unsure], target[unsure], cell_ids[unsure]], [0, 0, 0], size=BLOCK * 4)
    failed = unsure[~passed]
    # A stuck cell never moves, so write-verify pulses it until it gives up.
    give_up = failed[stuck[failed]]
    out_pulses[give_up] = n.max_pulses
    # Active set: indices into the flat arrays and the cells' own compacted state (contiguous:
    # each round compacts these small arrays instead of gathering from the full ones), written
    # back once a cell is done.
    idx = failed[~stuck[failed]]
    state = [u[idx], target[idx], np.zeros(idx.size, np.int32), np.zeros(idx.size, np.int8),
             np.zeros(idx.size, np.int32), cell_ids[idx]]  # u, target, ramp_n, last_dir, pulses, ids

    def chunk(u_, tgt, rn, ld, pl, dn, ids):
        return _pulse_chunk(u_, tgt, rn, ld, pl, dn, ids, seed_u, params)

    while idx.size:
        u_a, tgt, ramp_n, last_dir, pulses, ids = state
        nu, nramp, ndir, npulses, ndone = map_blocks(
            chunk, [u_a, tgt, ramp_n, last_dir, pulses, np.zeros(idx.size, bool), ids], [0, 0, 0, 0, 0, True, 0])
        fin = idx[ndone]
        u[fin] = nu[ndone]
        out_pulses[fin] = npulses[ndone]
        keep = ~ndone
        idx = idx[keep]
        state = [nu[keep], tgt[keep], nramp[keep], ndir[keep], npulses[keep], ids[keep]]
    moved = np.flatnonzero((out_pulses > 0) & ~stuck)
    if spec.noise.prog_relax_sigma > 0 and moved.size:
        relax_seed = np.uint32(rng.seed32(seed, 0x4E1A))
        (u[moved],) = map_blocks(
            lambda a, i: _relax(a, g_min_u, i, relax_seed, float(spec.noise.prog_relax_sigma)),
            [u[moved], cell_ids[moved]], [0, 0])
    g = g_start.copy()
    touched = out_pulses > 0
    g[touched] = (t.g_min + u[touched] * span).astype(np.float32)
    return ISPPResult(g=g, pulses=out_pulses)

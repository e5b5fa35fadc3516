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

from . import host, rng, vnni
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


# The per-cell write-verify state between chunks, packed into one int32 (fewer arrays to compact):
# pulses given (11 bits; max_pulses <= 1000), the ramp step (11 bits), the last direction + 1 (2 bits).
_PULSE_BITS, _RAMP_SHIFT, _DIR_SHIFT = 0x7FF, 11, 22


@partial(jax.jit, static_argnames=("params",))
def _first_verify(g0, g1, ids, seed, params):
    """Cells that fail the first verify read (most cells, the idle half of each pair and zero
    weights, pass it with no pulse); inputs in siemens."""
    tol_u, read_sigma, g_min_u, g_min, span = params
    u, target = (g0 - g_min) / span, (g1 - g_min) / span
    g_read = u + (u + g_min_u) * read_sigma * rng.normal(rng.mix32(seed), ids)
    return jnp.abs(target - g_read) > tol_u


@host.jit(static_argnames=("params",))
def _pulse_chunk(u, target, packed, ids, seed, relax_seed, params):
    """_CHUNK write-verify steps of every cell; returns (u, packed state, done, final G in siemens)."""
    tol_u, read_sigma, step0, ramp, c2c, max_pulses, g_min_u, relax, g_min, span = params
    pulses = packed & _PULSE_BITS
    ramp_n = (packed >> _RAMP_SHIFT) & _PULSE_BITS
    last_dir = (packed >> _DIR_SHIFT) - 1
    done = jnp.zeros(u.shape, bool)
    # One hash per cell and pulse gives the verify-read noise and the pulse's variation. A cell
    # still active at step i is at pulse `pulses + i` (a done cell stays done and its draws go
    # unused), so the chunk's draws are made up front, behind a barrier: otherwise XLA recomputes
    # them inside each of the step's several output fusions.
    draws = jax.lax.optimization_barrier([
        rng.normal_pair(seed + (pulses + i).astype(jnp.uint32) * jnp.uint32(2654435761), ids) for i in range(_CHUNK)])
    for read_draw, c2c_draw in draws:  # unrolled: every pulse is element-wise
        # Verify read of the conductance in normalised units: read noise is relative to G.
        g_read = u + (u + g_min_u) * read_sigma * read_draw
        err = target - g_read
        done = done | (jnp.abs(err) <= tol_u) | (pulses >= max_pulses)
        active = ~done
        direction = jnp.where(err > 0, 1, -1)
        ramp_n = jnp.where(active, jnp.where(direction == last_dir, ramp_n + 1, 0), ramp_n)
        step = step0 * (1.0 + ramp * ramp_n.astype(jnp.float32)) * jnp.maximum(1.0 + c2c * c2c_draw, 0.0)
        du = jnp.where(direction > 0, step * (1.0 - u), -step * u)
        u = jnp.where(active, jnp.clip(u + du, 0.0, 1.0), u)
        pulses = pulses + active.astype(jnp.int32)
        last_dir = jnp.where(active, direction, last_dir)
    # Conductance relaxation right after the last verify: relative Gaussian jitter (kept for the
    # cells that finish here; the others' values are discarded).
    settled = u if relax == 0 else jnp.clip(u + (u + g_min_u) * relax * rng.normal(relax_seed, ids), 0.0, 1.0)
    packed = pulses | (ramp_n << _RAMP_SHIFT) | ((last_dir + 1) << _DIR_SHIFT)
    return u, packed, done, g_min + settled * span


def seeds(seed: int) -> tuple[np.uint32, np.uint32]:
    """The write-verify draws' seed and the relaxation's, from a plane's programming seed."""
    return np.uint32(rng.seed32(seed, 0x15BB)), np.uint32(rng.seed32(seed, 0x4E1A))


def pulse_params(spec: ChipSpec) -> tuple:
    """_pulse_chunk's parameters: tol_u, read_sigma, step0, ramp, c2c, max_pulses, g_min_u, relax,
    g_min, span (normalised units: u = (G - g_min) / span)."""
    t, n = spec.tile, spec.ispp
    span = t.g_max - t.g_min
    return (float(n.tolerance * t.g_max / span), float(spec.noise.read_sigma), float(n.step0), float(n.ramp),
            float(n.c2c_sigma), int(n.max_pulses), float(t.g_min / span), float(spec.noise.prog_relax_sigma),
            float(t.g_min), float(span))


def program_cells(g_start, g_target, stuck, cell_ids, spec: ChipSpec, seed: int) -> ISPPResult:
    """Write-verify every cell from `g_start` towards `g_target` (siemens, flat arrays).

    `stuck` cells never move: one that fails its first verify is pulsed
    `max_pulses` times (a controller gives up only then), without simulating
    each pulse. With ISPP disabled the targets
    are written exactly with one pulse per cell that changes.

    Args:
        g_start: Each cell's present conductance (S).
        g_target: Each cell's target conductance (S).
        stuck: Each cell is stuck (bool).
        cell_ids: Each cell's physical id (uint32), which keys its draws.
        spec: The chip, for its ISPP, tile and noise parameters.
        seed: The write's seed.

    Returns:
        The ISPPResult: final conductances and pulses per cell, in the inputs' order.
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
    seed_u, relax_seed = seeds(seed)
    params = pulse_params(spec)
    tol_u, read_sigma, _, _, _, _, g_min_u, _, _, _ = params
    if host.native_ispp():  # each cell to its end at once: no chunks, no compaction
        g, pulses = vnni.ispp_write(g_start, g_target, stuck, cell_ids, seed_u, relax_seed, params)
        return ISPPResult(g=g, pulses=pulses)

    g = g_start.copy()
    out_pulses = np.zeros(g.size, np.int32)
    verify = (tol_u, read_sigma, g_min_u, float(t.g_min), float(span))
    (failed,) = map_blocks(lambda a, b, i: _first_verify(a, b, i, seed_u, verify),
                           [g_start, g_target, cell_ids], [0, 0, 0], size=BLOCK * 4)
    failed = np.flatnonzero(failed)
    # A stuck cell never moves, so write-verify pulses it until it gives up.
    out_pulses[failed[stuck[failed]]] = n.max_pulses
    # The active cells: their indices and their own compacted state (contiguous: each round
    # compacts these small arrays instead of gathering from the full ones); a cell's final G
    # and pulse count are written back once it is done.
    idx = failed[~stuck[failed]]
    u = (g_start[idx] - np.float32(t.g_min)) / np.float32(span)
    target = (g_target[idx] - np.float32(t.g_min)) / np.float32(span)
    packed = np.full(idx.size, 1 << _DIR_SHIFT, np.int32)  # no pulse, no ramp, no direction yet
    ids = cell_ids[idx]

    def chunk(u_, tgt, pk, i):
        return _pulse_chunk(u_, tgt, pk, i, seed_u, relax_seed, params)

    while idx.size:
        u, packed, done, g_end = map_blocks(chunk, [u, target, packed, ids], [0, 0, 1 << _DIR_SHIFT, 0])
        fin = np.flatnonzero(done)
        pulses = packed[fin] & _PULSE_BITS
        moved = pulses > 0  # a cell that passed before its first pulse keeps its G exactly
        out_pulses[idx[fin]] = pulses
        g[idx[fin[moved]]] = g_end[fin[moved]]
        keep = np.flatnonzero(~done)
        idx, u, target, packed, ids = idx[keep], u[keep], target[keep], packed[keep], ids[keep]
    return ISPPResult(g=g, pulses=out_pulses)

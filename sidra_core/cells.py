"""How a programmed weight's cells are held on the host: what the physics needs, and no more.

Per cell pair a programmed weight stores its target code, one byte per cell for its conductance and
one bit per cell saying whether it drifts; everything else is sparse, per tile or derived:
- conductances (INT8 codes) on a grid of levels of dG / 512 above G_min (every code's target a
  level), each held as an int8 offset from its code's target in steps of 2^shift levels
  (`Residuals`), a step of at most 1/32 of the write-verify window (1/32 code on y1, against a
  programming error of about a code), so the programmed weight error keeps its statistics; the few
  cells an offset cannot hold (stuck at a rail, a stuck cell's partner, a cell that failed verify)
  keep their exact 16-bit level; float weights (the ideal chip) stay float32, exact;
- drift exponents are drawn again from the programming's counter-based stream (crossbar._nu) for
  the cells whose bit is set (written by the programming and not stuck); stuck maps from the
  chip's stream (crossbar._stuck), when a write or a caller needs them;
- write counts per tile (the most pulses a cell of the tile took, a bound on each of its cells)
  and one programming time;
- the cells rewritten since programming (fine-tuning) keep their own time, count and exponent
  (`Rewrites`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import dlpack
from .mapping import TileGrid

LEVELS_PER_CODE = 512  # conductance levels per INT8 code step dG
STEPS_PER_WINDOW = 32  # a residual's step is at most this fraction of the verify window
EXCEPTION = -128  # the residual of a cell whose level is held exactly (Residuals.idx)
MAX_SHIFT = 9  # a residual step of at most one code


@dataclass(frozen=True)
class Residuals:
    """One plane's conductances as int8 offsets from its codes' target levels, and the cells an
    offset cannot hold at their exact levels.

    Attributes:
        r: int8 (Kp, Np): round((level - target level) / 2^shift), EXCEPTION where `idx` holds the cell.
        idx: Flat indices of the exceptions into the padded plane, sorted (int64).
        level: Their 16-bit levels (uint16).
    """

    r: np.ndarray
    idx: np.ndarray
    level: np.ndarray

    @property
    def host_bytes(self) -> int:
        return int(self.r.nbytes + self.idx.nbytes + self.level.nbytes)


@dataclass(frozen=True)
class Levels:
    """The conductance grid of a quantised chip: G = g_min + level x step (float32 siemens), a
    level held as its code's target plus an offset of whole 2^shift levels (`Residuals`).

    Attributes:
        g_min: The lowest conductance (S), level 0.
        step: dG / LEVELS_PER_CODE (S), a power of two below dG: a code's target is a level.
        shift: log2 of a residual's step in levels.
    """

    g_min: np.float32
    step: np.float32
    shift: int = 0

    @classmethod
    def of(cls, g_min: float, dg: float, window: float = 0.0) -> "Levels":
        """The grid of codes dG apart from g_min, with residual steps of at most 1/STEPS_PER_WINDOW
        of a write-verify window of +-`window` siemens (0: steps of one level)."""
        step = np.float32(np.float32(dg) / np.float32(LEVELS_PER_CODE))
        per_step = window / float(step) / STEPS_PER_WINDOW
        shift = min(max(math.floor(math.log2(per_step)), 0), MAX_SHIFT) if per_step >= 1 else 0
        return cls(np.float32(g_min), step, shift)

    @property
    def top(self) -> int:
        return 127 * LEVELS_PER_CODE

    def encode(self, g: np.ndarray) -> np.ndarray:
        """uint16 levels of float32 conductances in [g_min, g_max] (rounded to the nearest level)."""
        q = np.subtract(g, self.g_min, dtype=np.float32)
        q /= self.step
        np.rint(q, out=q)
        np.clip(q, 0, self.top, out=q)
        return q.astype(np.uint16)

    def decode(self, q: np.ndarray) -> np.ndarray:
        """float32 conductances of uint16 levels: g_min + q step, as a code's target is computed
        (crossbar._conductance_pair: c dG + g_min), so a level holding a code gives its bits."""
        g = dlpack.empty(q.shape, np.float32)  # aligned: a read hands it to XLA without a copy
        g[...] = q
        g *= self.step
        g += self.g_min
        return g

    @staticmethod
    def targets(codes: np.ndarray, plane: int) -> np.ndarray:
        """uint16 target levels of a plane's cells: max(+-code, 0) x LEVELS_PER_CODE."""
        t = np.maximum(codes if plane == 0 else np.negative(codes), 0).astype(np.uint16)
        t *= LEVELS_PER_CODE
        return t

    def residuals(self, q: np.ndarray, codes: np.ndarray, plane: int) -> np.ndarray:
        """int8 residuals of uint16 levels against a plane's targets: (q - t) / 2^shift to the nearest
        integer, halves to even (unbiased), EXCEPTION outside +-127 (as the native programming
        writes them)."""
        d = q.astype(np.int32)
        d -= self.targets(codes, plane)
        r = d >> self.shift
        if self.shift:
            half = 1 << (self.shift - 1)
            d &= (1 << self.shift) - 1  # the remainder below the step
            r += (d > half) | ((d == half) & (r & 1 == 1))
        r[(r < -127) | (r > 127)] = EXCEPTION
        return r.astype(np.int8)

    def held(self, q: np.ndarray, r: np.ndarray) -> Residuals:
        """Residuals of a plane from its levels `q` and their int8 residuals `r` (`residuals`)."""
        idx = np.flatnonzero(r == EXCEPTION)
        return Residuals(r, idx, q.ravel()[idx])

    def compress(self, q: np.ndarray, codes: np.ndarray, plane: int) -> Residuals:
        """A plane's uint16 levels as Residuals against its codes' targets."""
        return self.held(q, self.residuals(q, codes, plane))

    def expand(self, res: Residuals, codes: np.ndarray, plane: int) -> np.ndarray:
        """The uint16 levels a plane's Residuals hold (an offset's target + r 2^shift stays within
        [0, top]: both are multiples of the step, within half a step of a level in range)."""
        q = self.targets(codes, plane)
        d = res.r.astype(np.int16)
        d <<= self.shift
        q += d.view(np.uint16)  # (modulo 2^16: a negative offset subtracts)
        q.ravel()[res.idx] = res.level
        return q


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """One bit per cell (row-major), for a per-cell flag held at 1/8 byte."""
    return np.packbits(mask.ravel())


def unpack_bits(bits: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The bool per cell of `pack_bits`."""
    return np.unpackbits(bits, count=shape[0] * shape[1]).reshape(shape).view(bool)


def tile_max(a: np.ndarray, grid: TileGrid) -> np.ndarray:
    """The largest value of each tile of a padded (Kp, Np) plane: (grid_k, grid_n)."""
    return a.reshape(grid.grid_k, grid.rows, grid.grid_n, grid.cols).max(axis=(1, 3))


def per_cell(tiles: np.ndarray, grid: TileGrid) -> np.ndarray:
    """A per-tile (grid_k, grid_n) value on every cell of the padded plane (a new array)."""
    return np.repeat(np.repeat(tiles, grid.rows, axis=0), grid.cols, axis=1)


def tile_of(idx: np.ndarray, grid: TileGrid) -> tuple[np.ndarray, np.ndarray]:
    """The (tile row, tile column) of flat cell indices of the padded plane."""
    r, c = np.divmod(idx, grid.n_padded)
    return r // grid.rows, c // grid.cols


@dataclass(frozen=True)
class Rewrites:
    """The cells of one plane written again after the weight was programmed (incremental
    reprogramming), with what their write changed: a cell's own programming time, write count
    (over its life) and drift exponent. Fine-tuning touches few cells, so they are kept sparse.

    Attributes:
        idx: Flat indices into the padded plane, sorted, unique (int64).
        t_prog: Device time of each one's last write (float32).
        writes: Its writes over its life (int32).
        nu: Its drift exponent since (float32; 0: stuck, or no drift).
    """

    idx: np.ndarray
    t_prog: np.ndarray
    writes: np.ndarray
    nu: np.ndarray

    @classmethod
    def none(cls) -> "Rewrites":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, np.float32))

    def __len__(self) -> int:
        return int(self.idx.size)

    @property
    def host_bytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.idx, self.t_prog, self.writes, self.nu))

    def merged(self, idx: np.ndarray, t_prog: float, writes: np.ndarray, nu: np.ndarray) -> "Rewrites":
        """These rewrites and cells `idx` (sorted, unique) written now: a cell written again keeps only
        its newest record."""
        keep = ~np.isin(self.idx, idx, assume_unique=True)
        all_idx = np.concatenate([self.idx[keep], idx.astype(np.int64)])
        order = np.argsort(all_idx, kind="stable")
        times = np.concatenate([self.t_prog[keep], np.full(idx.size, t_prog, np.float32)])
        return Rewrites(all_idx[order], times[order],
                        np.concatenate([self.writes[keep], writes.astype(np.int32)])[order],
                        np.concatenate([self.nu[keep], nu.astype(np.float32)])[order])

"""How a programmed weight's cells are held on the host: what the physics needs, and no more.

Per cell pair a programmed weight stores its target code, both conductances in 16 bits and one bit
per cell saying whether it drifts; everything else is per tile or derived:
- conductances (INT8 codes) as uint16 levels of dG / 512 above G_min: a written G lies in
  [G_min, G_max] (127 codes x 512 = 65,024 levels), every code's target is a level exactly, and a
  programmed G is held to 1/1024 of a code, finer than a read snapshot's 1/254; float weights (the
  ideal chip) stay float32, exact;
- drift exponents are drawn again from the programming's counter-based stream (crossbar._nu) for
  the cells whose bit is set (written by the programming and not stuck); stuck maps from the
  chip's stream (crossbar._stuck), when a write or a caller needs them;
- write counts per tile (the most pulses a cell of the tile took, a bound on each of its cells)
  and one programming time;
- the cells rewritten since programming (fine-tuning) keep their own time, count and exponent
  (`Rewrites`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import dlpack
from .mapping import TileGrid

LEVELS_PER_CODE = 512  # conductance levels per INT8 code step dG


@dataclass(frozen=True)
class Levels:
    """The 16-bit conductance grid of a quantised chip: G = g_min + level x step (float32 siemens).

    Attributes:
        g_min: The lowest conductance (S), level 0.
        step: dG / LEVELS_PER_CODE (S), a power of two below dG: a code's target is a level.
    """

    g_min: np.float32
    step: np.float32

    @classmethod
    def of(cls, g_min: float, dg: float) -> "Levels":
        return cls(np.float32(g_min), np.float32(np.float32(dg) / np.float32(LEVELS_PER_CODE)))

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

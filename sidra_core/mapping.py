"""Tile mapping: how a K x N weight lands on a grid of crossbar tiles and chips."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .spec import ChipSpec


class ChipCapacityError(RuntimeError):
    """A model needs more crossbar tiles than the chip (or system) has.

    Args:
        message: The tiles needed, in use and free, and the setting that fixes it (`capacity_error`).
    """


@dataclass(frozen=True)
class TileGrid:
    """The tile grid of one K x N weight: `grid_k` x `grid_n` tiles of rows x cols cells.

    Attributes:
        k: The weight's rows (input features).
        n: The weight's columns (output features).
        rows: Word lines per tile.
        cols: Bit lines per tile.
    """

    k: int
    n: int
    rows: int
    cols: int

    @property
    def grid_k(self) -> int:
        return math.ceil(self.k / self.rows)

    @property
    def grid_n(self) -> int:
        return math.ceil(self.n / self.cols)

    @property
    def tiles(self) -> int:
        return self.grid_k * self.grid_n

    @property
    def k_padded(self) -> int:
        return self.grid_k * self.rows

    @property
    def n_padded(self) -> int:
        return self.grid_n * self.cols

    @property
    def cells(self) -> int:
        return self.tiles * self.rows * self.cols

    @property
    def used_cells(self) -> int:
        return self.k * self.n

    @property
    def waste(self) -> float:
        """Fraction of the allocated cells left unused by padding."""
        return 1.0 - self.used_cells / self.cells


def tile_grid(k: int, n: int, spec: ChipSpec) -> TileGrid:
    """The tile grid of a K x N weight on this chip's tiles.

    Args:
        k: The weight's rows (input features), at least 1.
        n: The weight's columns (output features), at least 1.
        spec: The chip, for its tile shape.

    Returns:
        The weight's TileGrid.

    Raises:
        ValueError: K or N is below 1.
    """
    if k < 1 or n < 1:
        raise ValueError(f"a crossbar weight needs K >= 1 and N >= 1, got {k} x {n}")
    return TileGrid(k=k, n=n, rows=spec.tile.rows, cols=spec.tile.cols)


@dataclass(frozen=True)
class ChipMapping:
    """Placement of a set of weights: first tile index of each, totals, chips needed.

    Attributes:
        names: Each weight's name.
        grids: Each weight's tile grid.
        first_tile: Each weight's first tile index in the system.
        tiles_per_chip: Tiles on one chip (to tell which chip a tile is on).
    """

    names: tuple[str, ...]
    grids: tuple[TileGrid, ...]
    first_tile: tuple[int, ...]
    tiles_per_chip: int

    @property
    def tiles(self) -> int:
        return sum(g.tiles for g in self.grids)

    @property
    def chips(self) -> int:
        """Chips the placement touches (it may start part-way into the system)."""
        if not self.grids:
            return 0
        first_chip = self.first_tile[0] // self.tiles_per_chip
        last_chip = (self.first_tile[-1] + self.grids[-1].tiles - 1) // self.tiles_per_chip
        return last_chip - first_chip + 1

    @property
    def utilisation(self) -> float:
        """Used cells over allocated cells across all weights."""
        cells = sum(g.cells for g in self.grids)
        return sum(g.used_cells for g in self.grids) / cells if cells else 0.0

    def table(self) -> list[dict]:
        return [
            {
                "name": name,
                "shape": (g.k, g.n),
                "tiles": g.tiles,
                "grid": (g.grid_k, g.grid_n),
                "first_tile": first,
                "chip": first // self.tiles_per_chip,
                "waste": g.waste,
            }
            for name, g, first in zip(self.names, self.grids, self.first_tile)
        ]


def map_weights(
    shapes: Sequence[tuple[int, int]] | Iterable[tuple[str, tuple[int, int]]],
    spec: ChipSpec,
    *,
    tiles_in_use: int = 0,
) -> ChipMapping:
    """Place weights (named or not) on consecutive tiles after `tiles_in_use`.

    Args:
        shapes: (K, N) shapes, or (name, (K, N)) pairs; unnamed weights are called w0, w1, ...
        spec: The chip.
        tiles_in_use: Tiles already taken; the placement starts after them.

    Returns:
        The ChipMapping of the weights, in the order given.

    Raises:
        ChipCapacityError: The system is too small (or needs several chips and multi-chip mapping
            is not allowed); the message names the tiles needed and available.
    """
    items = list(shapes)
    if items and isinstance(items[0][0], str):
        names, dims = zip(*items) if items else ((), ())
    else:
        names, dims = tuple(f"w{i}" for i in range(len(items))), tuple(items)
    grids = tuple(tile_grid(int(k), int(n), spec) for k, n in dims)
    firsts, cursor = [], tiles_in_use
    for g in grids:
        firsts.append(cursor)
        cursor += g.tiles
    if cursor > system_tiles(spec):
        raise capacity_error("model", cursor - tiles_in_use, tiles_in_use, spec)
    return ChipMapping(names=tuple(names), grids=grids, first_tile=tuple(firsts), tiles_per_chip=spec.tile.tiles_per_chip)


def chips_needed(shapes: Sequence[tuple[int, int]], spec: ChipSpec) -> int:
    """Chips a set of K x N weights occupies (no capacity check).

    Args:
        shapes: The weights' (K, N) shapes.
        spec: The chip, for its tile shape and tiles per chip.

    Returns:
        The number of chips, at least 1.
    """
    tiles = sum(tile_grid(k, n, spec).tiles for k, n in shapes)
    return max(1, math.ceil(tiles / spec.tile.tiles_per_chip))


def system_tiles(spec: ChipSpec) -> int:
    """Tiles the whole system offers (all chips when multi-chip mapping is allowed).

    Args:
        spec: The chip.

    Returns:
        The number of tiles.
    """
    t = spec.tile
    return t.tiles_per_chip * (t.chips if t.allow_multi_chip else 1)


def capacity_error(what: str, need: int, in_use: int, spec: ChipSpec) -> ChipCapacityError:
    """The out-of-tiles error: tiles needed, in use and available, and the setting that fixes it.

    Args:
        what: What needs the tiles, as the message names it (a weight's name, "model").
        need: Tiles needed.
        in_use: Tiles already in use.
        spec: The chip.

    Returns:
        The ChipCapacityError to raise.
    """
    t = spec.tile
    total = system_tiles(spec)
    chips = math.ceil((in_use + need) / t.tiles_per_chip)
    hint = (f"use a system of tile__chips={chips} or more" if t.allow_multi_chip
            else f"set tile__allow_multi_chip=True and tile__chips={chips}")
    return ChipCapacityError(
        f"{what} needs {need} crossbar tiles but only {total - in_use} of the {total} are free "
        f"({total // t.tiles_per_chip} chip(s) x {t.tiles_per_chip} tiles of {t.rows}x{t.cols}, "
        f"{in_use} in use); {hint}"
    )

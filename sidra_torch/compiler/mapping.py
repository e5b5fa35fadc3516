"""The static crossbar mapping of a compiled graph: which weights it puts on tiles, how many tiles
each needs and how full they are, and whether they fit on the chip."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightMapping:
    name: str
    k: int
    n: int
    tiles: int
    utilisation: float  # cells holding weights / cells of its tiles


@dataclass(frozen=True)
class MappingReport:
    """Which crossbar weights the graph uses, the tiles each needs, and whether they fit."""

    weights: tuple[WeightMapping, ...]
    tiles_total: int
    tiles_free: int
    cells_per_tile: int = 256 * 256

    @property
    def tiles_used(self) -> int:
        return sum(w.tiles for w in self.weights)

    @property
    def utilisation(self) -> float:
        cells = sum(w.k * w.n for w in self.weights)
        return cells / max(self.tiles_used, 1) / self.cells_per_tile if self.weights else 0.0

    @property
    def fits(self) -> bool:
        return self.tiles_used <= self.tiles_free

    def table(self) -> str:
        lines = [f"{'weight':<48}{'K x N':>14}{'tiles':>7}{'util':>7}"]
        for w in self.weights:
            lines.append(f"{w.name[:47]:<48}{f'{w.k} x {w.n}':>14}{w.tiles:>7}{w.utilisation:>7.1%}")
        lines.append(f"{len(self.weights)} crossbar weights on {self.tiles_used} tiles "
                     f"({self.utilisation:.1%} of their cells used); {self.tiles_free} of {self.tiles_total} "
                     f"tiles free: {'fits' if self.fits else 'does NOT fit'} on this chip")
        return "\n".join(lines)

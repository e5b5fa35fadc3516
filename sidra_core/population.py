"""A population of chips: N instances of one spec with independent seeds, evaluated together.

A production lot is N chips of one design: each has its own bad cells (its spec's chip seed) and
its own programming, drift and read noise (its run seed). `Population.create` derives both seeds of
chip i from the population's seed, so chip i of a population is one fixed chip, whichever
population size or chunk it is evaluated in. sidra_jax runs a function on every chip of a
population in one program (`SidraFunction.population`); sidra_torch runs a model on each
(`sidra_torch.population`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import crossbar, host, rng
from .device import Chip, HostMemoryError, _binary
from .mapping import tile_grid
from .spec import ChipSpec, resolve

_CHIP_STREAM, _RUN_STREAM = 0xC41B, 0x5EED  # the two seeds' streams


def chip_seeds(seed: int, i: int) -> tuple[int, int]:
    """(spec seed in [0, 2^63), run seed in [0, 2^32)) of chip `i` of a population seeded `seed`."""
    hi, lo = rng.seed32(seed, _CHIP_STREAM, i, 0), rng.seed32(seed, _CHIP_STREAM, i, 1)
    return ((hi & 0x7FFFFFFF) << 32) | lo, rng.seed32(seed, _RUN_STREAM, i)


@dataclass(frozen=True)
class Population:
    """N chips of one spec, which differ only in their seeds.

    Attributes:
        chips: The chips, in population order.
    """

    chips: tuple[Chip, ...]

    def __post_init__(self):
        if not self.chips:
            raise ValueError("a population needs at least one chip")
        base = self.chips[0].spec.replace(seed=0)
        for i, c in enumerate(self.chips):
            if not isinstance(c, Chip):
                raise TypeError(f"population member {i} is a {type(c).__name__}, not a sidra_core.Chip")
            if c.spec.replace(seed=0) != base:
                raise ValueError(f"population member {i} has another spec than member 0 ({c.spec.name!r} vs "
                                 f"{self.chips[0].spec.name!r}): a population's chips differ only in their seeds")

    @classmethod
    def create(cls, chip: "str | ChipSpec" = "y1", n: int = 16, seed: int = 0, *, first: int = 0,
               **overrides) -> "Population":
        """Chips `first` .. `first + n - 1` of the population seeded `seed`, of preset, TOML path or
        ChipSpec `chip` (with dotted `section__field` overrides)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"a population needs n >= 1 chips, got {n!r}")
        spec = resolve(chip, **overrides)
        members = []
        for i in range(first, first + n):
            chip_seed, run_seed = chip_seeds(seed, i)
            members.append(Chip(spec=spec.replace(seed=chip_seed), seed=run_seed))
        return cls(tuple(members))

    @property
    def spec(self) -> ChipSpec:
        """The chips' common spec (chip 0's)."""
        return self.chips[0].spec

    def __len__(self) -> int:
        return len(self.chips)

    def __iter__(self):
        return iter(self.chips)

    def __getitem__(self, i):
        return Population(self.chips[i]) if isinstance(i, slice) else self.chips[i]

    def chunks(self, size: int) -> list["Population"]:
        """The population in consecutive parts of at most `size` chips."""
        if size < 1:
            raise ValueError(f"a chunk holds at least one chip, got {size}")
        return [self[i:i + size] for i in range(0, len(self), size)]

    def bytes_per_chip(self, shapes) -> int:
        """Host bytes one chip holds for K x N weights `shapes`: programmed state and read snapshots."""
        cells = sum(g.k_padded * g.n_padded for g in (tile_grid(k, n, self.spec) for k, n in shapes))
        weights = sum(k * n for k, n in shapes)
        return int(crossbar.state_bytes_per_cell(self.spec) * cells
                   + crossbar.snapshot_bytes_per_weight(self.spec) * weights)

    def check_fits(self, shapes, name: str = "model") -> None:
        """Raise before anything is programmed if K x N weights `shapes` do not fit each chip's tiles
        (ChipCapacityError) or the population's copies do not fit the host's memory (HostMemoryError,
        with the largest chunk that fits)."""
        self.chips[0].check_fits(shapes, name=name)
        per_chip = self.bytes_per_chip(shapes)
        need = per_chip * len(self)
        free = host.available_memory()
        if free is not None and need > free:
            fits = free // per_chip if per_chip else len(self)
            advice = (f"evaluate it in chunks of at most {fits} chips (Population.chunks({fits}))" if fits else
                      "one chip alone does not fit: free memory, or run on a host with more memory")
            raise HostMemoryError(
                f"{name} on a population of {len(self)} chips needs {need:,} bytes ({_binary(need)}) of host memory "
                f"for its programmed states and read snapshots ({_binary(per_chip)} per chip), but {_binary(free)} "
                f"is available: {advice}")

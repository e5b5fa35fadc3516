"""A weight's crossbar copies: the one registry both bridges keep their weights' programmed state in.

A frontend's weight (a torch parameter, a sidra_jax WeightSlot) reaches the crossbar in one or more
ways (K x N as it is or transposed, a convolution kernel's layout); each way on each chip is one
copy, a `Resident`: programmed by ISPP at its first use, rewritten incrementally when the weight's
version moves, freed with the weight. A frontend says only the key of the way and the version.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from .device import Chip, Resident
from .quant import QuantisedWeight


def _contents(m) -> dict:
    """Chip.program / reprogram's argument for a float K x N matrix or INT8 codes with their scales."""
    return {"quantised": m} if isinstance(m, QuantisedWeight) else {"w": m}


class WeightCopies:
    """The crossbar copies of one weight, by (chip, key): each with the version it holds."""

    def __init__(self):
        self._copies: dict = {}  # (id(chip), key) -> (Resident, version, chip)
        self._lock = threading.RLock()

    def get(self, chip: Chip, key, version, contents: Callable[[], np.ndarray | QuantisedWeight], *,
            name: str = "weight") -> tuple[Resident, str | None]:
        """The copy `key` on `chip` at `version`: (its Resident, what was done to it: "programmed",
        "reprogrammed" (only the changed cells) or None). `contents()` gives the K x N float matrix
        or the INT8 codes to write, called only when there is something to write."""
        at = (id(chip), key)
        entry = self._copies.get(at)
        if entry is not None and entry[1] == version and not entry[0].freed:
            return entry[0], None
        with self._lock:
            entry = self._copies.get(at)
            if entry is not None and not entry[0].freed:
                if entry[1] == version:
                    return entry[0], None
                chip.reprogram(entry[0], **_contents(contents()), version=version)
                self._copies[at] = (entry[0], version, chip)
                return entry[0], "reprogrammed"
            res = chip.program(**_contents(contents()), name=name, version=version)
            self._copies[at] = (res, version, chip)
            return res, "programmed"

    def fresh(self, chip: Chip, key, version) -> Resident | None:
        """The copy if it is programmed, live and at `version`; else None."""
        entry = self._copies.get((id(chip), key))
        return entry[0] if entry is not None and entry[1] == version and not entry[0].freed else None

    def held(self, chip: Chip, key) -> bool:
        """Whether the chip holds a live copy `key` (at any version: a new one is rewritten in place)."""
        entry = self._copies.get((id(chip), key))
        return entry is not None and not entry[0].freed

    def on(self, chip: Chip) -> bool:
        """Whether the chip holds any live copy of this weight."""
        return any(c is chip and not res.freed for res, _, c in self._copies.values())

    def residents(self) -> list[Resident]:
        """Every live copy, on every chip."""
        return [res for res, _, _ in self._copies.values() if not res.freed]

    def __len__(self) -> int:
        return len(self.residents())

    def free(self) -> None:
        """Release every copy's tiles. Lock-free, as Chip.free: it may run from a garbage collection."""
        copies = list(self._copies.values())
        self._copies.clear()
        for res, _, chip in copies:
            chip.free(res)

    def __del__(self):  # the tiles are freed when the weight (which holds this) dies
        self.free()

    def __deepcopy__(self, memo):
        return WeightCopies()  # a copy of a weight is a new weight: not programmed yet

    def __reduce__(self):
        return (WeightCopies, ())

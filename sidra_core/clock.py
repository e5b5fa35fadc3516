"""The device clock and counters: simulated time, energy by component, event counts."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field

from .cost import ZERO, Cost

COUNTS = ("mvms", "tile_reads", "engine_ops", "memory_ops", "pulses", "cells_programmed",
          "fallback_ops", "host_transfers", "host_bytes")


@dataclass(frozen=True)
class Counters:
    """Everything the device has done since the last reset (immutable; `charge` returns a new one)."""

    cost: Cost = ZERO  # cost.latency_s is the busy time the device spent on operations
    idle_s: float = 0.0  # time advanced by the user (drift studies), not spent working
    mvms: int = 0
    tile_reads: int = 0
    engine_ops: int = 0
    memory_ops: int = 0
    pulses: int = 0
    cells_programmed: int = 0
    fallback_ops: int = 0
    host_transfers: int = 0
    host_bytes: int = 0

    @property
    def time_s(self) -> float:
        """The device clock: busy time plus advanced time."""
        return self.cost.latency_s + self.idle_s

    @property
    def energy_j(self) -> float:
        return self.cost.energy_j

    def charge(self, cost: Cost = ZERO, **counts: int) -> "Counters":
        unknown = set(counts) - set(COUNTS)
        if unknown:
            raise ValueError(f"unknown counters {sorted(unknown)}; known: {list(COUNTS)}")
        return dataclasses.replace(
            self, cost=self.cost + cost, **{k: getattr(self, k) + int(v) for k, v in counts.items()}
        )

    def advance(self, seconds: float) -> "Counters":
        if not seconds >= 0:
            raise ValueError(f"the device clock only moves forward; got {seconds!r} s")
        return dataclasses.replace(self, idle_s=self.idle_s + float(seconds))

    def as_dict(self) -> dict:
        d = {"time_s": self.time_s, "busy_s": self.cost.latency_s, "idle_s": self.idle_s, "energy_j": self.energy_j}
        d.update({f"energy_{c}_j": v for c, v in self.cost.energy_by_component().items()})
        d.update({k: getattr(self, k) for k in COUNTS})
        return d


@dataclass
class DeviceClock:
    """A running device's clock: a thread-safe holder of Counters for the bridges.

    The clock never goes back: `reset_counters` zeroes the counts and energy
    but keeps the time, because programmed cells keep drifting.
    """

    counters: Counters = field(default_factory=Counters)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _epoch_s: float = 0.0  # device time at the last counter reset

    @property
    def now(self) -> float:
        return self._epoch_s + self.counters.time_s

    def charge(self, cost: Cost = ZERO, **counts: int) -> Counters:
        with self._lock:
            self.counters = self.counters.charge(cost, **counts)
            return self.counters

    def advance(self, seconds: float) -> float:
        with self._lock:
            self.counters = self.counters.advance(seconds)
            return self._epoch_s + self.counters.time_s

    def reset_counters(self) -> None:
        with self._lock:
            self._epoch_s += self.counters.time_s
            self.counters = Counters()

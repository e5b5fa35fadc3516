"""The device clock and counters: simulated time, energy by component, event counts.

Energy is what each operation costs (sidra_core.cost, by component) plus the chip's background
power over the time it is busy (CostSpec.background_w: leakage, clocks, analog bias, DRAM
refresh, link PHYs), the `background` component, added by `charge` to each op.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from .cost import COMPONENTS, ZERO, Cost

_BACKGROUND = COMPONENTS.index("background")
COUNTS = ("mvms", "tile_reads", "engine_ops", "memory_ops", "pulses", "cells_programmed",
          "fallback_ops", "host_transfers", "host_bytes")


@dataclass(frozen=True)
class Counters:
    """Everything the device has done since the last reset (immutable; `charge` returns a new one).

    Attributes:
        cost: Latency and energy by component; `cost.latency_s` is the busy time spent on operations.
        idle_s: Time advanced by the user (drift studies), not spent working.
        mvms: Crossbar MVMs.
        tile_reads: Tile reads (an MVM reads each of its weight's tiles once per input row).
        engine_ops: Compute-engine ops.
        memory_ops: Device-memory ops.
        pulses: Write-verify pulses.
        cells_programmed: Cells written.
        fallback_ops: Ops that ran on the host.
        host_transfers: Transfers over the host link.
        host_bytes: Bytes over the host link.
    """

    cost: Cost = ZERO
    idle_s: float = 0.0
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


class DeviceClock:
    """A running device's clock: mutable accumulators for the bridges' hot path.

    `charge` adds in place (an eager op must not build new immutable objects);
    `counters` returns an immutable Counters snapshot. The clock never goes
    back: `reset_counters` zeroes the counts and energy but keeps the time,
    because programmed cells keep drifting. `background_w` (W) is charged over busy time (the
    Chip sets it from its spec); idle time is not: RRAM keeps its weights unpowered.

    Args:
        background_w: The chip's background power while busy (W).
    """

    def __init__(self, background_w: float = 0.0):
        self.background_w = float(background_w)
        self._lock = threading.Lock()
        self._epoch_s = 0.0  # device time at the last counter reset
        self._zero()

    def _zero(self) -> None:
        self._busy = 0.0
        self._idle = 0.0
        self._energy = [0.0] * len(COMPONENTS)
        self._counts = dict.fromkeys(COUNTS, 0)

    @property
    def now(self) -> float:
        return self._epoch_s + self._busy + self._idle

    @property
    def counters(self) -> Counters:
        with self._lock:
            cost = Cost(self._busy, *self._energy)
            return Counters(cost=cost, idle_s=self._idle, **self._counts)

    def charge(self, cost: Cost = ZERO, **counts: int) -> None:
        with self._lock:
            self._busy += cost.latency_s
            e = self._energy
            e[_BACKGROUND] += self.background_w * cost.latency_s
            for i, v in enumerate(cost.energies):
                e[i] += v
            c = self._counts
            for k, v in counts.items():
                if k not in c:
                    raise ValueError(f"unknown counters {[k]}; known: {list(COUNTS)}")
                c[k] += int(v)

    def raw(self) -> tuple:
        """(busy s, operation energies tuple, counts dict): a cheap reading for per-op deltas."""
        with self._lock:
            return self._busy, tuple(self._energy), dict(self._counts)

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:
            raise ValueError(f"the device clock only moves forward; got {seconds!r} s")
        with self._lock:
            self._idle += float(seconds)
            return self.now

    def reset_counters(self) -> None:
        with self._lock:
            self._epoch_s += self._busy + self._idle
            self._zero()

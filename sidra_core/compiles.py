"""The XLA programs the simulator builds and where that time goes, from JAX's own monitoring events:
tracing to a jaxpr, lowering to MLIR, and XLA's compile or a load from the on-disk cache.

A new input shape builds new programs (one per kernel it reaches); `record()` counts them while it
is open, so a profiler can show the first call's cost beside the device's.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

import jax

PHASES = {  # JAX's event -> phase
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",  # XLA's compile, or a cache load inside it
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache load",
}
_BUILT = "/jax/core/compile/backend_compile_duration"
_LOADED = "/jax/compilation_cache/cache_retrieval_time_sec"


@dataclass
class Compiles:
    """Programs built while recording, by function name, and the seconds of each phase."""

    programs: Counter = field(default_factory=Counter)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES.values(), 0.0))
    cache_loads: int = 0

    @property
    def built(self) -> int:
        return sum(self.programs.values())

    @property
    def total_s(self) -> float:
        """Wall time spent building programs (a cache load happens inside XLA's compile phase)."""
        return self.seconds["trace"] + self.seconds["lower"] + self.seconds["compile"]

    def summary(self) -> str:
        s = self.seconds
        return (f"Programs built: {self.built} ({self.cache_loads} loaded from the on-disk cache) in "
                f"{self.total_s:.3f}s: tracing {s['trace']:.3f}s, lowering {s['lower']:.3f}s, XLA compile "
                f"{s['compile']:.3f}s (of which cache loads {s['cache load']:.3f}s)")


_LOCK = threading.Lock()
_ACTIVE: list[Compiles] = []
_LISTENING = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    phase = PHASES.get(event)
    if phase is None or not _ACTIVE:
        return
    with _LOCK:
        for log in _ACTIVE:
            log.seconds[phase] += duration
            if event == _BUILT:
                log.programs[kwargs.get("fun_name", "?")] += 1
            elif event == _LOADED:
                log.cache_loads += 1


class record:
    """`with compiles.record() as c:` counts the programs built inside the block (any thread)."""

    def __enter__(self) -> Compiles:
        global _LISTENING
        with _LOCK:
            if not _LISTENING:  # once per process; a no-op while nothing records
                jax.monitoring.register_event_duration_secs_listener(_on_duration)
                _LISTENING = True
            self.log = Compiles()
            _ACTIVE.append(self.log)
        return self.log

    def __exit__(self, *exc) -> bool:
        with _LOCK:
            _ACTIVE.remove(self.log)
        return False

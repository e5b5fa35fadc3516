"""Shared timing helpers for the benchmark scripts: the median of repeats after warm-up calls, and
the best such median of several interleaved rounds (the machine is shared and drifts in speed)."""

from __future__ import annotations

import statistics
import time


def median_time(fn, repeat: int, warmup: int = 2) -> float:
    """Median wall time (s) of `repeat` calls of fn, after `warmup` calls (compilation, caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def best_of_rounds(timed: dict, repeat: int, rounds: int, warmup: int = 2) -> dict:
    """Per name, the best `median_time` of its callable over `rounds` interleaved rounds (noise only
    adds time, and interleaving exposes every variant to the same stretches of a drifting machine)."""
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(rounds):
        for name, fn in timed.items():
            best[name] = min(best[name], median_time(fn, repeat, warmup=warmup))
    return best


def host_kind() -> str:
    """The backend and kernels the simulator uses on this host (the ratios depend on them)."""
    from sidra_core import host

    return f"host: {host.summary()}"

"""Shared timing helper for the benchmark scripts: the median of repeats after warm-up calls."""

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

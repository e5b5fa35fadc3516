"""benchmarks/bench_jax.py runs (smoke test on small workloads) and reports what it measured."""

from __future__ import annotations

import importlib.util
import sys
import re
from pathlib import Path

import numpy as np

import sidra_core
from sidra_core import cost

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_jax.py"


def _load():
    if str(BENCH.parent) not in sys.path:
        sys.path.insert(0, str(BENCH.parent))  # the benchmarks' shared timing helper
    spec = importlib.util.spec_from_file_location("bench_jax", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_jax_quick_run(capsys):
    bench = _load()
    assert bench.main(["--quick", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if re.match(r"^(MLP|encoder) \(quick\)\s+(int8|y1)\s", ln)]
    assert len(rows) == 4, out
    for ln in rows:
        plain, sidra, ratio = (float(v) for v in re.findall(r"([\d.]+)(?:ms|x)", ln)[:3])
        # the times are printed to 1 us: the ratio lies within what that rounding allows
        lo, hi = (sidra - 5e-4) / (plain + 5e-4), (sidra + 5e-4) / max(plain - 5e-4, 1e-9)
        assert plain > 0 and sidra > 0 and lo - 0.006 <= ratio <= hi + 0.006, ln
    assert "worst ratio" in out
    # The device figures it prints are sidra_core.cost of the quick MLP's shapes (16 x 64 -> 128 -> 10).
    spec = sidra_core.preset("y1")
    expected = (cost.mvm(16, 64, 128, spec) + cost.engine("relu", 16 * 128, spec) + cost.mvm(16, 128, 10, spec))
    us = float(re.findall(r"([\d.]+)us", rows[1])[0])
    assert np.isclose(us, expected.latency_s * 1e6, atol=0.01)

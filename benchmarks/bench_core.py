"""sidra_core benchmarks: analog linear against a float32 matmul, and ISPP of BERT-base.

Run: python benchmarks/bench_core.py [--mvm] [--ispp] [--repeat N] [--rounds R]
Prints ratios measured in this run; the machine is noisy, so each timing is
the best median of repeats over interleaved rounds (the three variants of a
shape take turns, so a drift in the machine's speed hits all alike).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_of_rounds, host_kind

import results

import sidra_core as sc
from sidra_core import host


def bench_mvm(repeat: int, rounds: int) -> list[dict]:
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows_out = []
    spec = sc.preset("y1")
    chip = sc.Chip(spec=spec, seed=0)
    rs = np.random.default_rng(0)
    for k, n in ((768, 3072), (3072, 768)):
        w = rs.standard_normal((k, n)).astype(np.float32) * 0.05
        res = chip.program(w, name=f"{k}x{n}")
        for rows in (128, 512):
            x = rs.standard_normal((rows, k)).astype(np.float32)
            xj, wj = jnp.asarray(x), jnp.asarray(w)
            xt, wt = torch.from_numpy(x), torch.from_numpy(w)
            dot = jax.jit(jnp.dot)
            best = best_of_rounds({
                "torch": lambda: torch.matmul(xt, wt),
                "jax": lambda: dot(xj, wj).block_until_ready(),
                "sidra": lambda: chip.linear(res, xj).block_until_ready(),
            }, repeat, rounds)
            t_torch, t_jax, t_sidra = best["torch"], best["jax"], best["sidra"]
            base = min(t_torch, t_jax)
            rows_out.append({
                "shape": f"{rows}x{k} @ {k}x{n}", "torch_ms": t_torch * 1e3, "jax_ms": t_jax * 1e3,
                "sidra_y1_ms": t_sidra * 1e3, "ratio": t_sidra / base,
            })
    return rows_out


def bench_ispp() -> dict:
    """Program every linear weight of BERT-base (12 layers: Q, K, V, O, FF1, FF2; ~85 M weights)."""
    spec = sc.preset("y1")
    chip = sc.Chip(spec=spec, seed=0)
    rs = np.random.default_rng(1)
    shapes = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
    total = 0
    pulses = 0
    wall = 0.0  # programming only, not the drawing of the random weights
    for layer in range(12):
        for i, (k, n) in enumerate(shapes):
            w = (rs.standard_normal((k, n), dtype=np.float32) * 0.04)
            t0 = time.perf_counter()
            res = chip.program(w, name=f"layer{layer}.{i}")
            wall += time.perf_counter() - t0
            total += w.size
            pulses += res.state.programming.pulses
            # Keep only what a resident weight needs; the host copy of w goes away like a model's would.
            del w
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    c = chip.clock.counters
    return {
        "weights": total, "tiles": chip.tiles_in_use, "wall_s": wall, "ns_per_weight": wall / total * 1e9,
        "pulses": pulses, "mean_pulses_per_written_cell": pulses / max(c.cells_programmed, 1),
        "peak_rss_gb": peak_gb, "simulated_programming_s": c.time_s, "programming_energy_mj": c.energy_j * 1e3,
    }


def main(argv=None) -> int:
    host.tune()  # the simulator's process settings, before any JAX computation
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mvm", action="store_true", help="only the analog linear benchmark")
    ap.add_argument("--ispp", action="store_true", help="only the ISPP programming benchmark")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="store the headline figures for docs/performance.md (benchmarks/results.py)")
    a = ap.parse_args(argv)
    both = not (a.mvm or a.ispp)
    if a.mvm or both:
        print(host_kind())
        print("y1 analog linear (DAC, per-tile read noise, drift, stuck cells, ADC) vs float32 matmul")
        print(f"{'shape':<22}{'torch ms':>10}{'jax ms':>10}{'sidra ms':>10}{'ratio':>8}  (target <= 2.0, stretch 1.5)")
        rows = bench_mvm(a.repeat, a.rounds)
        for r in rows:
            print(f"{r['shape']:<22}{r['torch_ms']:>10.2f}{r['jax_ms']:>10.2f}{r['sidra_y1_ms']:>10.2f}{r['ratio']:>8.2f}")
        if a.record:
            results.record("bench_core --mvm", [(f"y1 analog linear {r['shape']}: sidra / float32 matmul",
                                                 results.ratio(r["ratio"]), "<= 1.5x") for r in rows])
    if a.ispp or both:
        r = bench_ispp()
        print("\nISPP write-verify of BERT-base's linear layers under y1")
        for key, v in r.items():
            print(f"  {key:<32}{v:,.3f}" if isinstance(v, float) else f"  {key:<32}{v:,}")
        print(f"  target: wall <= 20 s -> {'met' if r['wall_s'] <= 20 else 'MISSED'}; "
              f"peak memory < 6 GB -> {'met' if r['peak_rss_gb'] < 6 else 'MISSED'}")
        if a.record:
            results.record("bench_core --ispp", [
                ("ISPP of BERT-base's linear weights, wall", f"{r['wall_s']:.1f} s", "<= 20 s"),
                ("its peak memory", f"{r['peak_rss_gb']:.1f} GB", "< 6 GB")])
    return 0


if __name__ == "__main__":
    sys.exit(main())

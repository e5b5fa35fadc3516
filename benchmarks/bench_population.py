"""Chip populations: one program over N chips against N single-chip runs, same process.

Run: python benchmarks/bench_population.py [--chips 16] [--repeat 5] [--record]
For the digits CNN (8x8 images, batch 64) and an encoder block (d=64, 2 x 32 tokens) on y1: the
first call (programs every chip, then reads) and a steady call (reads only), as one
`SidraFunction.population` call against a loop of calls on each chip alone, in chips per second; and
the process's peak memory. The population's outputs are checked against the chips alone, bit for bit.
Also against the loop a PyTorch user writes: the same shapes as modules, eager, chip after chip.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np
from timing import host_kind

import results

import sidra_core as sc
import sidra_jax as sj
import sidra_jax.nn as snn
from sidra_jax import tasks


def _workloads(rng):
    """The digits CNN (sidra_jax.tasks, trained) on 64 test images, and an encoder block."""
    images = tasks.digits_data()[2][:64]
    return {"digits CNN, batch 64": (tasks.cnn, tasks.trained("cnn"), images),
            "encoder block d=64, 2x32 tokens": (snn.encoder_block, snn.encoder_block_params(rng, 64, 256),
                                                rng.standard_normal((2, 32, 64)).astype(np.float32))}


def _torch_models():
    """The same shapes as PyTorch modules (random weights), for the loop a PyTorch user writes."""
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    class CNN(tnn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = tnn.Conv2d(1, 8, 3, padding=1), tnn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.fc = tnn.Linear(256, 10)

        def forward(self, x):
            return self.fc(F.relu(self.c2(F.relu(self.c1(x)))).flatten(1))

    class Encoder(tnn.Module):
        def __init__(self, d=64, heads=4, ffn=256):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (tnn.Linear(d, d) for _ in range(4))
            self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
            self.f1, self.f2 = tnn.Linear(d, ffn), tnn.Linear(ffn, d)

        def forward(self, x):
            b, s, d = x.shape
            split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
            a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
            x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, s, d)))
            return self.ln2(x + self.f2(F.gelu(self.f1(x))))

    torch.manual_seed(0)
    return {"digits CNN, batch 64": (CNN().eval(), torch.randn(64, 1, 8, 8)),
            "encoder block d=64, 2x32 tokens": (Encoder().eval(), torch.randn(2, 32, 64))}


def torch_loop(model, x, n: int, repeat: int) -> float:
    """A steady call of the PyTorch model on n chips one by one (sidra_torch.population's loop)."""
    import sidra_torch

    pop = sc.Population.create("y1", n=n, seed=0)
    model.to("sidra")
    sidra_torch.population(model, x, chips=pop)  # programs every chip
    return min(_timed(lambda: sidra_torch.population(model, x, chips=pop))[0] for _ in range(repeat))


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(fn, params, x, n: int, repeat: int) -> dict:
    """First and steady call times (s) of one population call and of n single-chip calls."""
    pop = sc.Population.create("y1", n=n, seed=0)
    f = sj.jit(fn)
    prog = sj.program(params, pop[0])
    first_pop, y = _timed(lambda: np.asarray(f.population(pop, prog, x)))
    steady_pop = min(_timed(lambda: np.asarray(f.population(pop, prog, x)))[0] for _ in range(repeat))
    twins = [sc.Chip(spec=c.spec, seed=c.seed) for c in pop]
    g = sj.jit(fn)
    progs = [sj.program(params, c) for c in twins]
    first_one, alone = _timed(lambda: [np.asarray(g(p, x)) for p in progs])
    steady_one = min(_timed(lambda: [np.asarray(g(p, x)) for p in progs])[0] for _ in range(repeat))
    assert np.array_equal(y, np.stack(alone)), "a population's first call differs from its chips alone"
    return {"first_pop": first_pop, "first_one": first_one, "steady_pop": steady_pop, "steady_one": steady_one}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--chips", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="store the headline figures for docs/performance.md")
    a = ap.parse_args(argv)
    sc.host.tune()
    print(host_kind())
    n = a.chips
    print(f"{n} chips of y1; chips per second (higher is better), population / one by one\n")
    print(f"{'workload':34s} {'first call (sidra_jax)':>26s} {'steady call (sidra_jax)':>26s} "
          f"{'steady, vs a PyTorch loop':>26s}")
    figures = []
    models = _torch_models()
    for name, (fn, params, x) in _workloads(np.random.default_rng(0)).items():
        r = measure(fn, params, x, n, a.repeat)
        r["steady_torch"] = torch_loop(*models[name], n, a.repeat)
        cps = {k: n / v for k, v in r.items()}
        first, steady = r["first_one"] / r["first_pop"], r["steady_one"] / r["steady_pop"]
        loop = r["steady_torch"] / r["steady_pop"]
        print(f"{name:34s} {cps['first_pop']:9.1f} / {cps['first_one']:7.1f} = {first:4.2f}x "
              f"{cps['steady_pop']:9.1f} / {cps['steady_one']:7.1f} = {steady:4.2f}x "
              f"{cps['steady_pop']:9.1f} / {cps['steady_torch']:7.1f} = {loop:4.2f}x")
        figures += [(f"{name}, {n} y1 chips: steady call, population / sidra_jax one by one (chips per second)",
                     f"{steady:.2f}x ({cps['steady_pop']:.0f} / {cps['steady_one']:.0f})", ">= 4x"),
                    (f"{name}, {n} y1 chips: steady call, population / sidra_torch eager one by one",
                     f"{loop:.2f}x ({cps['steady_pop']:.0f} / {cps['steady_torch']:.0f})", ""),
                    (f"{name}, {n} y1 chips: first call (programming), population / one by one",
                     f"{first:.2f}x", "")]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"\npeak memory of the process: {peak:.2f} GiB (both ways, {n} chips each, held at once)")
    figures.append((f"peak memory, both ways of {n} chips held at once", f"{peak:.2f} GiB", ""))
    if a.record:
        results.record("bench_population", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

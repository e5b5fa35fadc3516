"""Chip populations (sidra_core.Population, SidraFunction.population, sidra_torch.population): one
program over N chips gives each chip's bits as running it alone does, sharded or not; the chips'
seeds are fixed per index; the population's memory is checked before anything is programmed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import sidra_core as sc
import sidra_jax as sj
import sidra_jax.nn as snn
from sidra_core import host
from sidra_jax import population as jpop


def _mlp_params(rng):
    return {"l1": {"w": rng.standard_normal((64, 96)).astype(np.float32) * 0.1, "b": np.zeros(96, np.float32)},
            "l2": {"w": rng.standard_normal((96, 10)).astype(np.float32) * 0.1, "b": np.zeros(10, np.float32)}}


def mlp(p, x):
    return jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]


def _cnn_params(rng):
    return {"c1": rng.standard_normal((3, 3, 1, 8)).astype(np.float32) * 0.3,
            "c2": rng.standard_normal((3, 3, 8, 16)).astype(np.float32) * 0.1,
            "fc": rng.standard_normal((16 * 16, 10)).astype(np.float32) * 0.05}


def cnn(p, x):  # the digits CNN's shape: 8x8 images, two 3x3 convolutions, a dense head
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn))
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn))
    return h.reshape(h.shape[0], -1) @ p["fc"]


def encoder(p, x):
    return snn.encoder_block(p, x, heads=4)


def _workload(name, rng):
    if name == "mlp":
        return mlp, _mlp_params(rng), rng.standard_normal((16, 64)).astype(np.float32)
    if name == "cnn":
        return cnn, _cnn_params(rng), rng.standard_normal((8, 8, 8, 1)).astype(np.float32)
    return encoder, snn.encoder_block_params(rng, 32, 64), rng.standard_normal((2, 8, 32)).astype(np.float32)


def _alone(fn, params, x, chip, calls=2):
    """Each call's outputs and device time on a fresh twin of `chip` (same spec and seeds)."""
    twin = sc.Chip(spec=chip.spec, seed=chip.seed)
    f = sj.jit(fn)
    prog = sj.program(params, twin)
    out = []
    for _ in range(calls):
        t0 = twin.clock.now
        out.append((np.asarray(f(prog, x)), twin.clock.now - t0))
    return out


@pytest.mark.parametrize("preset", ["y1", "int8"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "encoder"])
def test_a_population_gives_each_chips_bits_as_running_it_alone(name, preset):
    rng = np.random.default_rng(0)
    fn, params, x = _workload(name, rng)
    pop = sc.Population.create(preset, n=3, seed=7)
    f = sj.jit(fn)
    prog = sj.program(params, pop[0])
    got = []
    for _ in range(2):  # the first call programs every chip; the second reads them again
        t0 = [c.clock.now for c in pop]
        got.append((np.asarray(f.population(pop, prog, x)), [c.clock.now - t for c, t in zip(pop, t0)]))
    for i, chip in enumerate(pop):
        for (y, dt), (want, want_dt) in zip(got, _alone(fn, params, x, chip)):
            assert y.shape == (3, *want.shape)
            np.testing.assert_array_equal(y[i], want)
            assert dt[i] == pytest.approx(want_dt, rel=1e-12)  # (from another start: the params moved to chip 0)
    if preset == "y1":  # independent chips: their noise differs
        assert not np.array_equal(got[0][0][0], got[0][0][1])
        assert not np.array_equal(got[0][0][0], got[1][0][0])  # and each call reads fresh noise
    assert all(len(c.residents) == len(pop[0].residents) > 0 for c in pop)


def test_chips_whose_snapshots_differ_in_layout_run_one_by_one(monkeypatch):
    """Where the chips' snapshots cannot be stacked (_stacked: None), each runs the plan's executor
    alone: the same bits as the vmapped program."""
    rng = np.random.default_rng(3)
    fn, params, x = _workload("mlp", rng)
    pop = sc.Population.create("y1", n=3, seed=1)
    prog = sj.program(params, pop[0])
    monkeypatch.setattr(jpop, "_stacked", lambda fn, snaps: None)
    y = np.asarray(sj.jit(fn).population(pop, prog, x))
    for i, chip in enumerate(pop):
        np.testing.assert_array_equal(y[i], _alone(fn, params, x, chip, calls=1)[0][0])


def test_a_chips_seeds_are_fixed_by_its_index():
    a = sc.Population.create("y1", n=6, seed=3)
    b = sc.Population.create("y1", n=2, seed=3, first=4)
    assert [(c.spec.seed, c.seed) for c in a[4:]] == [(c.spec.seed, c.seed) for c in b]
    seeds = {(c.spec.seed, c.seed) for c in sc.Population.create("y1", n=1000, seed=3)}
    assert len(seeds) == 1000 and len({s for s, _ in seeds}) == 1000
    assert all(0 <= s < 2 ** 63 for s, _ in seeds)
    other = sc.Population.create("y1", n=6, seed=4)
    assert not {c.spec.seed for c in a} & {c.spec.seed for c in other}
    assert [len(p) for p in a.chunks(4)] == [4, 2] and a.chunks(4)[1][0] is a[4]


def test_a_population_is_one_spec():
    with pytest.raises(ValueError, match="another spec than member 0"):
        sc.Population((sc.Chip.create("y1"), sc.Chip.create("pcm")))
    with pytest.raises(ValueError, match="at least one chip"):
        sc.Population(())
    with pytest.raises(TypeError, match="not one Chip"):
        sj.jit(mlp).population(sc.Chip.create("y1"), {}, np.zeros((1, 64), np.float32))


def test_a_population_too_large_for_the_host_is_refused_before_programming(monkeypatch):
    rng = np.random.default_rng(1)
    fn, params, x = _workload("mlp", rng)
    pop = sc.Population.create("y1", n=8, seed=0)
    per_chip = pop.bytes_per_chip([(64, 96), (96, 10)])
    monkeypatch.setattr(host, "available_memory", lambda: 3 * per_chip + 5)
    f = sj.jit(fn)
    prog = sj.program(params, pop[0])
    before = [c.clock.now for c in pop]  # (chip 0's: the params' transfer)
    with pytest.raises(sc.HostMemoryError, match=r"population of 8 chips needs .* per chip.*chunks of at most 3 "
                                                 r"chips \(Population\.chunks\(3\)\)"):
        f.population(pop, prog, x)
    assert all(c.tiles_in_use == 0 for c in pop) and [c.clock.now for c in pop] == before
    assert np.asarray(f.population(pop.chunks(3)[0], prog, x)).shape == (3, 16, 10)  # a chunk that fits


_SHARDED = """
import json, os, sys
import numpy as np
sys.path.insert(0, os.environ["TESTS"])
import jax, sidra_core as sc, sidra_jax as sj
from sidra_jax import population as jpop
from test_jax_population import _workload, _alone
out = {"devices": jax.device_count()}
for name in ("mlp", "cnn"):
    fn, params, x = _workload(name, np.random.default_rng(2))
    pop = sc.Population.create("y1", n=6, seed=5)
    f = sj.jit(fn)
    y = f.population(pop, sj.program(params, pop[0]), x)
    alone = np.stack([_alone(fn, params, x, c, calls=1)[0][0] for c in pop])
    out[name] = [bool(np.array_equal(np.asarray(y), alone)), len(y.sharding.device_set), jpop.devices_for(6)]
print(json.dumps(out))
"""


def test_a_sharded_population_equals_the_chips_alone():
    """Over 4 host devices a population of 6 is sharded over 3 (the most that divide it), with the bits
    of each chip alone."""
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"),
           "TESTS": os.path.dirname(__file__)}
    res = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert out["mlp"] == [True, 3, 3] and out["cnn"] == [True, 3, 3]


def test_devices_for_takes_the_most_that_divide():
    assert jpop.devices_for(1) == 1
    assert jpop.devices_for(7) in (1, 7) and 7 % jpop.devices_for(7) == 0


def test_the_torch_entry_runs_a_model_on_each_chip():
    import torch

    import sidra_torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10)).eval()
    x = torch.randn(16, 64)
    pop = sc.Population.create("y1", n=3, seed=2)
    model.to("sidra")
    run = sidra_torch.population(model, x, chips=pop, metric=lambda y: float(y.abs().mean()))
    assert run.outputs.shape == (3, 16, 10) and run.outputs.device.type == "cpu" and len(run.metrics) == 3
    for i, chip in enumerate(pop):  # chip i's output is the model run on that chip alone
        with sidra_torch.use_chip(sc.Chip(spec=chip.spec, seed=chip.seed)), torch.inference_mode():
            want = model(x.to("sidra")).cpu()
        torch.testing.assert_close(run.outputs[i], want, rtol=0, atol=0)
        assert run.metrics[i] == float(want.abs().mean())
    assert not torch.equal(run.outputs[0], run.outputs[1])
    with pytest.raises(ValueError, match="no overrides"):
        with sidra_torch.use_chip(pop[0], adc__bits=6):
            pass


def test_the_torch_entry_checks_the_other_chips_memory(monkeypatch):
    import torch

    import sidra_torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10)).eval().to("sidra")
    pop = sc.Population.create("y1", n=5, seed=9)
    per_chip = pop.bytes_per_chip([(64, 96), (96, 10)])
    monkeypatch.setattr(host, "available_memory", lambda: 2 * per_chip)
    with pytest.raises(sc.HostMemoryError, match=r"population of 4 chips.*chunks of at most 2 chips"):
        sidra_torch.population(model, torch.randn(2, 64), chips=pop)
    assert all(c.tiles_in_use == 0 for c in pop[1:])


def test_the_docs_example_runs_as_written():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "populations.md").read_text()
    scope: dict = {}
    exec(re.search(r"```python\n(.*?)```", page, re.S).group(1), scope)
    assert scope["y"].shape == (16, 32, 10)

"""Cost model, counters, the device clock, and the Chip charging its operations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import sidra_core as sc
from sidra_core import Cost, Counters, DeviceClock, cost
from sidra_core.cost import COMPONENTS

Y1 = sc.preset("y1")

# Every cost function with its shape arguments and a base point.
FUNCS = {
    "mvm": (lambda d, s: cost.mvm(d["rows"], d["k"], d["n"], s), {"rows": 8, "k": 300, "n": 700}),
    "conv": (lambda d, s: cost.conv(d["n_images"], d["positions"], d["k"], d["c_out"], s),
             {"n_images": 2, "positions": 49, "k": 576, "c_out": 64}),
    "engine": (lambda d, s: cost.engine("gelu", d["numel"], s), {"numel": 4096}),
    "engine_matmul": (lambda d, s: cost.engine_matmul(d["batch"], d["m"], d["k"], d["n"], s),
                      {"batch": 12, "m": 64, "k": 64, "n": 128}),
    "memory": (lambda d, s: cost.memory(d["nbytes"], s), {"nbytes": 1 << 20}),
    "host_transfer": (lambda d, s: cost.host_transfer(d["nbytes"], s, d["transfers"]), {"nbytes": 1 << 16, "transfers": 2}),
    "chip_link": (lambda d, s: cost.chip_link(d["nbytes"], s), {"nbytes": 4096}),
    "programming": (lambda d, s: cost.programming(d["pulses"], s), {"pulses": 123456}),
}

ARGS = [(f, a) for f, (_, base) in FUNCS.items() for a in base]


def _fields(c: Cost):
    return [getattr(c, f.name) for f in dataclasses.fields(Cost)]


# ---------------------------------------------------------------------------
# Cost arithmetic


def test_cost_add_and_energy():
    a = Cost(1.0, dac=1, array=2, adc=3, accum=4, engine=5, memory=6, host=7, chip_link=8, programming=9)
    b = Cost(0.5, dac=0.1, programming=1)
    c = a + b
    assert _fields(c) == [x + y for x, y in zip(_fields(a), _fields(b))]
    assert c.energy_j == pytest.approx(a.energy_j + b.energy_j)
    assert a.energy_j == 45
    assert a.energy_by_component() == {k: getattr(a, k) for k in COMPONENTS}
    assert set(COMPONENTS) == {f.name for f in dataclasses.fields(Cost)} - {"latency_s"}
    assert a + b == b + a
    assert (a + b) + c == a + (b + c)
    assert a + cost.ZERO == a
    par = a.alongside(b)
    assert par.latency_s == 1.0 and par.energy_j == pytest.approx(c.energy_j)
    assert a.scaled(2) == a + a


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_energy_components(name):
    fn, base = FUNCS[name]
    c = fn(base, Y1)
    comps = c.energy_by_component()
    assert all(v >= 0 for v in comps.values())
    assert c.energy_j == pytest.approx(sum(comps.values()), rel=1e-12)
    assert c.energy_j > 0 and c.latency_s > 0


@pytest.mark.parametrize("name,arg", ARGS)
def test_monotonic_in_every_shape_argument(name, arg):
    fn, base = FUNCS[name]
    prev = None
    weight_dim = (name, arg) in {("mvm", "k"), ("mvm", "n"), ("conv", "k"), ("conv", "c_out")}
    for v in (0, 1, 2, 3, 255, 256, 257, 511, 512, 513, 1000, 4096, 100_000)[weight_dim:]:  # a weight has K, N >= 1
        d = dict(base, **{arg: v})
        c = fn(d, Y1)
        if prev is not None:
            assert c.latency_s >= prev.latency_s, (arg, v)
            for comp in COMPONENTS:
                assert getattr(c, comp) >= getattr(prev, comp), (arg, v, comp)
        prev = c
    big = fn(dict(base, **{arg: 10 * base[arg]}), Y1)
    small = fn(base, Y1)
    # growing any shape strictly increases the energy (the transfer count only adds latency)
    if arg == "transfers":
        assert big.latency_s > small.latency_s and big.energy_j == small.energy_j
    else:
        assert big.energy_j > small.energy_j, arg


def _bad_dim_cases():
    out = []
    for name, arg in ARGS:
        for bad in (-1, 2.5, "3"):
            out.append(pytest.param(name, arg, bad, id=f"{name}-{arg}-{bad!r}"))
    return out


@pytest.mark.parametrize("name,arg,bad", _bad_dim_cases())
def test_bad_dims_raise(name, arg, bad):
    fn, base = FUNCS[name]
    with pytest.raises(ValueError, match="non-negative integer"):
        fn(dict(base, **{arg: bad}), Y1)


def test_conv_dims_checked_separately():
    with pytest.raises(ValueError):
        cost.conv(-2, -49, 576, 64, Y1)


@pytest.mark.parametrize("bad", [float("inf")])
def test_infinite_dims_raise_value_error(bad):
    with pytest.raises(ValueError):
        cost.mvm(bad, 10, 10, Y1)


def test_unknown_engine_op():
    with pytest.raises(ValueError, match="unknown engine op"):
        cost.engine("fft", 10, Y1)


@pytest.mark.parametrize("name,unit", [("mvm", "rows"), ("engine", "numel"), ("memory", "nbytes"),
                                       ("host_transfer", "nbytes"), ("chip_link", "nbytes"),
                                       ("programming", "pulses"), ("engine_matmul", "batch")])
def test_energy_additive(name, unit):
    """Splitting work into two parts costs the same energy as doing it at once."""
    fn, base = FUNCS[name]
    a, b = fn(dict(base, **{unit: 300}), Y1), fn(dict(base, **{unit: 700}), Y1)
    whole = fn(dict(base, **{unit: 1000}), Y1)
    for comp in COMPONENTS:
        assert getattr(a + b, comp) == pytest.approx(getattr(whole, comp), rel=1e-12)
    # and latency is at most additive (fixed per-op overheads are paid once)
    assert whole.latency_s <= (a + b).latency_s * (1 + 1e-12)


def test_mvm_latency_and_energy_formula():
    c = Y1.cost
    one = cost.mvm(10, 256, 256, Y1)  # one tile: rows x tile time
    assert one.latency_s == pytest.approx(10 * c.tile_mvm_s)
    assert cost.mvm(10, 256, 256 * 7, Y1).latency_s == pytest.approx(10 * c.tile_mvm_s)  # column tiles in parallel
    three = cost.mvm(10, 768, 256, Y1)  # 3 row tiles: + digital accumulation of 2 extra partial sums
    assert three.latency_s == pytest.approx(10 * c.tile_mvm_s + 2 * c.accum_s_per_tile)
    assert cost.mvm(0, 768, 256, Y1) == cost.ZERO
    # energy per tile read: 256 DACs, 256 x 256 cells, 256 ADC conversions
    assert one.dac == pytest.approx(10 * 256 * c.dac_pj * 1e-12)
    assert one.array == pytest.approx(10 * 65536 * c.array_pj_per_mac * 1e-12)
    assert one.adc == pytest.approx(10 * 256 * c.adc_pj * 1e-12)
    # order of magnitude: a tile MVM ~100-200 ns, < 1 pJ/MAC
    assert 50e-9 < c.tile_mvm_s < 300e-9
    assert one.energy_j / (10 * 65536) < 1e-12
    assert cost.conv(2, 49, 576, 64, Y1) == cost.mvm(98, 576, 64, Y1)


def test_programming_cost_scales_with_pulses():
    c = Y1.cost
    lanes = c.tiles_programmed_in_parallel * c.rows_programmed_in_parallel
    for p in (0, 1, lanes, lanes + 1, 10 * lanes, 1_000_003):
        pc = cost.programming(p, Y1)
        assert pc.programming == pytest.approx(p * c.pulse_pj * 1e-12)
        assert pc.energy_j == pc.programming
        assert pc.latency_s == pytest.approx(math.ceil(p / lanes) * c.pulse_s)
    assert cost.programming(2_000_000, Y1).energy_j == pytest.approx(2 * cost.programming(1_000_000, Y1).energy_j)


def test_host_transfer_formula():
    m = Y1.memory
    c = cost.host_transfer(1 << 20, Y1, transfers=3)
    assert c.latency_s == pytest.approx(3 * m.host_latency_s + (1 << 20) / m.host_bw)
    assert c.host == pytest.approx((1 << 20) * m.host_pj_per_byte * 1e-12)
    assert cost.host_transfer(100, Y1, transfers=0) == cost.ZERO


# ---------------------------------------------------------------------------
# Counters and the device clock


def test_counters_charge_and_advance():
    c0 = Counters()
    a = Cost(1e-6, engine=2e-9)
    c1 = c0.charge(a, engine_ops=1, host_bytes=100)
    assert c0 == Counters()  # immutable
    assert c1.engine_ops == 1 and c1.host_bytes == 100 and c1.mvms == 0
    assert c1.time_s == pytest.approx(1e-6) and c1.energy_j == pytest.approx(2e-9)
    c2 = c1.charge(a, engine_ops=2).advance(10.0)
    assert c2.engine_ops == 3 and c2.idle_s == 10.0
    assert c2.time_s == pytest.approx(10.0 + 2e-6)
    assert c2.cost.latency_s == pytest.approx(2e-6)
    d = c2.as_dict()
    assert d["time_s"] == c2.time_s and d["busy_s"] == c2.cost.latency_s and d["idle_s"] == 10.0
    assert d["energy_engine_j"] == pytest.approx(4e-9) and d["engine_ops"] == 3
    with pytest.raises(ValueError, match="unknown counters"):
        c0.charge(a, flops=1)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="forward"):
            c0.advance(bad)


def test_device_clock_reset_keeps_time():
    clk = DeviceClock()
    clk.charge(Cost(2e-3, dac=1e-6), mvms=1)
    assert clk.advance(100.0) == pytest.approx(100.002)
    assert clk.now == pytest.approx(100.002)
    clk.reset_counters()
    assert clk.now == pytest.approx(100.002)  # the clock never goes back
    assert clk.counters == Counters()
    clk.charge(Cost(1e-3), mvms=2)
    assert clk.now == pytest.approx(100.003)
    assert clk.counters.mvms == 2 and clk.counters.time_s == pytest.approx(1e-3)


# ---------------------------------------------------------------------------
# The Chip charges what it does


def _w(k, n, seed=0):
    return np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)


def test_chip_charges_programming_mvm_and_engine():
    chip = sc.Chip.create("y1", seed=0)
    spec = chip.spec
    watts = spec.cost.background_w  # the y1 chip's background power, drawn over each op's latency
    assert watts > 0
    res = chip.program(_w(300, 200), name="fc")
    c = chip.clock.counters
    pulses = res.state.programming.pulses
    assert pulses > 0
    assert c.pulses == pulses and c.cells_programmed == res.state.programming.cells_written
    assert c.cost == cost.programming(pulses, spec).with_background(watts)
    assert chip.tiles_in_use == 2 and res.first_tile == 0

    before = chip.clock.counters
    x = _w(7, 300, 1)
    y = np.asarray(chip.linear(res, x))
    assert y.shape == (7, 200)
    c = chip.clock.counters
    assert c.mvms == before.mvms + 1 and c.tile_reads == before.tile_reads + 7 * 2
    assert c.cost == before.cost + cost.mvm(7, 300, 200, spec).with_background(watts)
    assert np.linalg.norm(y - x @ _w(300, 200)) / np.linalg.norm(x @ _w(300, 200)) < 0.15

    before = chip.clock.counters
    chip.engine("gelu", np.ones((4, 100), np.float32))
    chip.engine("layer_norm", np.ones((4, 100), np.float32))
    c = chip.clock.counters
    assert c.engine_ops == before.engine_ops + 2
    assert c.cost == (before.cost + cost.engine("gelu", 400, spec).with_background(watts)
                      + cost.engine("layer_norm", 400, spec).with_background(watts))

    before = chip.clock.counters
    chip.matmul(np.ones((3, 8, 16), np.float32), np.ones((3, 16, 5), np.float32))
    assert chip.clock.counters.cost == before.cost + cost.engine_matmul(3, 8, 16, 5, spec).with_background(watts)
    assert chip.clock.counters.engine_ops == before.engine_ops + 1

    before = chip.clock.counters
    chip.charge_host(1000, transfers=2, fallback=True)
    chip.charge_memory(4096)
    c = chip.clock.counters
    assert (c.host_transfers, c.host_bytes, c.fallback_ops, c.memory_ops) == (2, 1000, 1, 1)
    assert c.cost == (before.cost + cost.host_transfer(1000, spec, 2).with_background(watts)
                      + cost.memory(4096, spec).with_background(watts))
    with pytest.raises(ValueError, match="no op"):
        chip.engine("fft", np.ones(3, np.float32))


def test_chip_conv_charges_and_matches_torch():
    import torch
    chip = sc.Chip.create("ideal")
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    x = rng.standard_normal((2, 3, 10, 10)).astype(np.float32)
    res = chip.program(sc.conv_weight_matrix(w), name="conv")
    before = chip.clock.counters
    y = np.asarray(chip.conv(res, x, w.shape, stride=2, padding=1))
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), stride=2, padding=1).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    c = chip.clock.counters
    assert c.mvms == before.mvms + 1 and c.tile_reads == before.tile_reads + 2 * 25
    assert c.cost == before.cost + cost.mvm(2 * 25, 27, 8, chip.spec)


def test_chip_reads_are_seeded_and_reproducible():
    w, x = _w(256, 64), _w(4, 256, 1)
    ys = []
    for _ in range(2):
        chip = sc.Chip.create("y1", seed=3)
        res = chip.program(w)
        ys.append((np.asarray(chip.linear(res, x)), np.asarray(chip.linear(res, x))))
    np.testing.assert_array_equal(ys[0][0], ys[1][0])
    np.testing.assert_array_equal(ys[0][1], ys[1][1])
    assert not np.array_equal(ys[0][0], ys[0][1])  # fresh read noise per call


def test_chip_advance_drifts_outputs():
    chip = sc.Chip.create("y1", seed=0, noise__read_sigma=0.0)
    res = chip.program(_w(256, 128))
    x = _w(8, 256, 1)
    y0 = np.asarray(chip.linear(res, x))
    t = chip.advance(365 * 86400.0)
    assert t == pytest.approx(chip.clock.now) and t > 365 * 86400.0
    y1 = np.asarray(chip.linear(res, x))
    gain = (y1 * y0).sum() / (y0 * y0).sum()
    assert 0.8 < gain < 0.95  # nu ~ 0.01: ~13 % lower after a year (G_min cells do not drift)


def test_chip_capacity_error_leaves_state_unchanged():
    chip = sc.Chip.create("y1", seed=0, tile__tiles_per_chip=4, tile__allow_multi_chip=False)
    chip.program(_w(512, 300), name="a")  # 2 x 2 = 4 tiles
    assert chip.tiles_in_use == 4 and chip.tiles_total == 4
    counters = chip.clock.counters
    residents = list(chip.residents)
    with pytest.raises(sc.ChipCapacityError) as ei:
        chip.program(_w(10, 10), name="b")
    msg = str(ei.value)
    assert "'b' needs 1 crossbar tiles" in msg and "only 0 of the 4 are free" in msg
    assert "tile__allow_multi_chip=True" in msg
    assert chip.tiles_in_use == 4
    assert chip.clock.counters == counters
    assert chip.residents == residents
    with pytest.raises(sc.ChipCapacityError):
        chip.check_fits([(10, 10)])
    # a second call still fails the same way (nothing was half-allocated)
    with pytest.raises(sc.ChipCapacityError):
        chip.program(_w(10, 10), name="b")
    assert chip.clock.counters == counters


def test_chip_free_reuses_tiles():
    chip = sc.Chip.create("int8", tile__tiles_per_chip=4, tile__allow_multi_chip=False)
    a = chip.program(_w(256, 256), name="a")
    b = chip.program(_w(256, 512), name="b")
    assert (a.first_tile, b.first_tile) == (0, 1)
    chip.free(a)
    assert chip.tiles_in_use == 2
    c = chip.program(_w(100, 100, 1), name="c")
    assert c.first_tile == 0
    d = chip.program(_w(100, 100, 2), name="d")
    assert d.first_tile == 3
    with pytest.raises(RuntimeError, match="freed"):
        chip.reprogram(a, _w(256, 256))


def test_chip_freed_weight_cannot_be_read():
    chip = sc.Chip.create("int8")
    a = chip.program(_w(64, 64), name="a")
    chip.free(a)
    with pytest.raises(RuntimeError, match="freed"):
        chip.linear(a, _w(2, 64, 1))


def test_chip_fragmented_free_tiles_are_usable():
    chip = sc.Chip.create("int8", tile__tiles_per_chip=4, tile__allow_multi_chip=False)
    rs = [chip.program(_w(256, 256, i), name=f"w{i}") for i in range(4)]
    chip.free(rs[0])
    chip.free(rs[2])
    assert chip.tiles_total - chip.tiles_in_use == 2
    res = chip.program(_w(512, 256), name="big")
    assert res.tiles == 2

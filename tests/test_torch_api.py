"""`torch.sidra` mirrors torch.cuda: availability, devices, seeds, properties,
memory statistics and OutOfMemoryError, timing events on the simulated clock;
plus the chip's own controls (chip selection, counters, capacity errors)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import sidra_core
import sidra_torch

from conftest_torch import D, DEV, Delta, assert_close, collect, ideal, int8, restore_chip, y1  # noqa: F401


# ---------------------------------------------------------------------------
# devices


def test_availability_and_device_count():
    assert torch.sidra.is_available() is True
    assert torch.sidra.is_initialized() is True
    assert torch.sidra.device_count() == 1
    assert torch.sidra.current_device() == 0


def test_set_device():
    torch.sidra.set_device(0)
    torch.sidra.set_device("sidra:0")
    torch.sidra.set_device(torch.device("sidra", 0))
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.sidra.set_device(1)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.sidra.set_device("sidra:1")
    with torch.sidra.device(0):
        assert torch.sidra.current_device() == 0
    with pytest.raises(RuntimeError):
        torch.sidra.device(1)


def test_synchronize():
    x = torch.randn(3, device=D) * 2
    assert torch.sidra.synchronize() is None
    assert torch.sidra.synchronize(0) is None
    assert torch.sidra.synchronize("sidra:0") is None
    with pytest.raises(RuntimeError):
        torch.sidra.synchronize(1)
    assert x.device == DEV


def test_device_name_and_capability():
    name = torch.sidra.get_device_name()
    assert isinstance(name, str) and "SIDRA" in name
    assert torch.sidra.get_device_name(0) == name
    assert torch.sidra.get_device_capability() == (1, 0)
    assert torch.sidra.is_bf16_supported()


def test_device_properties_follow_the_chip(restore_chip):
    with sidra_torch.use_chip("int8", tile__tiles_per_chip=4, tile__allow_multi_chip=False):
        p = torch.sidra.get_device_properties()
        assert p.preset == "int8"
        assert p.tiles == 4 and p.tiles_per_chip == 4 and p.chips == 1
        assert p.tile_shape == (256, 256)
        assert p.weight_capacity == 4 * 256 * 256
        assert p.total_memory == sidra_torch.current_chip().spec.memory.dram_bytes
        assert "int8" in torch.sidra.get_device_name()
    with sidra_torch.use_chip("ideal"):
        p = torch.sidra.get_device_properties(0)
        assert p.preset == "ideal" and p.tiles == sidra_torch.current_chip().tiles_total
        assert p.weight_capacity == p.tiles * 256 * 256
        assert p.engine_precision == "fp32"


# ---------------------------------------------------------------------------
# seeds


def test_manual_seed_and_initial_seed(restore_chip):
    torch.sidra.manual_seed(1234)
    assert torch.sidra.initial_seed() == 1234
    torch.sidra.manual_seed_all(99)
    assert torch.sidra.initial_seed() == 99
    sidra_torch.manual_seed(7)
    assert torch.sidra.initial_seed() == 7
    assert sidra_torch.current_chip().seed == 7
    seen = set()
    for _ in range(3):
        torch.sidra.seed()
        seen.add(torch.sidra.initial_seed())
    assert len(seen) == 3  # seed() draws a fresh random seed


def test_device_seed_makes_noise_reproducible(y1):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(D)
    x = torch.randn(8, 64, device=D)
    lin(x)  # program once: only the read noise differs between calls
    sidra_torch.manual_seed(11)
    a = lin(x).cpu()
    b = lin(x).cpu()
    sidra_torch.manual_seed(11)
    a2 = lin(x).cpu()
    torch.sidra.manual_seed(12)
    c = lin(x).cpu()
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)  # fresh read noise per call
    assert not torch.equal(a, c)


def test_rng_state_roundtrip(y1):
    torch.manual_seed(0)
    lin = nn.Linear(32, 16).to(D)
    x = torch.randn(4, 32, device=D)
    lin(x)
    state = torch.sidra.get_rng_state()
    a = lin(x).cpu()
    torch.sidra.set_rng_state(state)
    b = lin(x).cpu()
    assert torch.equal(a, b)


def test_same_seed_programs_the_same_chip_state(restore_chip):
    """ISPP and read noise come from the device seed: two runs from the same seed agree."""
    torch.manual_seed(0)
    base = nn.Linear(48, 24)
    x = torch.randn(4, 48)
    outs = []
    collect()  # weights left by earlier tests are freed first, so both copies get the same free tiles
    with sidra_torch.use_chip("y1"):
        for _ in range(2):
            sidra_torch.manual_seed(5)
            m = copy.deepcopy(base).to(D)
            with torch.no_grad():  # (an autograd graph would keep the weight alive)
                outs.append(m(x.to(D)).cpu())
            del m
            collect()  # free its tiles: the second copy lands on the same cells (same stuck cells)
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------
# memory


def test_memory_allocated_tracks_allocations(ideal):
    collect()
    m0 = torch.sidra.memory_allocated()
    a = torch.empty(1000, device=D)
    assert torch.sidra.memory_allocated() == m0 + 4000
    assert torch.sidra.memory_allocated(0) == m0 + 4000
    v = a[10:].view(-1, 10)  # views take no memory
    assert torch.sidra.memory_allocated() == m0 + 4000
    b = torch.randn(100, 10).to(D)
    c = a * 2
    assert torch.sidra.memory_allocated() == m0 + 4000 + 4000 + 4000
    del a, v
    collect()
    assert torch.sidra.memory_allocated() == m0 + 8000
    del b, c
    collect()
    assert torch.sidra.memory_allocated() == m0
    assert torch.sidra.memory_reserved() >= torch.sidra.memory_allocated()
    torch.sidra.empty_cache()
    free, total = torch.sidra.mem_get_info()
    assert total == torch.sidra.get_device_properties(0).total_memory
    a = torch.empty(1000, device=D)
    assert torch.sidra.mem_get_info() == (free - 4000, total)


def test_max_memory_allocated_and_reset_peak(ideal):
    collect()
    torch.sidra.reset_peak_memory_stats()
    m0 = torch.sidra.memory_allocated()
    assert torch.sidra.max_memory_allocated() == m0
    big = torch.empty(250_000, device=D)  # 1 MB
    assert torch.sidra.max_memory_allocated() == m0 + 1_000_000
    del big
    collect()
    assert torch.sidra.memory_allocated() == m0
    assert torch.sidra.max_memory_allocated() == m0 + 1_000_000  # the peak stays
    torch.sidra.reset_peak_memory_stats()
    assert torch.sidra.max_memory_allocated() == m0


def test_memory_summary(ideal):
    s = torch.sidra.memory_summary()
    assert isinstance(s, str) and "SIDRA" in s
    assert "ideal" in s and "allocated" in s and "tiles" in s
    assert isinstance(torch.sidra.memory_summary(0, abbreviated=True), str)


def test_memory_summary_reports_host_memory_per_programmed_weight(restore_chip):
    collect()
    with sidra_torch.use_chip("int8") as chip:
        lin = nn.Linear(256, 256).to(D)
        with torch.no_grad():
            lin(torch.randn(2, 256, device=D))
        host = chip.host_memory()
        s = torch.sidra.memory_summary()
        assert host["weights"] >= 256 * 256 and host["state_bytes"] > 0 and host["snapshot_bytes"] > 0
        per = host["state_bytes"] / host["weights"]
        assert f"{host['weights']:,} programmed weights ({per:.1f} B per weight of programmed state" in s


def test_model_memory_counted(ideal):
    collect()
    m0 = torch.sidra.memory_allocated()
    model = nn.Linear(100, 50).to(D)
    assert torch.sidra.memory_allocated() == m0 + (100 * 50 + 50) * 4
    del model
    collect()
    assert torch.sidra.memory_allocated() == m0


def _tiny_memory_chip():
    """A chip whose memory has 1 MiB free beyond what other live tensors already hold."""
    collect()
    return sidra_torch.use_chip("ideal", memory__dram_bytes=torch.sidra.memory_allocated() + (1 << 20))


def test_out_of_memory_error(restore_chip):
    with _tiny_memory_chip():
        before = torch.sidra.memory_allocated()
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            torch.empty(2 << 20, dtype=torch.uint8, device=D)
        assert torch.sidra.memory_allocated() == before
        with pytest.raises(torch.sidra.OutOfMemoryError):
            torch.zeros(1 << 19, device=D)  # 2 MB of float32
        with pytest.raises(torch.OutOfMemoryError):
            torch.randn(1 << 19).to(D)
        assert torch.sidra.memory_allocated() == before
        # what fits still works
        small = torch.ones(1000, device=D)
        assert torch.sidra.memory_allocated() == before + 4000
        assert small.sum().item() == 1000
    assert torch.OutOfMemoryError is torch.sidra.OutOfMemoryError
    assert issubclass(torch.OutOfMemoryError, RuntimeError)


def test_out_of_memory_from_an_op_result(restore_chip):
    with _tiny_memory_chip():
        x = torch.ones(1000, device=D)
        before = torch.sidra.memory_allocated()
        with pytest.raises(torch.OutOfMemoryError):
            x.repeat(1000)  # 4 MB result
        collect()
        assert torch.sidra.memory_allocated() == before


# ---------------------------------------------------------------------------
# events on the simulated clock


def test_event_elapsed_time_is_the_simulated_device_time(ideal):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(D)
    x = torch.randn(16, 64, device=D)
    start, end = torch.sidra.Event(enable_timing=True), torch.sidra.Event(enable_timing=True)
    t0 = sidra_torch.device_time()
    start.record()
    model(x)
    end.record()
    t1 = sidra_torch.device_time()
    torch.sidra.synchronize()
    end.synchronize()
    assert end.query()
    ms = start.elapsed_time(end)
    assert ms > 0
    assert ms == pytest.approx((t1 - t0) * 1e3, rel=1e-9)


def test_event_sees_advance(ideal):
    a, b = torch.sidra.Event(enable_timing=True), torch.sidra.Event(enable_timing=True)
    a.record()
    torch.sidra.advance(2.0)
    b.record()
    assert a.elapsed_time(b) == pytest.approx(2000.0, rel=1e-9)
    before = sidra_torch.device_time()
    assert sidra_torch.advance(0.5) == pytest.approx(before + 0.5)
    with pytest.raises(ValueError):
        sidra_torch.advance(-1.0)


def test_event_requires_timing_and_recording():
    a, b = torch.sidra.Event(), torch.sidra.Event()
    a.record()
    b.record()
    with pytest.raises(RuntimeError, match="enable_timing"):
        a.elapsed_time(b)
    c, d = torch.sidra.Event(enable_timing=True), torch.sidra.Event(enable_timing=True)
    c.record()
    with pytest.raises(RuntimeError, match="recorded"):
        c.elapsed_time(d)


# ---------------------------------------------------------------------------
# counters


def test_counters_keys_and_reset(ideal):
    x = torch.randn(8, 8, device=D)
    torch.relu(x @ x)
    torch.sort(x)
    c = torch.sidra.counters()
    for key in ("time_s", "energy_j", "mvms", "tile_reads", "engine_ops", "memory_ops", "pulses",
                "cells_programmed", "fallback_ops", "host_transfers", "host_bytes", "energy_host_j",
                "energy_engine_j", "energy_memory_j"):
        assert key in c, key
    assert c["engine_ops"] >= 2 and c["fallback_ops"] >= 1 and c["energy_j"] > 0
    now = sidra_torch.device_time()
    torch.sidra.reset_counters()
    c = torch.sidra.counters()
    assert all(v == 0 for k, v in c.items()), c
    # the clock itself never goes back: programmed cells keep drifting
    assert sidra_torch.device_time() == pytest.approx(now)


def test_counters_are_per_chip(restore_chip):
    with sidra_torch.use_chip("ideal"):
        torch.sidra.reset_counters()
        torch.relu(torch.randn(4, device=D))
        ideal_ops = torch.sidra.counters()["engine_ops"]
        with sidra_torch.use_chip("int8"):
            torch.sidra.reset_counters()
            assert torch.sidra.counters()["engine_ops"] == 0
        assert torch.sidra.counters()["engine_ops"] == ideal_ops >= 1


# ---------------------------------------------------------------------------
# chip selection


def test_default_chip_is_y1():
    assert sidra_core.preset("y1").name == "y1"
    # what a fresh process gets: current_chip() creates y1 when nothing was chosen
    from sidra_torch import runtime

    saved = runtime._STATE.chip
    try:
        runtime._STATE.chip = None
        assert sidra_torch.current_chip().spec.name == "y1"
    finally:
        runtime._STATE.chip = saved


def test_set_chip(restore_chip):
    chip = sidra_torch.set_chip("int8")
    assert chip is sidra_torch.current_chip()
    assert chip.spec.name == "int8"
    assert torch.sidra.get_device_properties().preset == "int8"
    torch.sidra.set_chip("ideal")
    assert sidra_torch.current_chip().spec.name == "ideal"
    assert torch.sidra.current_chip().spec.name == "ideal"


def test_use_chip_restores_the_previous_chip(restore_chip):
    sidra_torch.set_chip("ideal")
    prev = sidra_torch.current_chip()
    with sidra_torch.use_chip("int8") as chip:
        assert sidra_torch.current_chip() is chip and chip.spec.name == "int8"
        with torch.sidra.use_chip("y1"):
            assert sidra_torch.current_chip().spec.name == "y1"
        assert sidra_torch.current_chip() is chip
    assert sidra_torch.current_chip() is prev
    with pytest.raises(KeyError):
        with sidra_torch.use_chip("int8"):
            raise KeyError("boom")
    assert sidra_torch.current_chip() is prev


def test_chip_overrides(restore_chip):
    with sidra_torch.use_chip("int8", adc__bits=6) as chip:
        assert chip.spec.adc.bits == 6 and chip.spec.name == "int8"
    with pytest.raises(ValueError):
        with sidra_torch.use_chip("int8", adc__no_such_field=1):
            pass
    with pytest.raises(ValueError, match="unknown chip preset"):
        sidra_torch.set_chip("no-such-preset")


def test_chip_spec_object(restore_chip):
    spec = sidra_core.preset("int8", adc__bits=7)
    chip = sidra_torch.set_chip(spec)
    assert chip.spec == spec and chip.spec.adc.bits == 7
    with sidra_torch.use_chip(spec, dac__bits=6) as c2:
        assert c2.spec.adc.bits == 7 and c2.spec.dac.bits == 6


@pytest.mark.parametrize("as_path", [False, True], ids=["str", "Path"])
def test_chip_from_toml(restore_chip, tmp_path, as_path):
    f = tmp_path / "my_chip.toml"
    f.write_text('preset = "int8"\n\n[adc]\nbits = 6\n')
    chip = sidra_torch.set_chip(f if as_path else str(f))
    assert chip.spec.adc.bits == 6
    assert chip.spec.ispp.enabled is False  # from the int8 preset
    assert torch.sidra.get_device_properties().adc_bits == 6
    # and it computes
    lin = nn.Linear(16, 4).to(D)
    assert lin(torch.randn(2, 16, device=D)).shape == (2, 4)
    with sidra_torch.use_chip(str(f), adc__bits=5) as c2:
        assert c2.spec.adc.bits == 5


def test_switching_back_keeps_programmed_weights(restore_chip):
    torch.manual_seed(0)
    lin = nn.Linear(32, 16).to(D)
    x = torch.randn(2, 32, device=D)
    with sidra_torch.use_chip("int8"):
        lin(x)
    with sidra_torch.use_chip("ideal"):
        lin(x)
    with sidra_torch.use_chip("int8"):
        with Delta() as d:
            lin(x)
        assert d["cells_programmed"] == 0 and d["mvms"] == 1


def test_chips_compute_differently(restore_chip):
    torch.manual_seed(0)
    cpu = nn.Linear(128, 64)
    dev = copy.deepcopy(cpu).to(D)
    x = torch.randn(8, 128)
    ref = cpu(x)
    out = {}
    for name in ("ideal", "int8", "y1"):
        with sidra_torch.use_chip(name):
            sidra_torch.manual_seed(0)
            out[name] = dev(x.to(D)).detach().cpu()
    assert (out["ideal"] - ref).abs().max() < 1e-5
    rel = {k: ((v - ref).norm() / ref.norm()).item() for k, v in out.items()}
    assert 1e-4 < rel["int8"] < 0.1, rel  # INT8 weights/inputs and the ADC
    assert rel["int8"] < rel["y1"] < 0.2, rel  # ... plus the analog noise
    with sidra_torch.use_chip("int8"):
        assert torch.equal(dev(x.to(D)).detach().cpu(), out["int8"])  # int8 is deterministic


# ---------------------------------------------------------------------------
# capacity


def _small_chip():
    return sidra_torch.use_chip("int8", tile__tiles_per_chip=4, tile__allow_multi_chip=False)


def test_model_larger_than_the_chip_raises(restore_chip):
    collect()
    with _small_chip() as chip:
        big = nn.Linear(1024, 1024).to(D)
        x = torch.randn(1, 1024, device=D)
        tiles0 = chip.tiles_in_use
        with Delta() as d:
            with pytest.raises(sidra_core.ChipCapacityError) as exc:
                big(x)
        msg = str(exc.value)
        assert "16" in msg and "4" in msg and "tiles" in msg, msg
        assert isinstance(exc.value, RuntimeError)
        assert chip.tiles_in_use == tiles0
        assert all(d[k] == 0 for k in ("mvms", "cells_programmed", "pulses", "energy_j", "time_s")), d
        # a smaller model still runs
        small = nn.Linear(256, 256).to(D)
        assert small(torch.randn(1, 256, device=D)).shape == (1, 256)
        assert chip.tiles_in_use == tiles0 + 1


def test_capacity_is_checked_for_the_whole_model_first(restore_chip):
    collect()
    with _small_chip() as chip:
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).to(D)  # 4 + 4 tiles
        tiles0 = chip.tiles_in_use
        with Delta() as d:
            with pytest.raises(sidra_core.ChipCapacityError, match="8"):
                model(torch.randn(1, 512, device=D))
        assert chip.tiles_in_use == tiles0  # nothing was partly programmed
        assert d["cells_programmed"] == 0
        ok = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(D)
        ok(torch.randn(1, 256, device=D))
        assert chip.tiles_in_use == tiles0 + 2


def test_a_model_too_large_for_the_hosts_memory_is_refused_before_programming(restore_chip, monkeypatch):
    collect()
    from sidra_core import host

    with sidra_torch.use_chip("int8") as chip:
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).to(D)
        w0 = model[0].weight.detach().cpu().clone()
        tiles0 = chip.tiles_in_use
        monkeypatch.setattr(host, "available_memory", lambda: 1 << 20)
        with Delta() as d:
            with pytest.raises(sidra_core.HostMemoryError, match=r"needs 1,808,793 bytes \(1\.7 MiB\) of host memory.*524,288 weights"
                                                                 r".*1\.0 MiB is available"):
                model(torch.randn(1, 512, device=D))
        assert chip.tiles_in_use == tiles0 and d["cells_programmed"] == 0
        assert torch.equal(model[0].weight.detach().cpu(), w0)
        monkeypatch.undo()
        assert model(torch.randn(1, 512, device=D)).shape == (1, 512)  # the same model, once memory is there


def test_capacity_error_for_a_bare_weight(restore_chip):
    collect()
    with _small_chip() as chip:
        w = nn.Parameter(torch.randn(1024, 512).to(D))
        tiles0 = chip.tiles_in_use
        with pytest.raises(sidra_core.ChipCapacityError):
            torch.randn(2, 1024, device=D) @ w
        assert chip.tiles_in_use == tiles0


def test_multi_chip_mapping_fits_a_larger_model(restore_chip):
    with sidra_torch.use_chip("ideal", tile__tiles_per_chip=4, tile__chips=4, tile__allow_multi_chip=True) as chip:
        torch.manual_seed(0)
        cpu = nn.Linear(1024, 1024)
        dev = copy.deepcopy(cpu).to(D)
        x = torch.randn(2, 1024)
        assert_close(dev(x.to(D)), cpu(x), rtol=1e-4, atol=1e-4)
        assert chip.tiles_in_use >= 16


def test_manual_seed_keeps_the_same_physical_chip(restore_chip):
    torch.manual_seed(0)
    lin = nn.Linear(32, 8).to(D)
    x = torch.randn(2, 32, device=D)
    with sidra_torch.use_chip("int8") as first:
        lin(x)
    sidra_torch.manual_seed(1234)
    with sidra_torch.use_chip("int8") as again:
        with Delta() as d:
            lin(x)
    assert again is first
    assert d["cells_programmed"] == 0

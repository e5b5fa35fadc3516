"""The device profiler: per-op records, totals equal to the device counters, table, chrome trace, ranges."""

import json

import pytest
import torch
import torch.nn as nn

import sidra_torch


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).to("sidra:0")


@pytest.mark.parametrize("chip", ["int8", "y1"])  # y1 adds background power over busy time
def test_profiler_totals_equal_the_device_counters(tmp_path, chip):
    m = _model()
    x = torch.randn(4, 32)
    with sidra_torch.use_chip(chip):
        c0 = torch.sidra.counters()
        with sidra_torch.profiler.profile() as prof:
            with torch.profiler.record_function("my_block"):
                y = m(x.to("sidra:0"))
            y.softmax(-1).cpu()
            torch.zeros(3, device="sidra:0")
        c1 = torch.sidra.counters()
    ka = prof.key_averages()
    assert ka.total.latency_s == pytest.approx(c1["busy_s"] - c0["busy_s"], rel=1e-9)
    assert ka.total.energy_j == pytest.approx(c1["energy_j"] - c0["energy_j"], rel=1e-9)
    for comp in ("array", "adc", "engine", "host", "programming", "background"):
        assert getattr(ka.total, comp) == pytest.approx(c1[f"energy_{comp}_j"] - c0[f"energy_{comp}_j"], rel=1e-9)
    assert (ka.total.background > 0) == (chip == "y1")
    rows = {s.name: s for s in ka}
    assert rows["sidra::addmm"].where == "crossbar" and rows["sidra::addmm"].calls == 2
    assert rows["sidra::gelu"].where == "engine" and rows["sidra::_to_copy"].where == "host"
    assert rows["my_block"].where == "user range"
    # the user range encloses the ops inside it: at least the two crossbar MVMs
    assert rows["my_block"].device_time_total >= rows["sidra::addmm"].device_time_total
    # the table adds up: per-row device totals sum to the total (user ranges aside)
    ops = [s for s in ka if s.where != "user range"]
    assert sum(s.device_time_total for s in ops) == pytest.approx(ka.total.latency_s, rel=1e-9)
    table = ka.table(sort_by="device_time_total", row_limit=5)
    for col in ("Name", "Where", "Device total", "Energy", "Host bytes", "Energy by component"):
        assert col in table
    assert table.count("sidra::") + table.count("my_block") <= 5
    with pytest.raises(ValueError, match="sort_by"):
        ka.table(sort_by="nope")
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(prof.records) + len(prof.ranges)  # one event per device op, plus ranges
    assert sum(e["dur"] for e in events if e["cat"] != "user range") == pytest.approx(ka.total.latency_s * 1e6)


def test_device_ops_show_under_torch_profiler():
    from torch.profiler import ProfilerActivity, profile

    m = _model()
    x = torch.randn(4, 32).to("sidra:0")
    with sidra_torch.use_chip("ideal"), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.SIDRA]) as p:
        m(x)
    rows = {e.key: e for e in p.key_averages()}
    assert {"sidra::addmm", "sidra::gelu", "sidra::native_layer_norm"} <= set(rows)
    # each device op is a kernel of its CPU range, as CUDA's kernels are of the ops that launch them
    for op in ("addmm", "gelu", "native_layer_norm"):
        assert rows[op].device_type == torch.autograd.DeviceType.PrivateUse1
        assert rows[op].device_time_total > 0
        assert rows["sidra::" + op].device_time_total == pytest.approx(rows[op].device_time_total)
    assert rows["addmm"].count == 2


def test_torch_profiler_times_device_ops_on_the_device_clock():
    """The SIDRA activity alone: one event per device op, lasting the op's simulated device time."""
    from torch.profiler import ProfilerActivity, profile

    m = _model()
    x = torch.randn(4, 32).to("sidra:0")
    with torch.no_grad():
        m(x)  # programmed
        before = torch.sidra.device_time()
        with profile(activities=[ProfilerActivity.SIDRA]) as p:
            m(x)
        spent = torch.sidra.device_time() - before
    rows = {e.key: e for e in p.key_averages()}
    assert set(rows) == {"addmm", "gelu", "native_layer_norm"}
    assert all(e.device_type == torch.autograd.DeviceType.PrivateUse1 for e in rows.values())
    assert sum(e.self_device_time_total for e in rows.values()) == pytest.approx(spent * 1e6, rel=1e-6)
    assert rows["addmm"].count == 2 and min(e.device_time_total for e in rows.values()) > 0


def test_a_profile_without_the_device_activity_leaves_no_device_events():
    from torch.profiler import ProfilerActivity, profile

    from sidra_torch import tensor as _t

    m, x = _model(), torch.randn(4, 32).to("sidra:0")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        m(x)
    assert all(e.device_type == torch.autograd.DeviceType.CPU for e in p.events())
    assert "sidra::addmm" in {e.key for e in p.key_averages()} and not _t.torch_profiled


def test_only_one_profiler_records_at_a_time():
    with sidra_torch.profiler.profile():
        with pytest.raises(RuntimeError, match="already recording"):
            with sidra_torch.profiler.profile():
                pass


def test_both_bridges_record_into_the_one_profiler_of_sidra_core(tmp_path):
    """sidra_torch's and sidra_jax's profilers are sidra_core.report.Recording: one table and one
    timeline from both; sidra_jax's host time is per call (one program), torch's per op."""
    import jax.numpy as jnp
    import numpy as np

    import sidra_core
    import sidra_jax
    from sidra_core.report import KeyAverages, Recording

    assert issubclass(sidra_torch.profiler.profile, Recording) and issubclass(sidra_jax.profile, Recording)
    chip = sidra_core.Chip.create("int8", seed=0)
    params = sidra_jax.program({"w": jnp.asarray(np.ones((32, 8), np.float32))}, chip)
    f = sidra_jax.jit(lambda p, x: jnp.tanh(x @ p["w"]))
    with sidra_jax.profile() as jprof:
        f(params, jnp.ones((4, 32)))
    with sidra_torch.profiler.profile() as tprof:
        _model()(torch.randn(4, 32).to("sidra:0"))
    for prof in (jprof, tprof):
        ka = prof.key_averages()
        assert isinstance(ka, KeyAverages) and ka.total.latency_s > 0 and prof.compiles is not None
        prof.export_chrome_trace(str(tmp_path / "trace.json"))
        assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert jprof.key_averages().host_s == jprof.host_s > 0 and tprof.host_s is None

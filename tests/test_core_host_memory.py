"""Host memory of programmed weights: what a programmed state holds per cell, the report of a chip's
programmed weights, and the up-front refusal of a model whose state would not fit the host."""

from __future__ import annotations

import numpy as np
import pytest

import sidra_core as sc
from sidra_core import cells as cells_, crossbar, host


@pytest.mark.parametrize("preset", ["y1", "int8", "ideal"])
def test_the_per_cell_figure_is_what_a_programmed_weight_holds(preset):
    spec = sc.preset(preset)
    w = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32) / 10
    st = sc.program(w, spec, seed=1)
    cells = st.grid.k_padded * st.grid.n_padded
    expect = crossbar.state_bytes_per_cell(spec) * cells
    # the code, two int8 residuals and two drift bits, and 1 % of each plane's cells held exactly (10
    # bytes each); float mode: the float weight, two float32 conductances and the bits (sidra_core.cells)
    assert crossbar.state_bytes_per_cell(spec) == (12.25 if preset == "ideal" else 3.45)
    fixed = (12.25 if preset == "ideal" else 3.25) * cells
    exceptions = sum(g.idx.size for g in st.g if isinstance(g, cells_.Residuals))
    assert exceptions <= crossbar.EXCEPTIONS_ALLOWED * 2 * cells
    if preset == "int8":  # exact writes: every cell at its code's target
        assert exceptions == 0
    # beyond the per-cell arrays only the exceptions, per-column arrays (scale, ADC ranges) and per-tile
    # write counts
    extra = 10 * exceptions + 16 * st.grid.n_padded * st.grid.grid_k
    assert fixed <= st.host_bytes <= fixed + extra and st.host_bytes <= expect + extra


def test_a_broadcast_array_holds_only_what_it_stores():
    one = np.broadcast_to(np.float32(3.0), (512, 256))
    assert crossbar.held_bytes(one) == 4 and crossbar.held_bytes(np.zeros((4, 8), np.int32)) == 128
    assert crossbar.held_bytes(np.broadcast_to(np.zeros((1, 8), np.int8), (5, 8))) == 8


def test_the_chip_reports_its_programmed_weights_host_memory():
    chip = sc.Chip.create("y1", seed=0)
    w = np.random.default_rng(1).standard_normal((256, 128)).astype(np.float32) / 10
    res = chip.program(w, name="w")
    before = chip.host_memory()
    assert before["weights"] == 256 * 128 and before["state_bytes"] == res.state.host_bytes
    assert before["snapshot_bytes"] == 0
    chip.linear(res, np.ones((2, 256), np.float32))
    after = chip.host_memory()
    assert after["snapshot_bytes"] == res.snap.host_bytes > 0
    chip.free(res)
    assert chip.host_memory() == {"weights": 0, "state_bytes": 0, "snapshot_bytes": 0}


def test_a_model_too_large_for_the_host_is_refused_up_front(monkeypatch):
    chip = sc.Chip.create("y1", seed=0)
    shapes = [(768, 3072), (3072, 768)]
    need = int(crossbar.state_bytes_per_cell(chip.spec) * 2 * 768 * 3072)
    monkeypatch.setattr(host, "available_memory", lambda: need - 1)
    with pytest.raises(sc.HostMemoryError, match=rf"model needs {need:,} bytes \(15\.5 MiB\) of host memory .*"
                                                  r"4,718,592 weights on 72 tiles, 3\.45 bytes per cell pair.*"
                                                  r"15\.5 MiB is available"):
        chip.check_fits(shapes)
    assert chip.tiles_in_use == 0 and chip.residents == []
    monkeypatch.setattr(host, "available_memory", lambda: need)
    chip.check_fits(shapes)  # exactly enough
    monkeypatch.setattr(host, "available_memory", lambda: None)  # unknown: not refused
    chip.check_fits(shapes)


def test_the_host_says_how_much_memory_is_available():
    free = host.available_memory()
    assert free is None or free > 0

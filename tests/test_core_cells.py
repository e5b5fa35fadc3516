"""How a programmed weight's cells are held (sidra_core.cells): drift exponents and stuck maps drawn
again from their streams equal the ones the programming drew, conductances held as residuals of the
codes keep every code's target exactly and the programming error's statistics, rewritten cells keep
their own times and counts, and a model's state costs a few bytes per weight."""

from __future__ import annotations

import numpy as np
import pytest

import sidra_core as sc
from sidra_core import cells, crossbar, host

needs_native = pytest.mark.skipif(not host.native_ispp(), reason="no native programming on this host")


def _weight(k=300, n=200, seed=0):
    return np.random.default_rng(seed).normal(0, 0.05, (k, n)).astype(np.float32)


def _program_xla(monkeypatch, w, spec, **kw):
    monkeypatch.setenv("SIDRA_NATIVE_ISPP", "0")
    return crossbar.program(w, spec, **kw)


@needs_native
@pytest.mark.parametrize("preset", ["y1", "pcm"])
def test_derived_exponents_and_stuck_maps_are_the_ones_the_programming_drew(preset):
    """The native programming draws every cell's exponent and stuck state in its own pass; the state
    keeps neither, and draws them again to the same bits."""
    spec = sc.preset(preset).replace(noise__stuck_off_rate=0.01, noise__stuck_on_rate=0.01)
    tiles = (5, 2)  # physical tiles out of order
    st = crossbar.program(_weight(), spec, seed=3, t_now=2.0, tile_ids=tiles)
    codes = crossbar._pad(sc.quant.quantise_weight(_weight(), spec).codes, st.grid)
    g, _, nu, stuck, pulses, bits = crossbar.native_planes(st.grid, codes, tiles, spec, seed=3, drifts=True)
    for plane in (0, 1):
        np.testing.assert_array_equal(bits[plane], st.drifts[plane])
        held = st.levels.compress(st.levels.encode(g[plane]), codes, plane)
        for got, want in zip((st.g[plane].r, st.g[plane].idx, st.g[plane].level), (held.r, held.idx, held.level)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(st.exponents(plane), nu[plane])
        np.testing.assert_array_equal(st.stuck(plane), stuck[plane])
        assert (nu[plane] > 0).mean() > 0.2 and (stuck[plane] != 0).mean() > 0.01
        # the per-tile write count bounds every cell's pulses, and is reached in each tile
        bound = st.write_counts(plane)
        assert (bound >= pulses[plane]).all()
        np.testing.assert_array_equal(cells.tile_max(bound, st.grid), cells.tile_max(pulses[plane], st.grid))
    # so a drifted read is the one of the drawn exponents, bit for bit
    age = np.float32(np.log1p(1000.0 / spec.noise.drift_t0))
    want = crossbar._drift_kernel(st.g_plus, st.g_minus, nu[0], nu[1], age, age)
    for got, expect in zip(crossbar.drifted(st, 1002.0, spec), want):
        np.testing.assert_array_equal(got, np.asarray(expect))


def test_derived_exponents_follow_the_xla_programmings_draws(monkeypatch):
    """On the XLA path, too: an exponent for each cell written and not stuck, from the programming's stream."""
    spec = sc.preset("pcm").replace(noise__stuck_off_rate=0.02)
    st = _program_xla(monkeypatch, _weight(), spec, seed=4)
    ids = crossbar._cell_ids(st.grid, st.tile_ids)
    for plane in (0, 1):
        draws = crossbar._nu(ids, plane, 4, spec)
        nu = st.exponents(plane)
        drifting = nu != 0
        np.testing.assert_array_equal(nu[drifting], draws[drifting])
        assert not drifting[st.stuck(plane) != 0].any()
        assert not drifting[st.write_counts(plane) == 0].any()


@pytest.mark.parametrize("preset", ["int8", "y1"])
def test_residuals_hold_every_code_exactly(preset):
    """Every code's target conductance is a level, held as a residual of 0: an exact chip's cells
    read back as its targets."""
    spec = sc.preset(preset)
    levels = crossbar._levels(spec)
    codes = np.arange(-127, 128, dtype=np.int8)[None, :]
    tp, tm = crossbar._conductance_pair(codes, None, spec)
    for plane, t in enumerate((tp, tm)):
        np.testing.assert_array_equal(levels.decode(levels.encode(t)), t)
        held = levels.compress(levels.encode(t), codes, plane)
        assert not held.r.any() and held.idx.size == 0
        np.testing.assert_array_equal(levels.decode(levels.expand(held, codes, plane)), t)
    if preset == "int8":  # no programming noise: the stored state is the targets, to the bit
        st = sc.program(_weight(), spec, seed=1)
        tp, tm = crossbar._conductance_pair(st.codes, None, spec)
        np.testing.assert_array_equal(st.g_plus, tp)
        np.testing.assert_array_equal(st.g_minus, tm)


def test_residuals_keep_the_programming_errors_statistics(monkeypatch):
    """Held as residuals, a programmed G is within half a level and half a residual step (1/64 code on
    y1) of the written one, so the programmed-weight error keeps its spread and bias."""
    spec = sc.preset("y1")
    w = _weight(512, 256)
    st = crossbar.program(w, spec, seed=2)
    levels = st.levels
    ids = crossbar._cell_ids(st.grid, st.tile_ids)
    stuck = (st.stuck(0, ids), st.stuck(1, ids))
    start = tuple(np.where(s > 0, np.float32(spec.tile.g_max), np.float32(spec.tile.g_min)).astype(np.float32)
                  for s in stuck)
    targets = crossbar._pair_targets(st.codes, None, stuck, start, spec)
    dg = (spec.tile.g_max - spec.tile.g_min) / 127
    errors = []
    for plane in (0, 1):
        pulses, g = crossbar._write_cells(start[plane].ravel(), targets[plane].ravel(), stuck[plane].ravel(),
                                          ids.ravel(), None, spec, crossbar._write_seed(2, plane))
        held = st.conductances(plane).ravel()
        bound = levels.step * (0.5 + 2 ** (levels.shift - 1)) + 2 * np.spacing(np.float32(spec.tile.g_max))
        assert np.abs(held - g).max() <= bound
        ok = stuck[plane].ravel() == 0
        errors.append(((g - targets[plane].ravel())[ok] / dg, (held - targets[plane].ravel())[ok] / dg))
    for full, kept in errors:
        assert kept.std() == pytest.approx(full.std(), rel=1e-3)
        assert abs(kept.mean() - full.mean()) < 1e-4


def test_the_residual_step_follows_the_verify_window_and_exceptions_keep_their_levels():
    """Steps of at most 1/32 of the write-verify window (16 levels, 1/32 code, on y1; one level for
    a window under 32 levels); a level no residual reaches is held exactly; ties round to even."""
    y1 = sc.preset("y1")
    assert crossbar._levels(y1).shift == 4
    assert crossbar._levels(y1.replace(ispp__tolerance=1e-4)).shift == 0
    assert crossbar._levels(y1.replace(ispp__enabled=False)).shift == 0
    lv = crossbar._levels(y1)
    codes = np.array([[0, 3, -3, 127, 1, 1, 1, 5, 5]], np.int8)
    # plus plane levels: two codes' targets, a stuck-at-G_max cell, far below, +8 and +24 levels (ties
    # to 0 and 2 steps), +9, -127 steps and -127.5 (to -128: no residual)
    q = np.array([[0, 3 * 512, 65024, 0, 512 + 8, 512 + 24, 512 + 9, 2560 - 2032, 2560 - 2040]], np.uint16)
    held = lv.compress(q, codes, 0)
    np.testing.assert_array_equal(held.idx, [2, 3, 8])
    np.testing.assert_array_equal(held.level, q[0, [2, 3, 8]])
    np.testing.assert_array_equal(held.r[0, [0, 1, 4, 5, 6, 7]], [0, 0, 0, 2, 1, -127])
    back = lv.expand(held, codes, 0)
    np.testing.assert_array_equal(back[0, [0, 1, 2, 3, 7, 8]], q[0, [0, 1, 2, 3, 7, 8]])
    np.testing.assert_array_equal(back[0, 4:7], [512, 512 + 32, 512 + 16])


def test_rewritten_cells_keep_their_own_write_times_counts_and_exponents():
    """Incremental reprogramming writes a few cells; they alone get their own record."""
    spec = sc.preset("y1")
    w = _weight(256, 256, seed=5)
    st = crossbar.program(w, spec, seed=1, t_now=1.0)
    w2 = w.copy()
    w2[:32] *= 0.5
    st2 = crossbar.reprogram(st, w2, spec, seed=9, t_now=50.0)
    ids = crossbar._cell_ids(st.grid, st.tile_ids)
    for plane in (0, 1):
        r = st2.rewrites[plane]
        written = np.zeros(st.grid.k_padded * st.grid.n_padded, bool)
        written[r.idx] = True
        written = written.reshape(st.grid.k_padded, st.grid.n_padded)
        assert 0 < written.sum() < 0.2 * written.size and not written[32:].any()
        t = st2.times(plane)
        assert (t[written] == 50.0).all() and (t[~written] == 1.0).all()
        before, after = st.write_counts(plane), st2.write_counts(plane)
        assert (after[written] > before[written]).all()
        np.testing.assert_array_equal(after[~written], before[~written])
        nu_before, nu_after = st.exponents(plane), st2.exponents(plane)
        np.testing.assert_array_equal(nu_after[~written], nu_before[~written])
        fresh = crossbar._nu(ids[written], plane, 9, spec) * (st.stuck(plane)[written] == 0)
        np.testing.assert_array_equal(nu_after[written], fresh)
    assert st2.programming.cells_written == len(st2.rewrites[0]) + len(st2.rewrites[1])
    assert not st2.written_at_once and st2.t_latest == 50.0
    # a later write of some of the same cells keeps one record each, the newest
    st3 = crossbar.reprogram(st2, w2 * 0.9, spec, seed=10, t_now=80.0)
    for plane in (0, 1):
        r = st3.rewrites[plane]
        assert np.all(np.diff(r.idx) > 0)
        again = np.isin(st2.rewrites[plane].idx, r.idx[r.t_prog == 80.0])
        assert again.any()


def test_rewrites_merge_keeps_the_newest_record():
    r = cells.Rewrites.none().merged(np.array([3, 7]), 1.0, np.array([5, 6]), np.array([0.1, 0.2]))
    r = r.merged(np.array([1, 7]), 2.0, np.array([9, 8]), np.array([0.3, 0.4]))
    np.testing.assert_array_equal(r.idx, [1, 3, 7])
    np.testing.assert_array_equal(r.t_prog, np.float32([2.0, 1.0, 2.0]))
    np.testing.assert_array_equal(r.writes, [9, 5, 8])
    np.testing.assert_allclose(r.nu, [0.3, 0.1, 0.4])


def test_a_models_programmed_state_costs_a_few_bytes_per_weight():
    """A mid-size encoder (13 M programmed weights) on y1: its programmed state and read snapshots per
    weight, as the chip counts its arrays (the layout that stored every per-cell property held 27 B
    of state)."""
    import torch
    from transformers import BertConfig, BertModel

    import sidra_torch

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048,
                     vocab_size=1000)
    model = BertModel(cfg).eval()
    with sidra_torch.use_chip("y1", seed=0):
        before = sidra_torch.current_chip().host_memory()  # (what earlier tests left on the chip)
        model.to("sidra:0")
        with torch.inference_mode():
            model(input_ids=torch.randint(0, 1000, (1, 16)).to("sidra:0")).last_hidden_state.cpu()
        after = sidra_torch.current_chip().host_memory()
    held = {key: after[key] - before[key] for key in after}
    assert held["weights"] >= 4 * (4 * 512 * 512 + 2 * 512 * 2048) + 512 * 512
    state = held["state_bytes"] / held["weights"]
    snaps = held["snapshot_bytes"] / held["weights"]
    assert state <= 3.5, state
    # a snapshot holds each weight as int8 (whole, fraction) codes and a variance level (3 B), where
    # the host reads int8 weights; else as float32 pairs and float32 variances (12 B)
    int8_reads = host.vnni_dots() or host.LOW_PRECISION_DOTS
    assert snaps <= (3.2 if int8_reads else 12.5), snaps

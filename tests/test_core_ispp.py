"""ISPP write-verify: pulse counts, residual error, stuck cells, incremental reprogramming, endurance."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import sidra_core as sc
from sidra_core import program_cells

Y1 = sc.preset("y1")
T = Y1.tile
SPAN = T.g_max - T.g_min
TOL = Y1.ispp.tolerance * T.g_max
YEAR = 365.25 * 86400.0


def _cells(frac, n=20000, start=None):
    g0 = np.full(n, T.g_min if start is None else start, np.float32)
    gt = np.full(n, T.g_min + frac * SPAN, np.float32)
    return g0, gt


def _run(g0, gt, spec, seed=0, stuck=None, ids=None):
    n = g0.size
    stuck = np.zeros(n, bool) if stuck is None else stuck
    ids = np.arange(n, dtype=np.uint32) if ids is None else ids
    return program_cells(g0, gt, stuck, ids, spec, seed)


def test_pulse_counts():
    spec = Y1.replace(noise__prog_relax_sigma=0.0)
    means = []
    for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
        r = _run(*_cells(frac), spec, seed=1)
        assert r.pulses.dtype == np.int32 and r.pulses.min() >= 1  # every cell starts outside the window
        assert r.pulses.max() <= spec.ispp.max_pulses
        assert r.total_pulses == int(r.pulses.sum())
        means.append(r.pulses.mean())
    means = np.array(means)
    # mid targets take a handful of pulses; farther targets take more (20000 cells: sd of a mean < 0.05)
    assert np.all((means[1:4] >= 3) & (means[1:4] <= 15)), means
    assert np.all(np.diff(means) > 0.5), means


def test_cells_at_target_take_no_pulse():
    spec = Y1.replace(noise__read_sigma=0.0, noise__prog_relax_sigma=0.0)
    rng = np.random.default_rng(0)
    g = (T.g_min + rng.uniform(0, 1, 5000) * SPAN).astype(np.float32)
    r = _run(g, g, spec)
    assert np.all(r.pulses == 0)
    np.testing.assert_allclose(r.g, g, rtol=1e-6)  # unchanged up to float32 rounding of the normalisation
    # within tolerance already: no pulse
    r = _run(g, np.clip(g + 0.9 * TOL * rng.uniform(-1, 1, g.size), T.g_min, T.g_max).astype(np.float32), spec)
    assert np.all(r.pulses == 0)
    # with read noise, cells at G_min (noise 0.75 % of 0.5 uS << tolerance 0.4 uS) still pass
    r = _run(*_cells(0.0), Y1.replace(noise__prog_relax_sigma=0.0))
    assert np.all(r.pulses == 0)


def test_untouched_cells_do_not_relax():
    """Relaxation applies to written cells only: a mix of at-target and far cells."""
    g0, gt = _cells(0.5, 2000)
    gt[:1000] = g0[:1000]
    r = _run(g0, gt, Y1)
    assert np.all(r.pulses[:1000] == 0) and np.all(r.pulses[1000:] > 0)
    np.testing.assert_allclose(r.g[:1000], g0[:1000], rtol=1e-6)  # relaxation would move them by ~1 %


@pytest.mark.parametrize("case", ["empty", "all_at_target"])
def test_program_cells_when_no_cell_moves(case):
    n = 0 if case == "empty" else 1000
    g = np.full(n, T.g_min, np.float32)
    r = _run(g, g, Y1)
    assert r.g.shape == (n,) and r.pulses.shape == (n,) and r.total_pulses == 0


def test_final_error_within_tolerance():
    exact = Y1.replace(noise__prog_relax_sigma=0.0, noise__read_sigma=0.0)
    noisy = Y1.replace(noise__prog_relax_sigma=0.0)
    for frac in (0.2, 0.5, 0.9):
        g0, gt = _cells(frac)
        r = _run(g0, gt, exact, seed=2)
        ok = r.pulses < exact.ispp.max_pulses
        assert ok.mean() > 0.999
        # an exact verify read stops only inside the window
        assert np.all(np.abs(r.g[ok] - gt[ok]) <= TOL * (1 + 1e-4))
        # a noisy verify read (0.75 % of G) lets some cells stop just outside; most are inside,
        # nearly all within twice the tolerance (20000 cells: fractions known to < 0.5 %)
        r = _run(g0, gt, noisy, seed=2)
        e = np.abs(r.g - gt)
        assert (e <= TOL).mean() > 0.7
        assert (e <= 2 * TOL).mean() > 0.98
        assert abs(np.mean(r.g - gt)) < 0.5 * TOL  # no large bias


def test_downward_programming():
    spec = Y1.replace(noise__prog_relax_sigma=0.0, noise__read_sigma=0.0)
    g0, gt = _cells(0.2, start=T.g_max)
    r = _run(g0, gt, spec)
    assert np.all(r.pulses >= 1)
    ok = r.pulses < spec.ispp.max_pulses
    assert np.all(np.abs(r.g[ok] - gt[ok]) <= TOL * (1 + 1e-4))


def test_stuck_cells():
    spec = Y1.replace(noise__prog_relax_sigma=0.0)
    n = 2000
    g0, gt = _cells(0.5, n)
    stuck = np.zeros(n, bool)
    stuck[::10] = True
    r = _run(g0, gt, spec, stuck=stuck)
    assert np.all(r.pulses[stuck] == spec.ispp.max_pulses)
    np.testing.assert_array_equal(r.g[stuck], g0[stuck])  # never moves
    assert np.all(r.pulses[~stuck] < spec.ispp.max_pulses)
    # a stuck cell already within tolerance of its target passes the first verify
    r = _run(g0, g0 + np.float32(0.5 * TOL), spec, stuck=np.ones(n, bool))
    assert np.all(r.pulses == 0)


def test_ispp_disabled_writes_exactly():
    spec = sc.preset("int8")
    g0, gt = _cells(0.5, 100)
    gt[:10] = g0[:10]
    stuck = np.zeros(100, bool)
    stuck[50] = True
    r = _run(g0, gt, spec, stuck=stuck)
    np.testing.assert_array_equal(r.g[~stuck], gt[~stuck])
    assert r.g[50] == g0[50]
    assert np.all(r.pulses[:10] == 0) and np.all(r.pulses[10:] == 1)


def test_results_keyed_by_cell_id():
    """Draws depend on (seed, cell id, pulse): order and batch composition do not change a cell's result."""
    spec = Y1
    rng = np.random.default_rng(3)
    n = 6000
    g0 = np.full(n, T.g_min, np.float32)
    gt = (T.g_min + rng.uniform(0.05, 1, n) * SPAN).astype(np.float32)
    ids = rng.permutation(1 << 20)[:n].astype(np.uint32)
    a = _run(g0, gt, spec, seed=7, ids=ids)
    perm = rng.permutation(n)
    b = _run(g0[perm], gt[perm], spec, seed=7, ids=ids[perm])
    np.testing.assert_array_equal(a.g[perm], b.g)
    np.testing.assert_array_equal(a.pulses[perm], b.pulses)
    sub = perm[:500]
    c = _run(g0[sub], gt[sub], spec, seed=7, ids=ids[sub])
    np.testing.assert_array_equal(a.g[sub], c.g)
    d = _run(g0, gt, spec, seed=8, ids=ids)
    assert not np.array_equal(a.g, d.g)


# ---------------------------------------------------------------------------
# Incremental reprogramming


def _changed_weight(w, rng):
    w2 = w.copy()
    rows = rng.choice(w.shape[0], 20, replace=False)
    cols = rng.choice(w.shape[1], 20, replace=False)
    w2[np.ix_(rows, cols)] *= np.float32(0.5)  # inside each column's range: the scales stay
    return w2


@pytest.mark.parametrize("preset", ["y1", "int8"])
def test_reprogram_touches_only_changed_cells(preset):
    spec = sc.preset(preset, noise__drift_nu_mean=0.0, noise__drift_nu_std=0.0)
    rng = np.random.default_rng(4)
    w = rng.standard_normal((300, 280)).astype(np.float32)
    st = sc.program(w, spec, seed=1)
    w2 = _changed_weight(w, rng)
    st2 = sc.reprogram(st, w2, spec, seed=2, t_now=100.0)
    codes_changed = st.codes != st2.codes
    assert 50 < codes_changed.sum() <= 400
    np.testing.assert_array_equal(st2.scale, st.scale)  # the scale calibration is kept
    for plane in ("plus", "minus"):
        g0, g1 = getattr(st, f"g_{plane}"), getattr(st2, f"g_{plane}")
        w0, w1 = getattr(st, f"writes_{plane}"), getattr(st2, f"writes_{plane}")
        untouched = ~codes_changed
        np.testing.assert_array_equal(g1[untouched], g0[untouched])
        np.testing.assert_array_equal(w1[untouched], w0[untouched])
        assert np.all(w1 >= w0)
        t0, t1 = getattr(st, f"t_prog_{plane}"), getattr(st2, f"t_prog_{plane}")
        np.testing.assert_array_equal(t1[untouched], t0[untouched])
        assert np.all(t1[w1 > w0] == 100.0)  # written cells restart their drift clock
    total0 = int(st.writes_plus.sum() + st.writes_minus.sum())
    total1 = int(st2.writes_plus.sum() + st2.writes_minus.sum())
    assert total1 - total0 == st2.programming.pulses > 0
    assert st2.programming.cells_written <= 2 * codes_changed.sum()
    assert st2.programming.cells_written >= codes_changed.sum() * 0.9
    # and the new weights are there
    np.testing.assert_array_equal(st2.codes[:300, :280], np.clip(np.rint(w2 / st.scale), -127, 127).astype(np.int8))


@pytest.mark.parametrize("preset", ["int8", "y1"])
def test_reprogram_same_weight_writes_nothing(preset):
    spec = sc.preset(preset)
    st = sc.program(np.random.default_rng(5).standard_normal((256, 64)).astype(np.float32), spec, seed=1)
    w = st.codes[:256, :64].astype(np.float32) * st.scale
    st2 = sc.reprogram(st, w, spec, seed=2, t_now=10.0)
    assert st2.programming.pulses == 0 and st2.programming.cells_written == 0
    np.testing.assert_array_equal(st2.writes_plus, st.writes_plus)
    np.testing.assert_array_equal(st2.g_plus, st.g_plus)


def test_reprogram_positive_weights_only():
    spec = Y1
    w = np.abs(np.random.default_rng(11).standard_normal((128, 64))).astype(np.float32)
    st = sc.program(w, spec, seed=1)
    w2 = w.copy()
    w2[0, :] *= 0.5
    st2 = sc.reprogram(st, w2, spec, seed=2)
    np.testing.assert_array_equal(st2.writes_minus, st.writes_minus)
    assert st2.programming.pulses > 0


def test_reprogram_with_drift_keeps_untouched_cells_apart_from_drift():
    spec = Y1
    rng = np.random.default_rng(6)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    st = sc.program(w, spec, seed=1, t_now=0.0)
    t1 = 1000.0
    st2 = sc.reprogram(st, _changed_weight(w, rng), spec, seed=2, t_now=t1)
    untouched = st.codes == st2.codes
    assert (~untouched).sum() > 50
    gp_t1, gm_t1 = sc.drifted(st, t1, spec)
    # the stored conductance of an untouched cell is unchanged apart from drift up to t1
    for g_new, g_old, g_drift in ((st2.g_plus, st.g_plus, gp_t1), (st2.g_minus, st.g_minus, gm_t1)):
        ok = np.isclose(g_new[untouched], g_old[untouched], rtol=1e-6) | np.isclose(
            g_new[untouched], g_drift[untouched], rtol=1e-6)
        assert ok.all()
    np.testing.assert_array_equal(st2.writes_plus[untouched], st.writes_plus[untouched])
    np.testing.assert_array_equal(st2.nu_plus[untouched], st.nu_plus[untouched])


def test_reprogram_does_not_drift_untouched_cells_twice():
    spec = Y1
    rng = np.random.default_rng(7)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    st = sc.program(w, spec, seed=1, t_now=0.0)
    st2 = sc.reprogram(st, _changed_weight(w, rng), spec, seed=2, t_now=YEAR)
    untouched = (st.codes == st2.codes) & (st.nu_plus > 0)
    assert untouched.sum() > 10000
    # what a read sees at YEAR (and later) on an untouched cell is what it saw without the reprogram
    for t in (YEAR, 2 * YEAR):
        before, _ = sc.drifted(st, t, spec)
        after, _ = sc.drifted(st2, t, spec)
        np.testing.assert_allclose(after[untouched], before[untouched], rtol=1e-5)


def test_reprogram_float_mode():
    spec = sc.preset("ideal")
    rng = np.random.default_rng(8)
    w = rng.standard_normal((100, 50)).astype(np.float32)
    st = sc.program(w, spec)
    w2 = w.copy()
    w2[3, 4] = 7.0
    st2 = sc.reprogram(st, w2, spec)
    x = rng.standard_normal((2, 100)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(sc.linear(st2, x, spec)), x @ w2, rtol=1e-5, atol=1e-4)
    assert 1 <= st2.programming.cells_written <= 2  # one pair: one or both planes


def test_reprogram_rejects_bad_input():
    st = sc.program(np.ones((10, 10), np.float32), Y1)
    with pytest.raises(ValueError, match="shape"):
        sc.reprogram(st, np.ones((10, 11), np.float32), Y1)
    bad = np.ones((10, 10), np.float32)
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        sc.reprogram(st, bad, Y1)


# ---------------------------------------------------------------------------
# Endurance


def test_endurance_warning():
    w = np.random.default_rng(9).standard_normal((256, 128)).astype(np.float32)
    chip = sc.Chip.create("y1", seed=0, ispp__endurance=3.0)
    with pytest.warns(sc.EnduranceWarning, match="endurance"):
        res = chip.program(w, name="fc")
    assert res.state.programming.endurance_exceeded == int(
        (res.state.writes_plus > 3).sum() + (res.state.writes_minus > 3).sum()) > 0
    # default endurance (1e6): no warning
    chip = sc.Chip.create("y1", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sc.EnduranceWarning)
        res = chip.program(w, name="fc")
        chip.reprogram(res, w * 1.1)


def test_endurance_warning_on_repeated_writes():
    """With ISPP off every write is one pulse: the second rewrite of a cell passes an endurance of 1."""
    rng = np.random.default_rng(10)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    chip = sc.Chip.create("int8", seed=0, ispp__endurance=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sc.EnduranceWarning)
        res = chip.program(w)
    with pytest.warns(sc.EnduranceWarning):
        chip.reprogram(res, -w)


@pytest.mark.parametrize("preset", ["y1", "int8"])
def test_reprogram_grows_a_saturating_column_scale(preset):
    """An update past a column's programmed range grows that column's scale (no clipping at 127)."""
    spec = sc.preset(preset, noise__drift_nu_mean=0.0, noise__drift_nu_std=0.0)
    w = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    st = sc.program(w, spec, seed=1)
    w2 = w.copy()
    w2[0, 3] = 4 * np.abs(w[:, 3]).max()
    st2 = sc.reprogram(st, w2, spec, seed=2, t_now=1.0)
    grown = st2.scale > st.scale
    assert grown[3] and grown.sum() == 1
    np.testing.assert_allclose(st2.scale[3], 1.1 * np.abs(w2[:, 3]).max() / 127, rtol=1e-6)  # 10 % headroom
    assert st2.codes[0, 3] == round(127 / 1.1)
    # only that column's cells (and none elsewhere) were rewritten
    touched = (st2.writes_plus != st.writes_plus) | (st2.writes_minus != st.writes_minus)
    assert touched[:, 3].any() and not touched[:, np.arange(touched.shape[1]) != 3].any()

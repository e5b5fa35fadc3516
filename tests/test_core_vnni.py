"""sidra_core.vnni: the AVX-512 VNNI / BF16 custom calls for the crossbar's partial sums and read-noise
variances, against float64 matmuls of the same operands; the fused read against the same steps in
XLA; layouts, threads and build errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidra_core import crossbar, engine, rng, vnni
from sidra_core.quant import quantise_rows

# Skipped only where the CPU lacks the instructions: where it has them, a kernel that fails to build fails these.
needs_vnni = pytest.mark.skipif(not vnni.host_supports(), reason="this host's CPU lacks AVX-512 VNNI")


def _operands(rows, k, n, terms, seed):
    rs = np.random.default_rng(seed)
    gk = -(-k // 256)
    w = rs.integers(-127, 128, (gk, 256, terms * n)).astype(np.int8)
    # variances as the snapshot holds them: integer levels 0..255 of a step per tile column
    var = (rs.integers(0, 256, (gk, 256, n)).astype(np.float32), (rs.random((gk, n)) * 1e-3 + 1e-4).astype(np.float32))
    codes = rs.integers(-127, 128, (rows, k)).astype(np.float32)
    codes[:, 0] = 127  # a full-scale input in every row: as sidra_mvm's input, the DAC keeps these codes
    return w, var, codes


def _reference(w, var, codes, k, n, terms):
    """Per-tile sums over the live word lines: p = x @ (whole + fraction / 254) in float64, and
    v = (hi @ levels x 128 + lo @ levels) x step, x^2 = 128 hi + lo, in float32 from exact integer
    sums (crossbar._variance's arithmetic, which the kernel must give to the bit)."""
    gk = w.shape[0]
    wf = w.astype(np.float64)
    wf = wf[..., :n] + wf[..., n:] / 254 if terms == 2 else wf
    levels, step = var[0].astype(np.int64), var[1]
    sq = codes.astype(np.int64) ** 2
    x = codes.astype(np.float64)
    p, v = [], []
    for i in range(gk):
        live = slice(256 * i, 256 * i + min(256, k - 256 * i))
        used = live.stop - live.start
        p.append(x[:, live] @ wf[i, :used])
        hi, lo = ((sq[:, live] >> 7) @ levels[i, :used]).astype(np.float32), ((sq[:, live] & 127) @ levels[i, :used]).astype(np.float32)
        v.append((hi * np.float32(128) + lo) * step[i])
    return np.stack(p), np.stack(v)


def _pack(w, var, k, terms, noise=True):
    """The kernel's weight operands: packed weights, corrections, variance levels and their steps."""
    wp, corr, sp = jax.jit(vnni.pack, static_argnames=("k", "terms"))(
        tuple(jnp.asarray(w)), tuple(jnp.asarray(var[0])) if noise else None, k=k, terms=terms)
    return wp, corr, sp, (jnp.asarray(var[1]) if noise else None)


def _run(w, var, codes, k, n, terms, noise=True):
    wp, corr, sp, st = _pack(w, var, k, terms, noise)
    p, v = jax.jit(lambda c: vnni.tile_dots(c, wp, corr, sp, st, k=k, n=n))(jnp.asarray(codes))
    return np.asarray(p), None if v is None else np.asarray(v)


@needs_vnni
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("rows,k,n", [
    (1, 1, 1), (5, 3, 15), (7, 256, 16), (13, 257, 17), (6, 300, 70), (12, 600, 33), (9, 515, 130),
    (300, 768, 512),  # large enough for the helper threads
])
def test_partial_sums_and_variances_match_float64(rows, k, n, terms):
    w, var, codes = _operands(rows, k, n, terms, seed=rows + k + n)
    p, v = _run(w, var, codes, k, n, terms)
    pe, ve = _reference(w, var, codes, k, n, terms)
    assert p.shape == pe.shape == (w.shape[0], rows, n)
    if terms == 1:
        np.testing.assert_array_equal(p, pe)  # integer sums below 2^24: exact in float32
    else:  # whole (exact) + fraction / 254: float32 rounding of the sum
        np.testing.assert_allclose(p, pe, rtol=0, atol=4e-7 * np.abs(pe).max() + 1e-6)
    np.testing.assert_array_equal(v, ve)


@needs_vnni
def test_no_noise_gives_no_variances_and_the_same_sums():
    w, var, codes = _operands(8, 300, 40, 2, seed=1)
    p, v = _run(w, var, codes, 300, 40, 2, noise=False)
    assert v is None
    np.testing.assert_array_equal(p, _run(w, var, codes, 300, 40, 2)[0])


@needs_vnni
def test_zero_rows():
    w, var, codes = _operands(0, 300, 40, 2, seed=1)
    p, v = _run(w, var, codes, 300, 40, 2)
    assert p.shape == v.shape == (2, 0, 40)
    assert _read(w, var, codes, 300, 40, 2).shape == (0, 40)


@needs_vnni
def test_calls_running_at_once_share_the_helpers():
    """Independent calls in one program (XLA may run them in parallel) give each its own result."""
    ops = [_operands(200, 700, 300, 2, seed=s) for s in (1, 2)]
    packed = [_pack(w, v, 700, 2) for w, v, _ in ops]

    @jax.jit
    def both(c1, c2):
        return [vnni.tile_dots(c, *pk, k=700, n=300) for c, pk in zip((c1, c2), packed)]

    (p1, v1), (p2, v2) = both(*(jnp.asarray(c) for _, _, c in ops))
    for (w, var, codes), p, v in zip(ops, (p1, p2), (v1, v2)):
        pe, ve = _reference(w, var, codes, 700, 300, 2)
        np.testing.assert_allclose(np.asarray(p), pe, rtol=0, atol=4e-7 * np.abs(pe).max())
        np.testing.assert_array_equal(np.asarray(v), ve)


def _read(w, var, x, k, n, terms, seed=5, noise=True, lsb=None, gain=None, qmax=127.0, scale=None, bias=None):
    """sidra_mvm on float inputs x (codes: the DAC keeps them), column scale 1 unless given."""
    wp, corr, sp, st = _pack(w, var, k, terms, noise)
    lsb, gain, bias = (None if a is None else jnp.asarray(a) for a in (lsb, gain, bias))
    scale = jnp.ones(n, jnp.float32) if scale is None else jnp.asarray(scale)
    y = jax.jit(lambda c, s: vnni.mvm(c, wp, corr, sp, st, lsb, gain, scale, bias, s, k=k, n=n, qmax=qmax,
                                      dac_qmax=127.0))(jnp.asarray(x), jnp.uint32(seed))
    return np.asarray(y)


def _xla_read(p, v, seed, lsb=None, gain=None, qmax=127.0):
    """The read's steps after the dots as sidra_core.crossbar's XLA path takes them, in one jitted
    program (XLA contracts products into sums there): one Box-Muller pair per (tile pair, row,
    column), counters per row, noise, ADC, gain, tile sum in order."""

    @jax.jit
    def steps(p, v, lsb, gain):
        gk, rows, n = p.shape
        y = None
        for i in range(gk):
            t = p[i]
            if v is not None:
                if i % 2 == 0:
                    z = crossbar._read_normals(jnp.uint32(seed), rows, n, i, alone=i + 1 == gk, grid_k=gk)
                t = t + jnp.sqrt(v[i]) * z[i % 2]
            t = crossbar._adc(t, None if lsb is None else lsb[i], None if gain is None else gain[i], qmax)
            y = t if y is None else y + t
        return y

    return np.asarray(steps(p, v, lsb, gain))


@needs_vnni
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("rows,k,n", [(1, 1, 1), (25, 515, 130), (7, 256, 64), (300, 768, 512)])
def test_the_read_without_noise_or_adc_is_the_sum_of_the_tile_dots(rows, k, n, terms):
    w, var, codes = _operands(rows, k, n, terms, seed=rows + k)
    p, _ = _run(w, var, codes, k, n, terms, noise=False)
    y = _read(w, var, codes, k, n, terms, noise=False)
    np.testing.assert_array_equal(y, _xla_read(p, None, 0))


@needs_vnni
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("rows,k,n,gain", [
    (1, 1, 1, False), (25, 515, 130, True), (49, 300, 70, False), (7, 1024, 64, True),
    (300, 768, 512, False),  # the helper threads
])
def test_the_fused_read_takes_the_xla_paths_steps(rows, k, n, gain, terms):
    """Noise, ADC and gain on the kernel's sums give XLA's results: the same normals and ADC codes.
    Where XLA contracts a product into a sum the kernel may round the other product, so the tile
    sum can differ in its last bits and, rarely, an ADC code by one step."""
    w, var, codes = _operands(rows, k, n, terms, seed=rows + n)
    p, v = _run(w, var, codes, k, n, terms)
    gk = w.shape[0]
    rs = np.random.default_rng(k)
    lsb = (np.abs(p).max(axis=1) / 150 + 1e-3).astype(np.float32)  # the largest sums clip at +-127 codes
    g = (1 + 0.1 * rs.random((gk, n))).astype(np.float32) if gain else None
    y = _read(w, var, codes, k, n, terms, seed=11, lsb=lsb, gain=g)
    want = _xla_read(p, v, 11, lsb, g)
    assert np.abs(want).max() > 0
    last_bits = np.abs(y - want) <= 4e-7 * gk * np.abs(p).sum(0).max()
    assert np.mean(last_bits) >= 0.999
    step = (lsb * (1 if g is None else g)).max(axis=0)
    assert np.all(np.abs(y - want) <= 1.01 * step)
    assert np.any(np.abs(p) > 127.5 * lsb[:, None, :])  # clipping was exercised


def _inputs(rows, k, seed):
    """Float inputs with rows of very different scales and an all-zero row (the DAC's cases)."""
    rs = np.random.default_rng(seed)
    x = rs.standard_normal((rows, k)).astype(np.float32) * np.exp(rs.uniform(-6, 6, (rows, 1))).astype(np.float32)
    x[rows // 2] = 0
    return x


def _xla_mvm(w, var, x, k, n, terms, seed, lsb, gain, scale, bias, noise=True):
    """sidra_mvm's steps in XLA: quant.quantise_rows, the tile dots, `_xla_read`, then (y * row scale)
    * scale + bias in one jitted program (where XLA contracts the last product into the sum)."""
    codes, xs = jax.jit(lambda x: quantise_rows(x, 8))(jnp.asarray(x))
    wp, corr, sp, st = _pack(w, var, k, terms, noise)
    p, v = jax.jit(lambda c: vnni.tile_dots(c, wp, corr, sp, st, k=k, n=n))(codes)
    t = _xla_read(np.asarray(p), None if v is None else np.asarray(v), seed, lsb, gain)
    return np.asarray(jax.jit(lambda t, xs: (t * xs) * scale + bias)(t, xs)), np.asarray(p)


@needs_vnni
@pytest.mark.parametrize("rows,k,n", [(1, 1, 1), (25, 515, 130), (49, 300, 70), (300, 768, 512)])
def test_the_dac_and_dequantisation_are_xlas(rows, k, n):
    """Without noise or ADC the integer sums are exact: sidra_mvm's output is XLA's to the bit, so its
    DAC codes, row scales, column scales and bias FMA are too."""
    w, var, _ = _operands(rows, k, n, 1, seed=rows)
    x = _inputs(rows, k, seed=k)
    rs = np.random.default_rng(n)
    scale, bias = rs.random(n).astype(np.float32) / 100, rs.standard_normal(n).astype(np.float32)
    want, _ = _xla_mvm(w, var, x, k, n, 1, 0, None, None, scale, bias, noise=False)
    np.testing.assert_array_equal(_read(w, var, x, k, n, 1, noise=False, scale=scale, bias=bias), want)
    want, _ = _xla_mvm(w, var, x, k, n, 1, 0, None, None, scale, np.float32(0), noise=False)
    no_bias = _read(w, var, x, k, n, 1, noise=False, scale=scale)
    np.testing.assert_array_equal(no_bias, want)
    if rows > 1:
        assert np.all(no_bias[rows // 2] == 0) and np.abs(no_bias).max() > 0


@needs_vnni
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("rows,k,n", [(25, 515, 130), (300, 768, 512)])
def test_the_whole_mvm_takes_the_xla_paths_steps(rows, k, n, terms):
    w, var, _ = _operands(rows, k, n, terms, seed=rows + n)
    x = _inputs(rows, k, seed=rows)
    rs = np.random.default_rng(k)
    scale, bias = rs.random(n).astype(np.float32) / 100, rs.standard_normal(n).astype(np.float32)
    gk = w.shape[0]
    g = (1 + 0.1 * rs.random((gk, n))).astype(np.float32)
    codes, _ = quantise_rows(jnp.asarray(x), 8)
    p, _ = _run(w, var, np.asarray(codes), k, n, terms)
    lsb = (np.abs(p).max(axis=1) / 150 + 1e-3).astype(np.float32)
    want, _ = _xla_mvm(w, var, x, k, n, terms, 11, lsb, g, scale, bias)
    y = _read(w, var, x, k, n, terms, seed=11, lsb=lsb, gain=g, scale=scale, bias=bias)
    tol = 4e-7 * gk * (np.abs(p).sum(0) * np.abs(want - bias).max() / np.abs(p).sum(0).max()).max() + 1e-6
    assert np.mean(np.abs(y - want) <= np.maximum(tol, 2e-7 * np.abs(want))) >= 0.999


@needs_vnni
@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("rows,k,n,noise,adc", [
    (0, 300, 70, True, True), (1, 1, 1, True, True), (7, 256, 64, False, False), (25, 515, 130, True, True),
    (37, 384, 1536, True, False), (300, 768, 512, True, True)])
def test_a_direct_read_is_the_custom_calls_to_the_bit(rows, k, n, noise, adc, terms):
    """vnni.mvm_direct (host buffers, no XLA program) runs the custom call's read: the same bits at
    any row count, with and without noise, ADC, gain and bias."""
    w, var, _ = _operands(max(rows, 1), k, n, terms, seed=rows + 3 * n)
    x = _inputs(rows, k, seed=rows + k) if rows else np.zeros((0, k), np.float32)
    rs = np.random.default_rng(n)
    gk = w.shape[0]
    lsb = (rs.random((gk, n)) * 300 + 50).astype(np.float32) if adc else None
    gain = (1 + 0.1 * rs.random((gk, n))).astype(np.float32) if adc else None
    scale, bias = rs.random(n).astype(np.float32) / 100, rs.standard_normal(n).astype(np.float32)
    for b in (None, bias):
        want = _read(w, var, x, k, n, terms, seed=9, noise=noise, lsb=lsb, gain=gain, scale=scale, bias=b)
        wp, corr, sp, st = _pack(w, var, k, terms, noise)
        held = (None if lsb is None else jnp.asarray(lsb), None if gain is None else jnp.asarray(gain), jnp.asarray(scale))
        got = vnni.mvm_direct(x, vnni.mvm_weights(wp, corr, sp, st, *held), b, 9, k=k, n=n, qmax=127.0, dac_qmax=127.0)
        assert got.shape == (rows, n) and got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


@needs_vnni
def test_a_direct_read_in_another_layout_is_refused():
    w, var, _ = _operands(2, 300, 40, 1, seed=1)
    wp, corr, sp, st = _pack(w, var, 300, 1)
    x = _inputs(2, 300, seed=1)
    with pytest.raises(ValueError, match="unexpected operand layout"):  # N past the packed vectors
        scale = jnp.ones(64, jnp.float32)
        vnni.mvm_direct(x, vnni.mvm_weights(wp, corr, sp, st, None, None, scale), None, 1, k=300, n=64, qmax=127.0,
                        dac_qmax=127.0)


@needs_vnni
@pytest.mark.parametrize("preset,overrides", [
    ("y1", {}), ("pcm", {}), ("y1-ir", {"noise__prog_relax_sigma": 0.0}),
    ("y1", {"ispp__ramp": 0.0, "ispp__max_pulses": 5}), ("y1", {"noise__stuck_off_rate": 0.01})])
def test_native_ispp_is_xlas_to_the_bit(preset, overrides, monkeypatch):
    """The native write-verify (each cell to its end, no chunks) gives XLA's conductances and pulse
    counts: cells from rest or mid-range, up and down, at target, stuck, and cut off at max_pulses."""
    import sidra_core as sc
    from sidra_core import host, ispp

    spec = sc.preset(preset, **overrides)
    t, n = spec.tile, 60000
    rs = np.random.default_rng(len(preset) + len(overrides))
    g0 = (t.g_min + rs.random(n) * (t.g_max - t.g_min)).astype(np.float32)
    g0[: n // 3] = t.g_min
    g1 = (t.g_min + rs.random(n) * (t.g_max - t.g_min)).astype(np.float32)
    g1[::5] = t.g_min
    g1[1::9] = g0[1::9]
    stuck = rs.random(n) < max(spec.noise.stuck_off_rate, 0.002)
    ids = rs.permutation(1 << 22)[:n].astype(np.uint32)
    assert host.native_ispp()
    native = ispp.program_cells(g0, g1, stuck, ids, spec, 5)
    monkeypatch.setenv("SIDRA_NATIVE_ISPP", "0")
    assert not host.native_ispp() and "SIDRA_NATIVE_ISPP=0" in host.programming()
    xla = ispp.program_cells(g0, g1, stuck, ids, spec, 5)
    assert native.total_pulses > n and (native.pulses == spec.ispp.max_pulses).any()
    np.testing.assert_array_equal(native.pulses, xla.pulses)
    np.testing.assert_array_equal(native.g, xla.g)


@needs_vnni
@pytest.mark.parametrize("preset,overrides", [
    ("y1", {"noise__stuck_off_rate": 0.01, "noise__stuck_on_rate": 0.005, "ispp__endurance": 6}),
    ("y1", {"noise__stuck_off_rate": 0.01, "ispp__enabled": False}),
    ("y1", {"noise__stuck_off_rate": 0.01, "tile__rows": 64, "tile__cols": 48}),  # runs end inside rows
    ("pcm", {})])
def test_native_programming_is_xlas_to_the_bit(preset, overrides, monkeypatch):
    """A whole weight programmed natively (write-verify, stuck map, drift exponents) holds XLA's
    state to the bit: every plane's conductances, stuck cells, exponents and write counts."""
    import sidra_core as sc
    from sidra_core import crossbar

    spec = sc.preset(preset, **overrides)
    w = np.random.default_rng(3).normal(0, 0.05, (300, 300)).astype(np.float32)
    tiles = tuple(range(3 * sc.tile_grid(300, 300, spec).tiles, 0, -3))  # physical tiles out of order
    native = crossbar.program(w, spec, seed=4, t_now=2.0, tile_ids=tiles)
    monkeypatch.setenv("SIDRA_NATIVE_ISPP", "0")
    xla = crossbar.program(w, spec, seed=4, t_now=2.0, tile_ids=tiles)
    assert native.programming == xla.programming and native.programming.pulses > 0
    assert (native.programming.endurance_exceeded > 0) == (spec.ispp.endurance < spec.ispp.max_pulses)
    np.testing.assert_array_equal(native.adc_full_scale, xla.adc_full_scale)
    np.testing.assert_array_equal(native.ref_norm, xla.ref_norm)
    for plane in ("plus", "minus"):
        for field in ("g", "stuck", "nu", "writes", "t_prog"):
            np.testing.assert_array_equal(getattr(native, f"{field}_{plane}"), getattr(xla, f"{field}_{plane}"))
    stuck = (native.stuck_plus != 0).mean()
    assert stuck == pytest.approx(spec.noise.stuck_off_rate + spec.noise.stuck_on_rate, rel=0.2, abs=1e-4)
    assert (native.nu_plus > 0).any()


@needs_vnni
def test_a_row_with_a_nan_or_an_infinity_gives_nans_and_leaves_the_others():
    w, var, _ = _operands(6, 300, 40, 2, seed=2)
    x = _inputs(6, 300, seed=3)
    clean = _read(w, var, x, 300, 40, 2)
    x[1, 7], x[4, 299] = np.nan, -np.inf
    y = _read(w, var, x, 300, 40, 2)
    assert np.all(np.isnan(y[[1, 4]]))
    np.testing.assert_array_equal(np.delete(y, [1, 4], 0), np.delete(clean, [1, 4], 0))


@needs_vnni
def test_crossbar_mvm_adds_a_bias_of_any_shape(monkeypatch):
    """A per-column bias goes into the call (one FMA with the scale); any other broadcastable one is
    added after it."""
    import sidra_core

    monkeypatch.setattr(sidra_core.host, "LOW_PRECISION_DOTS", False)  # the kernel, also on AMX hosts
    monkeypatch.setenv("SIDRA_VNNI_DOTS", "1")
    chip = sidra_core.Chip.create("y1", seed=0)
    rs = np.random.default_rng(0)
    snap = chip.snapshot(chip.program(rs.standard_normal((300, 300)).astype(np.float32)))
    assert snap.shape.packed
    x = jnp.asarray(rs.standard_normal((3, 5, 300)).astype(np.float32))
    kw = crossbar.mvm_kwargs(chip.spec)
    run = jax.jit(lambda x, b: crossbar.mvm(snap, x, jnp.uint32(3), b, **kw))
    y = np.asarray(run(x, None))
    per_row = rs.standard_normal((5, 300)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(run(x, jnp.asarray(per_row))), y + per_row)
    column = rs.standard_normal(300).astype(np.float32)
    np.testing.assert_allclose(np.asarray(run(x, jnp.asarray(column))), y + column, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(run(x, jnp.float32(2))), y + 2, rtol=1e-6, atol=1e-6)


@needs_vnni
def test_the_read_noise_is_standard_normal_times_the_variance_root():
    w, var, codes = _operands(240, 600, 300, 2, seed=4)
    p, v = _run(w, var, codes, 600, 300, 2)
    clean = _read(w, var, codes, 600, 300, 2, noise=False)
    noisy = _read(w, var, codes, 600, 300, 2, seed=1)
    z = (noisy - clean) / np.sqrt(v.sum(0))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01  # 72,000 draws: sigma of either ~0.004
    np.testing.assert_array_equal(_read(w, var, codes, 600, 300, 2, seed=1), noisy)  # a seed is one draw
    assert np.mean(_read(w, var, codes, 600, 300, 2, seed=2) == noisy) < 0.01


@needs_vnni
def test_an_unpaired_tile_uses_both_normals_of_each_pair():
    """One tile (K <= 256): each Box-Muller pair feeds two columns 16 apart; the two are independent
    standard normals."""
    w, var, codes = _operands(600, 200, 64, 2, seed=6)
    _, v = _run(w, var, codes, 200, 64, 2)
    z = (_read(w, var, codes, 200, 64, 2, seed=3) - _read(w, var, codes, 200, 64, 2, noise=False)) / np.sqrt(v[0])
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02  # 38,400 draws
    first, second = z[:, 0:16].ravel(), z[:, 16:32].ravel()  # z0 and z1 of the same pairs
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.04  # 9,600 pairs: sigma ~0.01


def test_the_read_normals_layout():
    """Each row owns `stride` counters (width per tile pair: N, or 16 per 32-column block if more);
    paired tiles: pair (row, column) of counter row * stride + pair * width + column; an unpaired
    last tile: pair (row, 32-column block, lane) of counter row * stride + pair * width + block * 16
    + lane, z0 for the block's first 16 columns, z1 for the rest."""
    seed, rows, n, gk = jnp.uint32(9), 3, 40, 3
    width, stride = crossbar._normals_stride(n, gk)
    assert (width, stride) == (40, 80) and crossbar._normals_stride(10, 5) == (16, 48)
    z0, z1 = crossbar._read_normals(seed, rows, n, 0, alone=False, grid_k=gk)
    c0, c1 = rng.box_muller(seed, jnp.uint32(1 * stride + 7))
    assert z0[1, 7] == c0 and z1[1, 7] == c1
    za, none = crossbar._read_normals(seed, rows, n, 2, alone=True, grid_k=gk)
    assert none is None and za.shape == (rows, n)
    for col in (3, 18, 35):
        block, lane = divmod(col, 32)
        pair = rng.box_muller(seed, jnp.uint32(2 * stride + width + block * 16 + lane % 16))
        assert za[2, col] == pair[lane // 16]
    # a row's normals do not depend on the rows drawn with it
    np.testing.assert_array_equal(crossbar._read_normals(seed, 7, n, 2, alone=True, grid_k=gk)[0][:rows], za)


@needs_vnni
def test_reads_running_at_once_each_give_their_own_sums():
    """Two fused reads in one program (XLA may run them in parallel; the helper steps back) give
    what each gives alone."""
    ops = [_operands(200, 700, 300, 2, seed=s) for s in (3, 4)]
    packed = [_pack(w, v, 700, 2) for w, v, _ in ops]

    @jax.jit
    def both(c1, c2):
        return [vnni.mvm(c, *pk, None, None, jnp.ones(300), None, jnp.uint32(7), k=700, n=300, qmax=127.0,
                         dac_qmax=127.0) for c, pk in zip((c1, c2), packed)]

    for (w, var, codes), y in zip(ops, both(*(jnp.asarray(c) for _, _, c in ops))):
        np.testing.assert_array_equal(np.asarray(y), _read(w, var, codes, 700, 300, 2, seed=7))


@needs_vnni
def test_an_operand_in_another_layout_is_refused():
    w, var, codes = _operands(4, 300, 40, 2, seed=1)
    wp, corr, sp, st = _pack(w, var, 300, 2)
    xu = jnp.zeros((4, 512), jnp.uint8)
    x2 = jnp.zeros((4, 2, 512), jnp.uint8)
    empty = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((4, 40), jnp.float32)
    flat = wp.reshape(wp.shape[0], -1)  # not the packed 6-d layout
    for weights, x, scale in ((flat, codes, jnp.ones(40)), (wp, codes[:, :299], jnp.ones(40)), (wp, codes, empty)):
        with pytest.raises(Exception, match="sidra_mvm: unexpected operand layout"):
            jax.block_until_ready(jax.ffi.ffi_call(vnni.MVM_TARGET, out)(
                jnp.asarray(x), weights, corr, sp, st, empty, empty, scale, empty, jnp.uint32(0), k=np.int64(300),
                n=np.int64(40), terms=np.int64(2), noise=np.int64(1), qmax=np.float32(127), dac_qmax=np.float32(127)))
    with pytest.raises(Exception, match="sidra_tile_dots: unexpected operand layout"):
        jax.block_until_ready(jax.ffi.ffi_call(vnni.TARGET, (out, out))(
            xu, x2, flat, corr, sp, st, k=np.int64(300), n=np.int64(40), terms=np.int64(2), noise=np.int64(1)))
    with pytest.raises(Exception, match="sidra_tile_dots: unexpected operand layout"):  # steps of another weight
        jax.block_until_ready(jax.ffi.ffi_call(vnni.TARGET, (out, out))(
            xu, x2, wp, corr, sp, st[:, :20], k=np.int64(300), n=np.int64(40), terms=np.int64(2), noise=np.int64(1)))


@needs_vnni
@pytest.mark.parametrize("terms", [1, 2])
def test_unpack_inverts_pack_and_zeroes_dead_word_lines(terms):
    w, var, _ = _operands(1, 300, 21, terms, seed=3)
    wp, corr, sp, _ = _pack(w, var, 300, terms)
    back = np.asarray(vnni.unpack(wp, 21))
    want = w.copy()
    want[1, 300 - 256:] = 0  # word lines past K hold nothing the kernel may read
    np.testing.assert_array_equal(back, want)
    np.testing.assert_array_equal(np.asarray(corr).transpose(0, 2, 1, 3).reshape(2, terms, -1)[..., :21],
                                  128 * want.astype(np.int32).sum(axis=1).reshape(2, terms, 21))
    assert sp.dtype == jnp.uint8 and sp.shape == (2, 2, 64, 16, 4)  # the levels in the weights' layout
    levels = var[0].astype(np.uint8)
    levels[1, 300 - 256:] = 0
    np.testing.assert_array_equal(np.asarray(vnni.unpack(sp[:, :, None], 21)), levels)


@needs_vnni
def test_the_kernel_builds_and_registers_where_the_cpu_has_the_instructions():
    vnni.load()  # raises with the compiler's message if the source does not build
    assert vnni.available()


@needs_vnni
@pytest.mark.parametrize("preset,overrides,shape,t", [
    ("y1", {}, (384, 1536), 30.0), ("y1", {}, (600, 300), 5e6), ("pcm", {}, (256, 100), 3600.0),
    ("y1", {"noise__read_sigma": 0.0}, (300, 300), 1e3), ("int8", {}, (384, 384), 10.0),
    ("y1", {"noise__stuck_on_rate": 0.01}, (520, 200), 86400.0)])
def test_native_snapshot_is_xlas_to_the_bit(preset, overrides, shape, t, monkeypatch):
    """A packed snapshot read natively holds the XLA program's bits: packed codes (one term where the
    weights are whole codes, as on the int8 chip), column corrections, variance levels and steps."""
    import sidra_core as sc
    from sidra_core import crossbar, host

    spec = sc.preset(preset, **overrides)
    w = np.random.default_rng(len(shape) + shape[1]).normal(0, 0.05, shape).astype(np.float32)
    state = crossbar.program(w, spec, seed=2, t_now=1.0)
    assert host.native_snapshot()
    native = crossbar.snapshot(state, t, spec)
    monkeypatch.setenv("SIDRA_NATIVE_SNAPSHOT", "0")
    xla = crossbar.snapshot(state, t, spec)
    assert native.shape == xla.shape and native.shape.packed and native.gain is None and xla.gain is None
    assert native.shape.terms == (1 if preset == "int8" else 2)
    for field in ("w", "corr", "var", "var_scale"):
        a, b = getattr(native, field), getattr(xla, field)
        assert (a is None) == (b is None) == (field in ("var", "var_scale") and not spec.noise.read_sigma)
        if a is not None:
            a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=field)


@needs_vnni
def test_native_snapshots_build_no_program_and_xla_takes_the_rest(monkeypatch):
    """Packed snapshots of weights of any shape build no XLA program; IR drop and drift compensation
    go to XLA's read (a program per weight shape)."""
    import sidra_core as sc
    from sidra_core import compiles, crossbar

    rs = np.random.default_rng(0)
    states = [(crossbar.program(rs.normal(0, 0.05, s).astype(np.float32), sc.preset("y1"), seed=1), s)
              for s in ((700, 250), (333, 300), (260, 530))]
    with compiles.record() as log:
        for state, _ in states:
            crossbar.snapshot(state, 100.0, sc.preset("y1"))
    assert log.built == 0, log.programs
    with compiles.record() as log:
        for spec in (sc.preset("y1-ir"), sc.preset("y1", noise__drift_compensation=True)):
            crossbar.snapshot(crossbar.program(rs.normal(0, 0.05, (321, 123)).astype(np.float32), spec), 9.0, spec)
    assert log.programs["jit(_read_array)"] == 2


@needs_vnni
def test_a_fresh_build_exports_every_kernel(tmp_path):
    """What a clean machine does at the first snapshot: compile the source into the cache."""
    import ctypes

    vnni._build(tmp_path / "k.so")
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    assert lib.SidraTileDots and lib.SidraMvm and lib.SidraEngineMatmul and lib.SidraPackTiles
    assert lib.sidra_mvm_direct and lib.sidra_attention_direct and lib.sidra_ispp_write and lib.sidra_drift_exponents
    assert lib.sidra_program and lib.sidra_snapshot
    assert lib.SidraEngineMap and lib.SidraEngineNorm and lib.sidra_engine_map and lib.sidra_engine_norm
    assert not list(tmp_path.glob("tmp*"))  # the temporary build folder is gone


def test_a_failed_build_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="false .*failed"):
        vnni.load(tmp_path / "k.so")
    assert not (tmp_path / "k.so").exists()


def test_without_the_kernel_the_simulator_warns_once_and_uses_xla(monkeypatch):
    from sidra_core import host

    monkeypatch.setattr(host, "cpu_flags", lambda: set(vnni._CPU_FEATURES))
    monkeypatch.setattr(vnni, "load", lambda: (_ for _ in ()).throw(RuntimeError("no compiler")))
    with pytest.warns(RuntimeWarning, match="VNNI crossbar kernel is not available .*no compiler"):
        assert vnni.available.__wrapped__() is False
    monkeypatch.setattr(host, "cpu_flags", lambda: {"avx2"})
    assert vnni.available.__wrapped__() is False


def _xla_engine_matmul(a, b):
    """engine.matmul's int8 arithmetic in XLA (what it runs without the kernel)."""

    @jax.jit
    def f(a, b):
        qa, sa = quantise_rows(a, 8)
        qb, sb = quantise_rows(b, 8, axis=-2)
        return jnp.matmul(qa, qb, preferred_element_type=jnp.float32) * sa * sb

    return np.asarray(f(jnp.asarray(a), jnp.asarray(b)))


@needs_vnni
@pytest.mark.parametrize("ashape,bshape", [
    ((1, 1, 1), (1, 1, 1)), ((3, 5, 7), (3, 7, 19)), ((2, 4, 128, 64), (2, 4, 64, 128)),
    ((2, 30, 1000), (1000, 33)),  # b broadcast over the batch
    ((2, 1, 9, 40), (3, 40, 70)),  # batch dimensions broadcast against each other
])
def test_the_engine_matmul_is_the_xla_paths_to_the_bit(ashape, bshape):
    rs = np.random.default_rng(len(ashape) + ashape[-1])
    a = rs.standard_normal(ashape).astype(np.float32) * np.exp(rs.uniform(-4, 4, ashape[:-1] + (1,))).astype(np.float32)
    b = rs.standard_normal(bshape).astype(np.float32) * np.exp(rs.uniform(-4, 4, bshape[-1])).astype(np.float32)
    a[..., 0, :] = 0  # an all-zero row: scale 1, codes 0
    y = np.asarray(jax.jit(vnni.engine_matmul)(a, b))
    want = _xla_engine_matmul(a, b)
    assert y.shape == want.shape
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(np.asarray(engine.matmul(a, b)), want)  # engine.matmul runs the kernel


@needs_vnni
def test_the_engine_matmul_sums_exactly_past_the_float32_range():
    """K = 3000: |sums| beyond 2^24, where float32 sums round; the kernel's int32 sums do not."""
    rs = np.random.default_rng(1)
    a = rs.integers(90, 128, (4, 3000)).astype(np.float32)
    b = rs.integers(90, 128, (3000, 20)).astype(np.float32)
    a[:, 0], b[0] = 127, 127  # integer codes of a full-scale row and column: the DAC keeps them
    y = np.asarray(vnni.engine_matmul(a, b))
    exact = a.astype(np.int64) @ b.astype(np.int64)
    assert exact.min() > 2 ** 25
    scale = np.float32(127) * np.float32(1 / 127)  # each row's and column's scale
    np.testing.assert_array_equal(y, (exact.astype(np.float32) * scale) * scale)


@needs_vnni
def test_the_engine_matmul_gives_nans_for_non_finite_rows_and_columns():
    rs = np.random.default_rng(2)
    a, b = rs.standard_normal((6, 50)).astype(np.float32), rs.standard_normal((50, 30)).astype(np.float32)
    a[2, 3], b[7, 11], b[0, 29] = np.inf, np.nan, -np.inf
    y = np.asarray(vnni.engine_matmul(a, b))
    bad = np.zeros(y.shape, bool)
    bad[2], bad[:, 11], bad[:, 29] = True, True, True
    assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))
    np.testing.assert_array_equal(y[~bad], _xla_engine_matmul(a, b)[~bad])


@needs_vnni
def test_the_engine_matmul_of_empty_operands():
    assert vnni.engine_matmul(jnp.zeros((2, 0, 5)), jnp.zeros((2, 5, 3))).shape == (2, 0, 3)
    np.testing.assert_array_equal(np.asarray(vnni.engine_matmul(jnp.ones((2, 4, 0)), jnp.ones((2, 0, 3)))),
                                  np.zeros((2, 4, 3), np.float32))
    with pytest.raises(Exception, match="sidra_engine_matmul: unexpected operand layout"):
        jax.block_until_ready(jax.ffi.ffi_call(vnni.ENGINE_MATMUL_TARGET, jax.ShapeDtypeStruct((2, 4, 3), jnp.float32))(
            jnp.ones((2, 4, 5)), jnp.ones((2, 6, 3)), qmax=np.float32(127)))


def _attention_pair(q, k, v, precision, layout, mask=None, causal=False):
    """engine.attention through the kernel and through the XLA path (its own steps, traced with the
    kernel switched off)."""
    def program():  # a fresh function each time: JAX reuses a trace of the same one
        return jax.jit(lambda q, k, v, m: engine.attention.__wrapped__(
            q, k, v, m, scale=0.3, causal=causal, precision=precision, mode="int8", layout=layout))

    kernel = np.asarray(program()(q, k, v, mask))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "native_attention", lambda *a: False)
        xla = np.asarray(program()(q, k, v, mask))
    return kernel, xla


@needs_vnni
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("layout,qs,ks,vs", [
    ("bhsd", (2, 4, 128, 64), (2, 4, 128, 64), (2, 4, 128, 64)),
    ("bshd", (4, 128, 4, 64), (4, 100, 4, 64), (4, 100, 4, 48)),
    ("bhsd", (2, 3, 5, 7), (2, 1, 9, 7), (1, 3, 9, 33)),  # leading dimensions broadcast; odd sizes
    ("bhsd", (6, 17, 40), (6, 17, 40), (6, 17, 40)),
    ("bshd", (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)),
])
def test_the_fused_attention_takes_the_xla_paths_steps(precision, layout, qs, ks, vs):
    """Its exponentials and sums round apart from XLA's, so a stored score or INT8 code may differ,
    rarely; everything else is the same arithmetic."""
    rs = np.random.default_rng(sum(qs))
    q, k, v = (jnp.asarray(rs.standard_normal(s).astype(np.float32) * 2) for s in (qs, ks, vs))
    got, want = _attention_pair(q, k, v, precision, layout)
    assert got.shape == want.shape
    close = np.isclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert np.mean(close) >= 0.99
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()


@needs_vnni
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("qs,ks,vs", [
    ((2, 4, 37, 64), (2, 4, 37, 64), (2, 4, 37, 64)), ((2, 3, 5, 7), (2, 1, 9, 7), (1, 3, 9, 33)),
    ((6, 17, 40), (6, 17, 40), (6, 17, 40)), ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)), ((1, 2, 0, 8), (1, 2, 3, 8), (1, 2, 3, 8))])
def test_a_direct_attention_is_the_custom_calls_to_the_bit(precision, qs, ks, vs):
    """vnni.attention_direct (host buffers, no program: any lengths, leading dimensions broadcast)
    runs the custom call's attention."""
    rs = np.random.default_rng(sum(qs))
    q, k, v = (rs.standard_normal(s).astype(np.float32) * 2 for s in (qs, ks, vs))
    storage = engine.STORAGE[precision]
    want = jax.jit(lambda q, k, v: vnni.attention(q, k, v, scale=0.3, storage=storage, heads_first=True))(q, k, v)
    got = vnni.attention_direct(q, k, v, scale=0.3, storage=storage)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(want))


@needs_vnni
def test_a_direct_attention_past_the_int32_sums_is_refused():
    """A head size past MAX_ENGINE_K would overflow the kernel's int32 sums: the direct call refuses
    it (engine.attention sends it to XLA instead)."""
    q = np.ones((1, 1, 2, vnni.MAX_ENGINE_K + 4), np.float32)
    with pytest.raises(ValueError, match="sidra_attention_direct: unexpected operand layout"):
        vnni.attention_direct(q, q, q, scale=1.0, storage="float32")
    assert not engine.native_attention("int8", q.shape[-1], 2)


@needs_vnni
def test_the_chip_attends_directly_to_unmasked_host_arrays_at_any_length():
    """Chip.attention of concrete float32 operands calls the kernel directly: no program at 12
    lengths, engine.attention's result; masked and causal ones too; a traced one builds XLA's program."""
    import sidra_core as sc
    from sidra_core import buckets, compiles

    chip = sc.Chip.create("y1")
    rs = np.random.default_rng(0)
    with compiles.record() as log:
        for n in range(3, 15):
            q, k, v = (buckets.put(rs.standard_normal((1, 3, n, 16)).astype(np.float32)) for _ in range(3))
            assert chip.attends_directly(q, k, v)
            y = chip.attention(q, k, v, scale=0.25)
            assert y.shape == (1, 3, n, 16)
    assert "jit(attention)" not in log.programs
    want = engine.attention(q, k, v, scale=0.25, precision=chip.spec.engine.precision, mode=chip.spec.engine.matmul)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    keep = buckets.put(np.random.default_rng(1).random((1, n)) > 0.3)
    assert chip.attends_directly(q, k, v, keep) and chip.attends_directly(q, k, v, causal=True)
    assert not chip.attends_directly(q, k, v, jnp.zeros((1, n), jnp.float16))  # a mask the kernel does not take
    with compiles.record() as log:
        chip.attention(q, k, v, keep, scale=0.25, causal=True)
    assert log.built == 0
    with compiles.record() as log:
        jax.jit(lambda q: chip.attention(q, k, v, keep, scale=0.25))(q)  # traced: a program
    assert log.built == 1


@needs_vnni
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["bool", "float", "causal", "bool+causal", "float+causal", "all masked"])
def test_a_masked_attention_takes_the_xla_paths_steps(precision, kind):
    """Masks (bool: -inf where False; float: added, the scale's product fused into the sum as XLA
    fuses it, except after the causal select) and causal ones, in the kernel (direct or custom call)
    as engine.attention's XLA steps apply them; within its exponentials' rounding, as unmasked."""
    rs = np.random.default_rng(len(kind))
    q, k, v = (rs.standard_normal((2, 4, 37, 32)).astype(np.float32) * 2 for _ in range(3))
    keep = rs.random((2, 1, 1, 37)) > 0.3
    if kind == "all masked":
        keep[1] = False  # every score of batch item 1 masked: the safe softmax gives zeros
    add = np.where(keep, 0.0, -1e9).astype(np.float32) + rs.standard_normal((2, 1, 37, 37)).astype(np.float32)
    mask = add if kind.startswith("float") else keep
    causal = kind.endswith("causal")
    if kind == "causal":
        mask = None
    kernel, want = _attention_pair(q, k, v, precision, "bhsd", mask, causal)
    got = vnni.attention_direct(q, k, v, mask, causal, scale=0.3, storage=engine.STORAGE[precision])
    np.testing.assert_array_equal(got, kernel)  # the direct call and the custom call: one kernel
    assert got.shape == want.shape
    if kind == "all masked":
        assert not got[1].any() and not want[1].any()
    # most are XLA's bits (~2 % differ by the exponentials' ulp; an FMA taken differently: ~25 %)
    assert np.mean(got == want) >= 0.93
    close = np.isclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert np.mean(close) >= 0.99
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()


@needs_vnni
def test_the_fused_attention_of_a_nan_query_row_is_nan_and_leaves_the_others():
    rs = np.random.default_rng(3)
    q, k, v = (rs.standard_normal((2, 2, 6, 8)).astype(np.float32) for _ in range(3))
    clean, _ = _attention_pair(q, k, v, "fp16", "bhsd")
    q[1, 0, 4, 2] = np.nan
    got, _ = _attention_pair(q, k, v, "fp16", "bhsd")
    assert np.all(np.isnan(got[1, 0, 4]))
    bad = np.zeros(got.shape, bool)
    bad[1, 0, 4] = True
    np.testing.assert_array_equal(got[~bad], clean[~bad])


@needs_vnni
def test_the_fused_attention_refuses_mismatched_operands():
    with pytest.raises(Exception, match="sidra_attention: unexpected operand layout"):
        jax.block_until_ready(jax.ffi.ffi_call(vnni.ATTENTION_TARGET, jax.ShapeDtypeStruct((2, 3, 5, 8), jnp.float32))(
            jnp.ones((2, 3, 5, 8)), jnp.ones((2, 3, 7, 9)), jnp.ones((2, 3, 7, 8)), jnp.zeros((0,), jnp.uint8),
            jnp.zeros((0,), jnp.float32), scale=np.float32(1), heads_first=np.int64(1), format=np.int64(1),
            qmax=np.float32(127), contract=np.int64(1)))
    with pytest.raises(Exception, match="sidra_attention: unexpected operand layout"):  # a mask of another size
        jax.block_until_ready(jax.ffi.ffi_call(vnni.ATTENTION_TARGET, jax.ShapeDtypeStruct((2, 3, 5, 8), jnp.float32))(
            jnp.ones((2, 3, 5, 8)), jnp.ones((2, 3, 7, 8)), jnp.ones((2, 3, 7, 8)), jnp.ones((2 * 3 * 5 * 6,), jnp.uint8),
            jnp.zeros((0,), jnp.float32), scale=np.float32(1), heads_first=np.int64(1), format=np.int64(1),
            qmax=np.float32(127), contract=np.int64(1)))


@needs_vnni
def test_a_direct_calls_operand_address_is_taken_once_its_program_wrote_it():
    """A program with a custom call (a snapshot's pack) may still be running when its result is
    handed to a direct call: its address is taken once it is written (seen: int8 weights packed
    just before their first read, read half-written)."""
    import ctypes

    for seed in range(3):
        w, var, _ = _operands(1, 768, 1200, 2, seed=seed)
        wp, _, _, _ = _pack(w, var, 768, 2)
        got = np.empty(wp.shape, np.int8)
        ctypes.memmove(got.ctypes.data, vnni._address(wp), got.nbytes)
        np.testing.assert_array_equal(got, np.asarray(wp))


def test_a_kernel_call_where_the_kernel_does_not_run_names_the_cause(monkeypatch):
    """Without the kernel (no instructions, no compiler), a direct call says so instead of XLA's
    missing-handler error."""
    monkeypatch.setattr(vnni, "available", lambda: False)
    with pytest.raises(RuntimeError, match="does not run on this host.*AVX-512 VNNI"):
        vnni.engine_matmul(jnp.ones((1, 2, 4)), jnp.ones((1, 4, 3)))
    with pytest.raises(RuntimeError, match="does not run on this host.*AVX-512 VNNI"):
        vnni.attention_direct(np.ones((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32),
                              np.ones((1, 2, 4), np.float32), scale=1.0, storage="float32")


# -- the engine's element-wise ops and norms ------------------------------------------------------


def _engine_inputs(shape, seed=0):
    """Values over the ops' ranges, with the edge cases each must pass: signed zeros, a float32
    subnormal, values past erf's and tanh's clamps and past float16's range, inf and NaN."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 4).astype(np.float32)
    flat = x.reshape(-1)
    edges = [0.0, -0.0, 1e-40, -3e-39, 3.9, -3.8, 8.5, -25.0, 7e4, -1e5, np.inf, -np.inf, np.nan, 3e-4, -1e-5]
    flat[:len(edges)] = edges[:flat.size]
    return x


def _xla_engine(fn, *args, **kwargs):
    """An engine op's XLA steps: traced afresh with the native kernels switched off."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIDRA_NATIVE_ENGINE", "0")
        return jax.tree.map(np.asarray, jax.jit(lambda *a: fn.__wrapped__(*a, **kwargs))(*args))


@needs_vnni
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("op", vnni.MAP_OPS)
def test_native_elementwise_ops_are_xlas(op, precision):
    """The kernel's erf and tanh are XLA:CPU's interpolants (XLA's fused loops differ from its
    unfused ones by an ulp of erf now and then), sigmoid and SiLU use the kernel's exp: within 3
    ulp of the format plus 4 float32 ulp of |x| of XLA's fused op, mostly the same bits, NaN
    where XLA gives NaN. The custom call and the direct call agree to the bit."""
    x = _engine_inputs((37, 1531))
    fn = engine.ELEMENTWISE[op]
    assert engine.native(op, precision)
    kernel = np.asarray(fn(x, precision=precision))
    direct = engine.direct(op, x, precision=precision)
    np.testing.assert_array_equal(kernel, direct)
    xla = _xla_engine(fn, x, precision=precision)
    ulp = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}[precision]
    finite = np.isfinite(xla)
    np.testing.assert_array_equal(np.isnan(kernel), np.isnan(xla))
    np.testing.assert_array_equal(kernel[~finite & ~np.isnan(xla)], xla[~finite & ~np.isnan(xla)])
    gap = np.abs(kernel - xla)[finite]
    assert np.all(gap <= 3 * ulp * np.abs(xla[finite]) + 4 * np.abs(x[finite]) * 2.0 ** -23 + 1e-38)
    assert np.mean(kernel == xla) > (0.8 if op in ("sigmoid", "silu") and precision == "fp32" else 0.95)


@needs_vnni
def test_the_int8_lut_mode_stays_on_xla():
    assert not engine.native("gelu", "int8") and engine.native("layer_norm", "int8")


@needs_vnni
@pytest.mark.parametrize("precision,ulp", [("fp32", 2.0 ** -21), ("fp16", 2.0 ** -10), ("bf16", 2.0 ** -7)])
@pytest.mark.parametrize("op", engine.NORMS)
@pytest.mark.parametrize("shape,ndim", [((37, 384), 1), ((2, 5, 3, 31), 2), ((0, 16), 1), ((3, 1), 1)])
def test_native_norms_are_within_a_rounding_of_xlas(op, precision, ulp, shape, ndim):
    """Layer and RMS norms sum in float32 in another order than XLA: the same result within one
    unit of the format's last place (scaled by the row's largest output), the statistics too;
    custom call and direct call to the bit."""
    x = _engine_inputs(shape, seed=1)
    x[~np.isfinite(x)] = 1.0
    x = np.clip(x, -60, 60)
    rs = np.random.default_rng(2)
    w = rs.standard_normal(shape[len(shape) - ndim:]).astype(np.float32)
    b = rs.standard_normal(w.shape).astype(np.float32)
    if op == "layer_norm":
        kw = dict(eps=1e-5, ndim=ndim, precision=precision)
        kernel = engine.layer_norm(x, w, b, stats=True, **kw)
        direct = engine.direct(op, x, weight=w, bias=b, stats=True, **kw)
        xla = _xla_engine(engine.layer_norm, x, w, b, stats=True, **kw)
    else:
        kw = dict(eps=1e-6, ndim=ndim, precision=precision)
        kernel, direct, xla = (engine.rms_norm(x, w, **kw), engine.direct(op, x, weight=w, **kw),
                               _xla_engine(engine.rms_norm, x, w, **kw))
    for k, d, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (kernel, direct, xla))):
        np.testing.assert_array_equal(np.asarray(k), d)
        assert d.shape == r.shape
        scale = np.abs(r).max(initial=1.0)
        np.testing.assert_allclose(d, r, rtol=0, atol=2 * ulp * scale)


@needs_vnni
def test_the_bfloat16_rounding_keeps_subnormals_and_nans():
    """The kernel rounds to bfloat16 by integers, as XLA converts: subnormals are kept (the CPU's
    conversion instruction flushes them), to nearest even, NaN stays NaN."""
    x = np.array([1e-39, -2.5e-40, 1.00390625, 1.01171875, 3.3895e38, np.nan, -np.inf] * 3, np.float32)
    got = engine.direct("relu", np.abs(x), precision="bf16")
    want = np.asarray(jnp.asarray(np.abs(x)).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert got[0] > 0 and np.isnan(got[5])


@needs_vnni
def test_a_direct_engine_call_refuses_an_unknown_op_or_format():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="unknown op"):
        vnni.engine_map_direct(x, "gelu", storage="float8")
    with pytest.raises(ValueError, match="unknown format"):
        vnni.engine_norm_direct(x, None, None, eps=1e-5, rms=False, storage="int4")

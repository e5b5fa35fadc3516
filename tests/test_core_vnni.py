"""sidra_core.vnni: the AVX-512 VNNI / BF16 custom calls for the crossbar's partial sums and read-noise
variances, against float64 matmuls of the same operands; the fused read against the same steps in
XLA; layouts, threads and build errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidra_core import crossbar, rng, vnni

needs_vnni = pytest.mark.skipif(not vnni.available(), reason="this host cannot run the AVX-512 VNNI kernel")


def _operands(rows, k, n, terms, seed):
    rs = np.random.default_rng(seed)
    gk = -(-k // 256)
    w = rs.integers(-127, 128, (gk, 256, terms * n)).astype(np.int8)
    var = rs.random((gk, 256, n)).astype(np.float32) * 0.3
    codes = rs.integers(-127, 128, (rows, k)).astype(np.float32)
    return w, var, codes


def _reference(w, var, codes, k, n, terms):
    """Per-tile float64 sums over the live word lines: p = x @ (whole + fraction / 254) and
    v = bf16(x^2) @ bf16(var) (the kernel's operands exactly; only its sums round)."""
    gk = w.shape[0]
    wf = w.astype(np.float64)
    wf = wf[..., :n] + wf[..., n:] / 254 if terms == 2 else wf
    bf = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    vf, x2 = bf(var), bf(codes * codes)
    x = codes.astype(np.float64)
    p, v = [], []
    for i in range(gk):
        used = min(256, k - 256 * i)
        p.append(x[:, 256 * i:256 * i + used] @ wf[i, :used])
        v.append(x2[:, 256 * i:256 * i + used] @ vf[i, :used])
    return np.stack(p), np.stack(v)


def _pack(w, var, k, terms, noise=True):
    return jax.jit(vnni.pack, static_argnames=("k", "terms"))(
        tuple(jnp.asarray(w)), tuple(jnp.asarray(var)) if noise else None, k=k, terms=terms)


def _run(w, var, codes, k, n, terms, noise=True):
    wp, corr, sp = _pack(w, var, k, terms, noise)
    p, v = jax.jit(lambda c: vnni.tile_dots(c, wp, corr, sp, k=k, n=n))(jnp.asarray(codes))
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
    np.testing.assert_allclose(v, ve, rtol=1e-5, atol=1e-6 * ve.max())


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
    packed = [jax.jit(vnni.pack, static_argnames=("k", "terms"))(tuple(jnp.asarray(w)), tuple(jnp.asarray(v)),
                                                                  k=700, terms=2) for w, v, _ in ops]

    @jax.jit
    def both(c1, c2):
        return [vnni.tile_dots(c, *pk, k=700, n=300) for c, pk in zip((c1, c2), packed)]

    (p1, v1), (p2, v2) = both(*(jnp.asarray(c) for _, _, c in ops))
    for (w, var, codes), p, v in zip(ops, (p1, p2), (v1, v2)):
        pe, ve = _reference(w, var, codes, 700, 300, 2)
        np.testing.assert_allclose(np.asarray(p), pe, rtol=0, atol=4e-7 * np.abs(pe).max())
        np.testing.assert_allclose(np.asarray(v), ve, rtol=1e-5, atol=1e-6 * ve.max())


def _read(w, var, codes, k, n, terms, seed=5, noise=True, lsb=None, gain=None, qmax=127.0):
    wp, corr, sp = _pack(w, var, k, terms, noise)
    lsb, gain = (None if a is None else jnp.asarray(a) for a in (lsb, gain))
    y = jax.jit(lambda c, s: vnni.tile_read(c, wp, corr, sp, lsb, gain, s, k=k, n=n, qmax=qmax))(
        jnp.asarray(codes), jnp.uint32(seed))
    return np.asarray(y)


def _xla_read(p, v, seed, lsb=None, gain=None, qmax=127.0):
    """The read's steps after the dots as sidra_core.crossbar's XLA path takes them, in one jitted
    program (XLA contracts products into sums there): one Box-Muller pair per (tile pair, row,
    column), counters row-major, noise, ADC, gain, tile sum in order."""

    @jax.jit
    def steps(p, v, lsb, gain):
        gk, rows, n = p.shape
        y = None
        for i in range(gk):
            t = p[i]
            if v is not None:
                if i % 2 == 0:
                    z = rng.box_muller(jnp.uint32(seed), jax.lax.iota(jnp.uint32, rows * n).reshape(rows, n)
                                       + jnp.uint32(i // 2 * rows * n))
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
def test_reads_running_at_once_each_give_their_own_sums():
    """Two fused reads in one program (XLA may run them in parallel; the helper steps back) give
    what each gives alone."""
    ops = [_operands(200, 700, 300, 2, seed=s) for s in (3, 4)]
    packed = [_pack(w, v, 700, 2) for w, v, _ in ops]

    @jax.jit
    def both(c1, c2):
        return [vnni.tile_read(c, *pk, None, None, jnp.uint32(7), k=700, n=300, qmax=127.0)
                for c, pk in zip((c1, c2), packed)]

    for (w, var, codes), y in zip(ops, both(*(jnp.asarray(c) for _, _, c in ops))):
        np.testing.assert_array_equal(np.asarray(y), _read(w, var, codes, 700, 300, 2, seed=7))


@needs_vnni
def test_an_operand_in_another_layout_is_refused():
    w, var, codes = _operands(4, 300, 40, 2, seed=1)
    wp, corr, sp = _pack(w, var, 300, 2)
    xu = jnp.zeros((4, 512), jnp.uint8)
    x2 = jnp.zeros((4, 512), jnp.bfloat16)
    empty = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((4, 40), jnp.float32)
    flat = wp.reshape(wp.shape[0], -1)  # not the packed 6-d layout
    with pytest.raises(Exception, match="sidra_tile_read: unexpected operand layout"):
        jax.block_until_ready(jax.ffi.ffi_call(vnni.READ_TARGET, out)(
            xu, x2, flat, corr, sp, empty, empty, jnp.uint32(0), k=np.int64(300), n=np.int64(40),
            terms=np.int64(2), noise=np.int64(1), qmax=np.float32(127)))
    with pytest.raises(Exception, match="sidra_tile_dots: unexpected operand layout"):
        jax.block_until_ready(jax.ffi.ffi_call(vnni.TARGET, (out, out))(
            xu, x2, flat, corr, sp, k=np.int64(300), n=np.int64(40), terms=np.int64(2), noise=np.int64(1)))


@pytest.mark.parametrize("terms", [1, 2])
def test_unpack_inverts_pack_and_zeroes_dead_word_lines(terms):
    w, var, _ = _operands(1, 300, 21, terms, seed=3)
    wp, corr, sp = jax.jit(vnni.pack, static_argnames=("k", "terms"))(
        tuple(jnp.asarray(w)), tuple(jnp.asarray(var)), k=300, terms=terms)
    back = np.asarray(vnni.unpack(wp, 21))
    want = w.copy()
    want[1, 300 - 256:] = 0  # word lines past K hold nothing the kernel may read
    np.testing.assert_array_equal(back, want)
    np.testing.assert_array_equal(np.asarray(corr).transpose(0, 2, 1, 3).reshape(2, terms, -1)[..., :21],
                                  128 * want.astype(np.int32).sum(axis=1).reshape(2, terms, 21))
    assert sp.dtype == jnp.bfloat16 and sp.shape == (2, 2, 128, 16, 2)


@needs_vnni
def test_a_fresh_build_exports_every_kernel(tmp_path):
    """What a clean machine does at the first snapshot: compile the source into the cache."""
    import ctypes

    vnni._build(tmp_path / "k.so")
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    assert lib.SidraTileDots and lib.SidraTileRead and lib.SidraPackTiles
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

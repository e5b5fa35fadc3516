"""The crossbar's reads as AVX-512 VNNI dots: small C++ XLA custom calls (`vnni_dots.cc`).

On hosts without AMX, XLA:CPU's int8 dot runs at its float32 speed, while the CPU's VNNI
instructions do int8 MACs at 4x its float32 FMA rate; with
AMX, XLA's int8 dot is slow at the few rows of eager calls, where these read pre-packed tiles. One
call computes every tile's INT8 partial sums and exact read-noise variances (`tile_dots`);
the MVM's (`mvm`) is the whole read: the DAC, those dots, the noise draw, the ADC, the tile sum
and the dequantisation in one pass, drawing the noise as `sidra_core.rng.box_muller` does;
`mvm_direct` is that read called straight on host buffers (eager reads: no XLA program at any row
count), `ispp_write` is ISPP write-verify cell by cell (the same bits as sidra_core.ispp's XLA
chunks), `program` a fresh weight's whole write (sidra_core.crossbar.program's bits), and
`snapshot` reads a programmed weight into the packed tiles (the same bits as sidra_core.crossbar's
XLA read). It is compiled once per source and jaxlib version into the user's
cache (a C++ compiler is needed; without one, or on a CPU without AVX-512 VNNI,
`available()` is false and XLA's dots and ISPP are used).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import dlpack

TARGET = "sidra_tile_dots"
MVM_TARGET = "sidra_mvm"
ENGINE_MATMUL_TARGET = "sidra_engine_matmul"
ATTENTION_TARGET = "sidra_attention"
ENGINE_MAP_TARGET = "sidra_engine_map"
ENGINE_NORM_TARGET = "sidra_engine_norm"
MAP_OPS = ("relu", "gelu", "gelu_tanh", "tanh", "sigmoid", "silu")  # the kernel's MapOp codes, in order
MAX_ENGINE_K = 65536  # the engine matmul sums a row in one int32
PACK_TARGET = "sidra_pack_tiles"
_SOURCE = Path(__file__).with_name("vnni_dots.cc")
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw",
          "-mavx512vl", "-mavx512vnni", "-mfma", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math")
_CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")

TILE_ROWS = 256
LANES = 16
_ISPP_CELLS = 4096  # cells of one of the kernel's programming work items (kIsppCells)


def _library_path() -> Path:
    import jaxlib

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + jaxlib.__version__.encode())
    root = os.environ.get("SIDRA_NATIVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sidra", "native"))
    return Path(root) / f"sidra_vnni_{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    """Compile the kernel to `path` (atomically: concurrent first imports build it once)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(out)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
            os.replace(out, path)


def load(path: Path | None = None) -> None:
    """Build the kernels if needed, load them and register them with XLA (raises on failure)."""
    import ctypes

    path = _library_path() if path is None else path
    if not path.exists():
        _build(path)
    lib = ctypes.CDLL(str(path))
    _entry_points(lib)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SidraTileDots), platform="cpu")
    jax.ffi.register_ffi_target(MVM_TARGET, jax.ffi.pycapsule(lib.SidraMvm), platform="cpu")
    jax.ffi.register_ffi_target(ENGINE_MATMUL_TARGET, jax.ffi.pycapsule(lib.SidraEngineMatmul), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.SidraAttention), platform="cpu")
    jax.ffi.register_ffi_target(PACK_TARGET, jax.ffi.pycapsule(lib.SidraPackTiles), platform="cpu")
    jax.ffi.register_ffi_target(ENGINE_MAP_TARGET, jax.ffi.pycapsule(lib.SidraEngineMap), platform="cpu")
    jax.ffi.register_ffi_target(ENGINE_NORM_TARGET, jax.ffi.pycapsule(lib.SidraEngineNorm), platform="cpu")


_LIB: dict = {}


def _entry_points(lib) -> None:
    """The library's C entry points, called outside XLA (the *_direct functions, ispp_*), typed."""
    import ctypes

    p, i64, u32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_float
    for key, symbol, args, result in (
            ("mvm", "sidra_mvm_direct", [p, i64, p, p, p, p, i64, i64, i64, i64, i64, p, p, p, p, u32, f32, f32, p],
             ctypes.c_int),
            ("attention", "sidra_attention_direct",
             [p, p, p, i64, i64, i64, i64, i64, i64, i64, f32, i64, f32, p, p, i64, p], ctypes.c_int),
            ("engine_map", "sidra_engine_map", [p, i64, i64, i64, p], ctypes.c_int),
            ("engine_norm", "sidra_engine_norm", [p, i64, i64, p, p, f32, i64, i64, p, p, p], ctypes.c_int),
            ("ispp_write", "sidra_ispp_write", [p, p, p, p, i64, u32, u32, p, ctypes.c_int32, p, p], None),
            ("drift_exponents", "sidra_drift_exponents", [p, i64, u32, f32, f32, p], None),
            ("program", "sidra_program", [p, i64, i64, i64, i64, p, i64, p, p, ctypes.c_int32, ctypes.c_int32,
                                          p, ctypes.c_int32, p, p, p, p, p, p, p, p, p, p, p, p], None),
            ("snapshot", "sidra_snapshot",
             [p, p, p, p, f32, f32, i64, i64, i64, i64, i64, f32, f32, p, p, ctypes.c_int32, p, p, i64, p, p, i64,
              p, p, p, p, p, p, p, p, p], ctypes.c_int)):
        f = getattr(lib, symbol)
        f.argtypes, f.restype = args, result
        _LIB[key] = f


def host_supports() -> bool:
    """Whether this host has what the kernel needs: Linux and a CPU with AVX-512 VNNI (F, BW and VL with it)."""
    from sidra_core import host

    return sys.platform.startswith("linux") and all(f in host.cpu_flags() for f in _CPU_FEATURES)


@functools.cache
def available() -> bool:
    """Whether the VNNI kernel runs here: the CPU has the instructions and the kernel is built and
    registered with XLA (built on the first call; a failed build warns once and returns False)."""
    if not host_supports():
        return False
    try:
        load()
    except (OSError, RuntimeError, AttributeError) as e:
        warnings.warn(f"sidra: the AVX-512 VNNI crossbar kernel is not available ({e}); "
                      "the MVM uses XLA's dots instead", RuntimeWarning, stacklevel=2)
        return False
    return True


def _call(target, shapes):
    """jax.ffi.ffi_call of one of the kernels, which must run here (available(): built and registered)."""
    if not available():
        raise RuntimeError(f"the VNNI kernel {target} does not run on this host (sidra_core.vnni.available() "
                           "is False): it needs Linux, AVX-512 VNNI and a C++ compiler")
    # (vmapped, as over a population's chips, the kernel runs once per batch entry: the same bits)
    return jax.ffi.ffi_call(target, shapes, vmap_method="sequential")


def pack(w, var, k: int, terms: int):
    """Per-tile weights (a sequence of grid_k (256, terms N) arrays) int8 (whole codes [| fractions]) and
    variance levels (grid_k of (256, N), integers 0..255: crossbar._variance_levels) or None -> the
    kernel's layouts: int8 (grid_k, NV, terms, 64, 16, 4), the int32 column corrections 128 sum_k w
    (grid_k, NV, terms, 16), uint8 levels (grid_k, NV, 64, 16, 4). Word lines past K are zeroed
    (the kernel reads the last tile in whole groups of 4)."""
    w = jnp.stack(w)
    gk, rows, tn = w.shape
    nv = -(-(tn // terms) // LANES)
    noise = var is not None
    s = jnp.stack(var).astype(jnp.uint8) if noise else jnp.zeros((gk, rows, 0), jnp.uint8)
    shapes = (jax.ShapeDtypeStruct((gk, nv, terms, rows // 4, LANES, 4), jnp.int8),
              jax.ShapeDtypeStruct((gk, nv, terms, LANES), jnp.int32),
              jax.ShapeDtypeStruct((gk, nv, rows // 4, LANES, 4) if noise else (0,), jnp.uint8))
    wp, corr, sp = _call(PACK_TARGET, shapes)(
        w, s, k=np.int64(k), terms=np.int64(terms), noise=np.int64(noise))
    return wp, corr, (sp if noise else None)


def unpack(wp, n: int):
    """The packed int8 weights back as (grid_k, 256, terms N) (the inverse of `pack`'s layout)."""
    gk, nv, terms, groups, lanes, four = wp.shape
    w = wp.transpose(0, 3, 5, 2, 1, 4).reshape(gk, groups * four, terms, nv * lanes)[..., :n]
    return w.reshape(gk, groups * four, terms * n)


def _operands(codes, wp, sp, step, k: int):
    """The kernel's inputs from INT8 DAC codes (rows, K): codes + 128 as uint8 and, with variances,
    codes^2 as two 7-bit halves (rows, 2, Kp) uint8, both padded to whole tiles (Kp); empty
    stand-ins without read noise."""
    kp = wp.shape[0] * TILE_ROWS
    xu = jnp.pad((codes + 128).astype(jnp.uint8), ((0, 0), (0, kp - k)), constant_values=128)
    if sp is None:
        return xu, jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.uint8), jnp.zeros((0,), jnp.float32)
    sq = jnp.pad((codes * codes).astype(jnp.int32), ((0, 0), (0, kp - k)))
    return xu, jnp.stack([sq >> 7, sq & 127], axis=1).astype(jnp.uint8), sp, jnp.asarray(step, jnp.float32)


def tile_dots(codes, wp, corr, sp, step, *, k: int, n: int):
    """Every tile's partial sums p (grid_k, rows, N) of INT8 DAC codes (rows, K) against the
    packed weights, as float32 (whole + fraction / 254 for two terms), and with variance levels
    `sp` of `step` (grid_k, N) their read-noise variances v = (x^2 @ levels) step (crossbar._variance's
    bits), else None."""
    gk, terms = wp.shape[0], wp.shape[2]
    noise = sp is not None
    xu, x2, sv, st = _operands(codes, wp, sp, step, k)
    out = jax.ShapeDtypeStruct((gk, codes.shape[0], n), jnp.float32)
    p, v = _call(TARGET, (out, out))(
        xu, x2, wp, corr, sv, st, k=np.int64(k), n=np.int64(n), terms=np.int64(terms), noise=np.int64(noise))
    return p, (v if noise else None)


def mvm(x, wp, corr, sp, step, lsb, gain, scale, bias, seed, *, k: int, n: int, qmax: float, dac_qmax: float):
    """y (rows, N) of float32 inputs x (rows, K) as `crossbar.mvm` computes it, the same bits
    (but where XLA contracts a product the kernel rounds, see the tests): the DAC (per-row codes
    of +-dac_qmax, `quant.quantise_rows`), each tile's partial sums, with variance levels `sp` of
    `step` (grid_k, N) plus read noise drawn as `crossbar.mvm` draws it (`seed`), through the ADC
    of step `lsb` (grid_k, N) and +-qmax codes when given, times the drift gain (grid_k, N) when
    given; the tile sum times each row's DAC scale and the column `scale` (N,), plus `bias` (N,)
    when given."""
    terms = wp.shape[2]
    noise = sp is not None
    empty = jnp.zeros((0,), jnp.float32)
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return _call(MVM_TARGET, out)(
        x, wp, corr, sp if noise else jnp.zeros((0,), jnp.uint8),
        jnp.asarray(step, jnp.float32) if noise else empty,
        empty if lsb is None else lsb,
        empty if gain is None else gain, scale, empty if bias is None else bias,
        jnp.asarray(0 if seed is None else seed, jnp.uint32), k=np.int64(k), n=np.int64(n), terms=np.int64(terms),
        noise=np.int64(noise), qmax=np.float32(qmax), dac_qmax=np.float32(dac_qmax))


def _direct(name: str):
    """The library's C entry point `name` (_entry_points), which must run here."""
    if not available():
        raise RuntimeError(f"the VNNI kernel's {name} does not run on this host (sidra_core.vnni.available() is "
                           "False): it needs Linux, AVX-512 VNNI and a C++ compiler")
    return _LIB[name]


def _address(a) -> int | None:
    """The host address of a dense array's data (None for None); a jax.Array's once its program has
    written it (dispatch is asynchronous: a snapshot's pack may still be running)."""
    if a is None:
        return None
    return a.ctypes.data if isinstance(a, np.ndarray) else a.block_until_ready().unsafe_buffer_pointer()


def mvm_weights(wp, corr, sp, step, lsb, gain, scale) -> tuple:
    """A packed weight's operands of `mvm_direct` (jax or NumPy arrays, see `mvm`) as the kernel takes
    them: their addresses and the layout (grid_k, NV, terms). The arrays must outlive its reads."""
    return (_address(wp), _address(corr), _address(sp), _address(step), *wp.shape[:3], _address(lsb), _address(gain),
            _address(scale))


def mvm_direct(x: np.ndarray, weights: tuple, bias, seed: int, *, k: int, n: int, qmax: float,
               dac_qmax: float) -> np.ndarray:
    """`mvm` on a host array x (rows, K) float32, C-contiguous, called straight into the kernel: no
    XLA program, so any row count runs without a compile or padding (the same bits: each row's
    noise draws are keyed by its row index alone). `weights` is `mvm_weights`'s; bias a NumPy array
    (N,) or None."""
    call = _direct("mvm")
    rows = x.shape[0]
    y = np.empty((rows, n), np.float32)
    wp, corr, sp, step, gk, nv, terms, lsb, gain, scale = weights
    if call(x.ctypes.data, rows, wp, corr, sp, step, gk, nv, k, n, terms, lsb, gain, scale, _address(bias), int(seed),
            qmax, dac_qmax, y.ctypes.data):
        raise ValueError("sidra_mvm_direct: unexpected operand layout")
    return y


def _flat(a, dtype) -> np.ndarray:
    return np.ascontiguousarray(np.ravel(a), dtype)


def _pulse_floats(params: tuple) -> tuple[np.ndarray, int]:
    """ispp.pulse_params as the kernel takes them: its floats in order (tol_u, read_sigma, step0, ramp,
    c2c, g_min_u, relax, g_min, span) and max_pulses apart."""
    return np.array(params[:5] + params[6:], np.float32), int(params[5])


def ispp_write(g0, g1, stuck, ids, seed: int, relax_seed: int, params: tuple) -> tuple[np.ndarray, np.ndarray]:
    """`ispp.program_cells`'s write-verify of cells from g0 towards g1 (siemens; `stuck` cells never
    move), cell by cell in the kernel's threads (the same bits as its XLA chunks): each cell's final G
    and pulses given. `params` as ispp._pulse_chunk's."""
    g0, g1, ids = _flat(g0, np.float32), _flat(g1, np.float32), _flat(ids, np.uint32)
    stuck = None if stuck is None else _flat(stuck, np.bool_)
    floats, max_pulses = _pulse_floats(params)
    g, pulses = dlpack.empty(g0.size, np.float32), np.empty(g0.size, np.int32)
    _direct("ispp_write")(g0.ctypes.data, g1.ctypes.data, None if stuck is None else stuck.ctypes.data,
                          ids.ctypes.data, g0.size, int(seed), int(relax_seed), floats.ctypes.data, int(max_pulses),
                          g.ctypes.data, pulses.ctypes.data)
    return g, pulses


def drift_exponents(ids, seed: int, mean: float, std: float) -> np.ndarray:
    """`crossbar._draw_nu` in the kernel's threads (the same bits): max(mean + std z, 0) per cell id."""
    ids = np.ascontiguousarray(ids, np.uint32)
    nu = dlpack.empty(ids.shape, np.float32)
    _direct("drift_exponents")(ids.ctypes.data, ids.size, int(seed), mean, std, nu.ctypes.data)
    return nu


def program(codes: np.ndarray, tile_ids, *, rows: int, cols: int, grid_n: int, seeds, cells: tuple, pulses: tuple,
            ispp: bool, drifts: bool, levels=None):
    """`crossbar.program`'s fresh write of INT8 codes (padded to the tile grid) in the kernel's threads
    (the same bits as its XLA path): per plane (plus, minus) the conductances (float32 siemens, or
    with `levels` (a cells.Levels) uint16 levels), their int8 residuals (cells.Levels.residuals;
    None without `levels`), drift exponents (None unless `drifts`), stuck map, pulses given, and the
    bits of the cells written and not stuck (cells.pack_bits). `seeds` (8) as sidra_program's;
    `cells`: stuck off rate, off + on rate, dG, g_min, g_max, nu mean, nu std; `pulses`:
    ispp.pulse_params."""
    codes = np.ascontiguousarray(codes, np.int8)
    kp, np_ = codes.shape
    tiles = np.ascontiguousarray(tile_ids, np.uint32)
    seeds = np.asarray(seeds, np.uint32)
    floats, max_pulses = _pulse_floats(pulses)
    params = np.concatenate([np.asarray(cells, np.float32), floats])
    lv = None if levels is None else np.asarray([levels.g_min, levels.step], np.float32)
    g = [dlpack.mapped(codes.shape, np.float32 if lv is None else np.uint16) for _ in range(2)]
    res = [None if lv is None else np.empty(codes.shape, np.int8) for _ in range(2)]
    nu = [dlpack.mapped(codes.shape, np.float32) for _ in range(2)] if drifts else [None, None]
    stuck = [dlpack.mapped(codes.shape, np.int8) for _ in range(2)]
    writes = [dlpack.mapped(codes.shape, np.int32) for _ in range(2)]
    bits = [np.empty(-(-codes.size // 8), np.uint8) for _ in range(2)]
    _direct("program")(codes.ctypes.data, kp, np_, rows, cols, tiles.ctypes.data, grid_n, seeds.ctypes.data,
                       params.ctypes.data, int(max_pulses), int(ispp), None if lv is None else lv.ctypes.data,
                       0 if levels is None else levels.shift,
                       *(None if a is None else a.ctypes.data for a in (*g, *res, *nu, *stuck, *writes, *bits)))
    return g, res, nu, stuck, writes, bits


def snapshot(gp, gm, nu_p, nu_m, age_p: float, age_m: float, *, grid_k: int, grid_n: int, cols: int, k: int,
             n: int, dg: float, var_c: float | None, levels=None, codes=None, bits=None, tile_ids=None,
             nu_seeds=None, nu_draw=None):
    """`crossbar._read_array`'s packed read in the kernel's threads (the same bits), without IR drop or
    drift compensation: the cells drifted by exp(-nu age) (nu None: no drift); packed (whole[,
    fraction]) codes and their column corrections, packed variance levels and their step per tile
    column (None without read noise: var_c None), and the terms packed. Cells as sidra_core.cells
    holds them: `levels` (a cells.Levels) with gp, gm the planes' cells.Residuals of `codes`; else
    float32 siemens; `bits` (the planes' drift bits) with `tile_ids`, `nu_seeds` and `nu_draw`
    (mean, std): exponents drawn in the kernel."""
    nv = -(-n // LANES)
    groups = TILE_ROWS // 4
    wp = dlpack.empty((grid_k, nv, 2, groups, LANES, 4), np.int8)
    corr = dlpack.empty((grid_k, nv, 2, LANES), np.int32)
    noise = var_c is not None
    sp = dlpack.empty((grid_k, nv, groups, LANES, 4), np.uint8) if noise else None
    step = dlpack.empty((grid_k, n), np.float32) if noise else None
    planes = [np.ascontiguousarray(g, np.float32) for g in (gp, gm)] if levels is None else \
        [np.ascontiguousarray(g.r, np.int8) for g in (gp, gm)]
    arrays = [*planes, *(None if a is None else np.ascontiguousarray(a, np.float32) for a in (nu_p, nu_m))]
    cells = [None, None]  # the levels' grid and the codes
    exceptions = [None, None, 0] * 2  # per plane: flat indices, levels, count
    if levels is not None:
        cells = [np.asarray([levels.g_min, levels.step], np.float32), np.ascontiguousarray(codes, np.int8)]
        exceptions = []
        for g in (gp, gm):
            idx, exact = np.ascontiguousarray(g.idx, np.int64), np.ascontiguousarray(g.level, np.uint16)
            exceptions += [idx, exact, idx.size]
    drawn = [None] * 5
    if bits is not None:
        mean, std = nu_draw
        drawn = [np.ascontiguousarray(bits[0], np.uint8), np.ascontiguousarray(bits[1], np.uint8),
                 np.ascontiguousarray(tile_ids, np.uint32), np.asarray(nu_seeds, np.uint32),
                 np.asarray([std, mean], np.float32)]

    def ptr(a):
        return a if a is None or isinstance(a, int) else a.ctypes.data

    terms = _direct("snapshot")(*map(ptr, arrays), age_p, age_m, grid_k, grid_n, cols, k, n, dg,
                                0.0 if var_c is None else var_c, *map(ptr, cells),
                                0 if levels is None else levels.shift, *map(ptr, exceptions), *map(ptr, drawn),
                                wp.ctypes.data, corr.ctypes.data, None if sp is None else sp.ctypes.data,
                                None if step is None else step.ctypes.data)
    if terms == 1:  # one term: the layouts' first half
        wp = wp.reshape(-1)[:wp.size // 2].reshape(grid_k, nv, 1, groups, LANES, 4)
        corr = corr.reshape(-1)[:corr.size // 2].reshape(grid_k, nv, 1, LANES)
    return wp, corr, sp, step, terms


def engine_matmul(a, b, *, qmax: float = 127.0):
    """The compute engine's INT8 matmul (`engine.matmul`, mode "int8") of float32 a (..., M, K) and
    b (..., K, N), batch dimensions broadcast: rows of a and columns of b quantised to codes of
    +-qmax, summed exactly in int32, rescaled; the XLA path's bits (K <= MAX_ENGINE_K)."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    (m, k), n = a.shape[-2:], b.shape[-1]
    nb = int(np.prod(batch, dtype=np.int64))
    a3 = jnp.broadcast_to(a, (*batch, m, k)).reshape(nb, m, k)
    b3 = jnp.broadcast_to(b, (*batch, k, n)).reshape(nb, k, n)
    y = _call(ENGINE_MATMUL_TARGET, jax.ShapeDtypeStruct((a3.shape[0], m, n), jnp.float32))(
        a3, b3, qmax=np.float32(qmax))
    return y.reshape(*batch, m, n)


_FORMATS = {"float32": 0, "float16": 1, "bfloat16": 2}


def _mask_operands(m, mask, causal: bool, shape: tuple):
    """The kernel's (keep, add) mask operands of the scores' `shape` (..., S_q, S_k) in array module
    `m` (numpy or jax.numpy), or None each: a bool `mask` keeps where True, a float one is added,
    after `causal`'s lower triangle (folded in), as engine.attention applies them."""
    tril = m.tril(m.ones(shape[-2:], bool)) if causal else None
    if mask is not None and mask.dtype != np.bool_:
        add = m.asarray(mask, np.float32)
        return None, m.broadcast_to(add if tril is None else m.where(tril, add, -np.inf), shape).astype(np.float32)
    if mask is None and tril is None:
        return None, None
    keep = tril if mask is None else mask if tril is None else mask & tril
    return m.broadcast_to(keep, shape).astype(np.uint8), None


def attention_direct(q, k, v, mask=None, causal: bool = False, *, scale: float, storage: str,
                     qmax: float = 127.0) -> np.ndarray:
    """`attention` (heads first: q, k (..., S, D), v (..., S, Dv), leading dimensions broadcast) on
    host arrays, called straight into the kernel: no XLA program, so any lengths run unpadded."""
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    nb = math.prod(lead)
    q, k, v = (np.ascontiguousarray(np.broadcast_to(t, (*lead, *t.shape[-2:])), np.float32) for t in (q, k, v))
    (sq, d), (sk, dv) = q.shape[-2:], v.shape[-2:]
    keep, add = (None if a is None else np.ascontiguousarray(a)
                 for a in _mask_operands(np, None if mask is None else np.asarray(mask), causal, (*lead, sq, sk)))
    y = np.empty((*lead, sq, dv), np.float32)
    if _direct("attention")(q.ctypes.data, k.ctypes.data, v.ctypes.data, nb, 1, sq, sk, d, dv, 1, scale,
                            _FORMATS[storage], qmax, _address(keep), _address(add), int(not causal), y.ctypes.data):
        raise ValueError("sidra_attention_direct: unexpected operand layout")
    return y


def attention(q, k, v, mask=None, causal: bool = False, *, scale: float, storage: str, heads_first: bool,
              qmax: float = 127.0):
    """The engine's attention (`engine.attention`) in one call: INT8 q k^T, x scale, the mask (a
    bool one keeps where True, a float one is added: XLA contracts the scale's product into that sum
    unless the causal select comes between), stored as `storage`, the safe softmax, INT8 with v;
    float32 q, k (..., S, D), v (..., S, Dv) with `heads_first`, else (B, S, H, D)
    (jax.nn.dot_product_attention's layout). Within a float32 rounding of the XLA path's scores
    (its exp and sums), so the same codes but rarely."""
    if heads_first:  # any leading dimensions, broadcast, as one head each
        lead = jnp.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        nb = int(np.prod(lead, dtype=np.int64))
        scores = (*lead, q.shape[-2], k.shape[-2])
        q, k, v = (jnp.broadcast_to(t, (*lead, *t.shape[-2:])).reshape(nb, 1, *t.shape[-2:]) for t in (q, k, v))
        out_shape = (*lead, q.shape[-2], v.shape[-1])
    else:
        out_shape = (*q.shape[:3], v.shape[-1])
        scores = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    keep, add = _mask_operands(jnp, mask, causal, scores)
    y = _call(ATTENTION_TARGET, jax.ShapeDtypeStruct((*q.shape[:3], v.shape[-1]), jnp.float32))(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        jnp.zeros((0,), jnp.uint8) if keep is None else keep.reshape(-1),
        jnp.zeros((0,), jnp.float32) if add is None else add.reshape(-1), scale=np.float32(scale),
        heads_first=np.int64(heads_first), format=np.int64(_FORMATS[storage]), qmax=np.float32(qmax),
        contract=np.int64(not causal))
    return y.reshape(out_shape)


def engine_map(x, op: str, *, storage: str):
    """The engine's element-wise `op` (MAP_OPS) of float32 x, its input and result in `storage`'s
    format (engine._round: to nearest even, no saturation): erf and tanh as XLA:CPU's interpolants."""
    return _call(ENGINE_MAP_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x.astype(jnp.float32), op=np.int64(MAP_OPS.index(op)), format=np.int64(_FORMATS[storage]))


def engine_map_direct(x: np.ndarray, op: str, *, storage: str) -> np.ndarray:
    """`engine_map` on a host array, called straight into the kernel (no XLA program, any shape)."""
    x = np.asarray(x, np.float32, order="C")
    y = np.empty_like(x)
    code = MAP_OPS.index(op) if op in MAP_OPS else -1
    if _direct("engine_map")(x.ctypes.data, x.size, code, _FORMATS.get(storage, -1), y.ctypes.data):
        raise ValueError(f"sidra_engine_map: unknown op {op!r} or format {storage!r}")
    return y


def engine_norm(x, weight, bias, *, eps: float, rms: bool, storage: str):
    """Layer norm (or RMS norm, `rms`) of float32 rows x (rows, width), with weight and bias of
    `width` elements or None, in `storage`'s format: (y, mean (rows,), 1/std (rows,)); sums in
    float32."""
    rows = x.shape[0]
    empty = jnp.zeros((0,), jnp.float32)
    stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return _call(ENGINE_NORM_TARGET, (jax.ShapeDtypeStruct(x.shape, jnp.float32), stat, stat))(
        x.astype(jnp.float32), empty if weight is None else weight.reshape(-1).astype(jnp.float32),
        empty if bias is None else bias.reshape(-1).astype(jnp.float32), jnp.asarray(eps, jnp.float32),
        rms=np.int64(rms), format=np.int64(_FORMATS[storage]))


def engine_norm_direct(x: np.ndarray, weight, bias, *, eps: float, rms: bool, storage: str):
    """`engine_norm` on host arrays (weight and bias of `width` elements), called straight into the
    kernel (no XLA program, any rows)."""
    x = np.ascontiguousarray(x, np.float32)
    rows, width = x.shape
    w, b = (None if a is None else np.ascontiguousarray(a, np.float32).reshape(width) for a in (weight, bias))
    y, mean, rstd = np.empty_like(x), np.empty(rows, np.float32), np.empty(rows, np.float32)
    if _direct("engine_norm")(x.ctypes.data, rows, width, _address(w), _address(b), eps, int(rms),
                              _FORMATS.get(storage, -1), y.ctypes.data, mean.ctypes.data, rstd.ctypes.data):
        raise ValueError(f"sidra_engine_norm: unknown format {storage!r}")
    return y, mean, rstd

"""Crossbar tiles: programmed state, drift, and the analog MVM kernel.

A K x N weight is padded to a grid of `grid_k x grid_n` tiles and held as
two conductance arrays G+ and G- (the differential pair). Code c >= 0 is
`G+ = G_min + c dG, G- = G_min`, code c < 0 the mirror; `dG = (G_max -
G_min) / 127`. In the `float` weight mode (ideal chip) the pair holds the
float weight itself with dG = 1 and G_min = 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from . import buckets, dlpack, host, ispp, rng, vnni
from .blocks import map_blocks
from .cells import Levels, Residuals, Rewrites, pack_bits, per_cell, tile_max, tile_of, unpack_bits
from .mapping import TileGrid, tile_grid
from .quant import QMAX, QuantisedWeight, from_int8, quantise_rows, quantise_weight
from .spec import ChipSpec


@partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["k", "n", "rows", "cols", "terms", "narrow", "packed"])
@dataclass(frozen=True)
class _Shape:
    k: int
    n: int
    rows: int
    cols: int
    terms: int = 0  # how Snapshot.w holds the weights: 0 float32, 1 exact int8, 2 int8 (whole, fraction) pairs
    narrow: bool = False  # the tiles are held as one block-diagonal array (see _NARROW)
    packed: bool = False  # the int8 tiles are packed for the VNNI kernel (sidra_core.vnni), one array

    @property
    def grid_k(self) -> int:
        return -(-self.k // self.rows)


def held_bytes(a) -> int:
    """The host bytes array `a` holds: a broadcast view (a stride of 0) counts the values it stores."""
    strides = getattr(a, "strides", None)
    if strides and 0 in strides:
        return int(a.itemsize) * math.prod(d for d, st in zip(a.shape, strides) if st != 0)
    return int(a.nbytes)


# Cells a plane's residuals cannot hold, allowed for in the up-front estimate: rails, stuck cells'
# partners and failed verifies (0.2 % on y1), at 10 bytes each (an index and a level).
EXCEPTIONS_ALLOWED = 0.01


def state_bytes_per_cell(spec: ChipSpec) -> float:
    """Host bytes of a freshly programmed weight per padded cell pair (sidra_core.cells: the target
    code, both planes' int8 residuals and drift bits, and an allowance for exceptions; in float mode
    the float target and float32 conductances instead), so a model's need is known before it is
    programmed."""
    if spec.quantised:
        return 1 + 2 * (1 + 1 / 8 + 10 * EXCEPTIONS_ALLOWED)
    return 4 + 2 * (4 + 1 / 8)


def snapshot_bytes_per_weight(spec: ChipSpec) -> float:
    """Host bytes of a weight's read snapshot on this host (see `snapshot`): INT8 DAC codes read
    (whole, fraction) int8 pairs where the host's int8 dots are fast or the VNNI kernel reads (else
    float32 pairs), float inputs float32 weights; read-noise variances as uint8 levels (VNNI), in
    the host's narrow float, or float32."""
    codes = _code_reads(spec, spec.quantised)
    packed = codes and host.vnni_dots()
    weights = 2 if codes and (packed or host.LOW_PRECISION_DOTS) else 8 if codes else 4
    var = 0 if spec.noise.read_sigma <= 0 else 1 if packed else 2 if host.narrow_float() == "bfloat16" else 4
    return float(weights + var)


@dataclass(frozen=True)
class ProgrammedWeight:
    """The programmed state of one weight on its tiles (host arrays, padded to the grid).

    Held as sidra_core.cells describes: per cell the target code, an int8 residual of the
    conductance and a drift bit; write counts per tile; drift exponents and stuck maps drawn again from the chip's
    streams; cells rewritten since programming on their own (`rewrites`). The per-cell views
    (`g_plus`, `nu_plus`, `stuck_plus`, `t_prog_plus`, `writes_plus` and their `_minus` twins:
    conductances in siemens, drift exponents, stuck states, last write times and write counts)
    are computed when asked for.
    """

    grid: TileGrid
    spec: ChipSpec
    codes: np.ndarray  # int8 (Kp, Np): target codes (float mode: a broadcast zero)
    target_w: np.ndarray | None  # float32 (Kp, Np) weights in float mode, else None
    scale: np.ndarray  # float32 (N,): float value of one code per output column
    g: tuple  # per plane (plus, minus): cells.Residuals of the codes, float32 siemens in float mode
    seed: int  # the programming's seed, which keys its cells' drift exponents
    t_prog: np.float32  # device time of the programming
    drifts: tuple[np.ndarray, np.ndarray]  # per plane: cells.pack_bits of the cells given a drift exponent
    tile_writes: tuple[np.ndarray, np.ndarray]  # per plane: int32 (grid_k, grid_n), the most pulses of a cell
    rewrites: tuple[Rewrites, Rewrites]  # per plane: cells written again since programming
    adc_full_scale: np.ndarray  # float32 (grid_k, Np): per tile-column range in code units
    tile_ids: tuple[int, ...]  # physical tile of each grid tile, row-major over (grid_k, grid_n)
    programming: "ProgrammingReport"

    @property
    def host_bytes(self) -> int:
        """Host memory its arrays hold (a broadcast array by the values it stores)."""
        arrays = [self.codes, self.target_w, self.scale, *self.drifts, *self.tile_writes, self.adc_full_scale]
        sparse = [*self.rewrites, *(g for g in self.g if isinstance(g, Residuals))]
        return (sum(held_bytes(a) for a in arrays if a is not None) + sum(r.host_bytes for r in sparse)
                + sum(held_bytes(g) for g in self.g if not isinstance(g, Residuals)))

    @functools.cached_property
    def levels(self) -> Levels:
        return _levels(self.spec)

    def conductances(self, plane: int) -> np.ndarray:
        """float32 (Kp, Np): a plane's programmed conductances (S), undrifted (read-only in float mode)."""
        g = self.g[plane]
        return self.levels.decode(self.levels.expand(g, self.codes, plane)) if isinstance(g, Residuals) else g

    def exponents(self, plane: int, ids: np.ndarray | None = None) -> np.ndarray:
        """float32 (Kp, Np): a plane's drift exponents, drawn again from the programming's stream for
        the cells it gave one, a rewritten cell's own; zeros on a chip without drift."""
        shape = (self.grid.k_padded, self.grid.n_padded)
        if not self.spec.drifts:
            return np.zeros(shape, np.float32)
        ids = _cell_ids(self.grid, self.tile_ids) if ids is None else ids
        nu = _nu(ids, plane, self.seed, self.spec)
        nu = dlpack.aligned(nu)  # (a copy where it is not one that XLA shares, or read-only)
        np.multiply(nu, unpack_bits(self.drifts[plane], shape), out=nu)
        r = self.rewrites[plane]
        nu.ravel()[r.idx] = r.nu
        return nu

    def stuck(self, plane: int, ids: np.ndarray | None = None) -> np.ndarray:
        """int8 (Kp, Np): a plane's stuck cells (0 ok, -1 at G_min, +1 at G_max), from the chip's stream."""
        if self.target_w is not None:
            return np.zeros((self.grid.k_padded, self.grid.n_padded), np.int8)
        return _stuck(_cell_ids(self.grid, self.tile_ids) if ids is None else ids, plane, self.spec)

    def times(self, plane: int) -> np.ndarray:
        """float32 (Kp, Np): the device time each cell of a plane was last written (a read-only
        broadcast of the programming time where none was written again)."""
        shape = (self.grid.k_padded, self.grid.n_padded)
        r = self.rewrites[plane]
        if not len(r):
            return np.broadcast_to(self.t_prog, shape)
        t = np.full(shape, self.t_prog, np.float32)
        t.ravel()[r.idx] = r.t_prog
        return t

    def write_counts(self, plane: int, idx: np.ndarray | None = None) -> np.ndarray:
        """int32: the writes over its life of each cell of a plane ((Kp, Np)), or of flat cells `idx`:
        a rewritten cell's own count, any other its tile's bound from the programming."""
        r = self.rewrites[plane]
        tiles = self.tile_writes[plane]
        if idx is None:
            w = per_cell(tiles, self.grid)
            w.ravel()[r.idx] = r.writes
            return w
        w = tiles[tile_of(idx, self.grid)]
        at = np.searchsorted(r.idx, idx)
        found = at < len(r)
        found[found] = r.idx[at[found]] == idx[found]
        w[found] = r.writes[at[found]]
        return w

    g_plus = property(lambda self: self.conductances(0))
    g_minus = property(lambda self: self.conductances(1))
    nu_plus = property(lambda self: self.exponents(0))
    nu_minus = property(lambda self: self.exponents(1))
    stuck_plus = property(lambda self: self.stuck(0))
    stuck_minus = property(lambda self: self.stuck(1))
    t_prog_plus = property(lambda self: self.times(0))
    t_prog_minus = property(lambda self: self.times(1))
    writes_plus = property(lambda self: self.write_counts(0))
    writes_minus = property(lambda self: self.write_counts(1))

    @functools.cached_property
    def ref_norm(self) -> np.ndarray:
        """float32 (grid_k, grid_n): the reference read of each tile right after programming (of the
        stored, undrifted conductances), which drift compensation compares a later read with."""
        return np.asarray(_tile_norms(self.conductances(0), self.conductances(1), self.grid))

    @property
    def first_tile(self) -> int:
        return self.tile_ids[0]

    @functools.cached_property
    def t_latest(self) -> float:
        """The device time of the most recent write (the youngest cells drift fastest)."""
        return float(max([self.t_prog] + [r.t_prog.max() for r in self.rewrites if len(r)]))

    @functools.cached_property
    def written_at_once(self) -> bool:
        """Every cell was last written at the same device time (no incremental reprogramming since)."""
        return all(bool((r.t_prog == self.t_prog).all()) for r in self.rewrites)

    @property
    def shape(self) -> tuple[int, int]:
        return self.grid.k, self.grid.n


@dataclass(frozen=True)
class ProgrammingReport:
    """What one (re)programming did: cells written, pulses, and the endurance state.

    Attributes:
        cells_written: Cells written.
        pulses: Write-verify pulses given.
        max_pulses_cell: The most pulses one cell took.
        max_writes_cell: The most writes (pulses over its life) of one cell.
        endurance_exceeded: Cells past the endurance limit.
    """

    cells_written: int
    pulses: int
    max_pulses_cell: int
    max_writes_cell: int
    endurance_exceeded: int

    def __add__(self, other: "ProgrammingReport") -> "ProgrammingReport":
        return ProgrammingReport(
            self.cells_written + other.cells_written,
            self.pulses + other.pulses,
            max(self.max_pulses_cell, other.max_pulses_cell),
            max(self.max_writes_cell, other.max_writes_cell),
            self.endurance_exceeded + other.endurance_exceeded,
        )


def _conductance_pair(codes: np.ndarray, target_w, spec: ChipSpec):
    """Target (G+, G-) of every cell, in siemens (float mode: the weight itself)."""
    if target_w is not None:
        return np.maximum(target_w, 0).astype(np.float32), np.maximum(-target_w, 0).astype(np.float32)
    t = spec.tile
    dg, g_min = np.float32((t.g_max - t.g_min) / QMAX), np.float32(t.g_min)

    def plane(c):  # g_min + max(c, 0) dG in float32, in place (these arrays are the size of the weight)
        np.maximum(c, 0, out=c)
        c *= dg
        c += g_min
        return c

    return plane(codes.astype(np.float32)), plane(np.negative(codes, dtype=np.float32))


def _cell_ids(grid: TileGrid, tile_ids: tuple[int, ...]) -> np.ndarray:
    """Physical id of every cell of the padded grid: tile index x cells + row x cols + col."""
    rows, cols = grid.rows, grid.cols
    tile = np.asarray(tile_ids, np.uint32).reshape(grid.grid_k, 1, grid.grid_n, 1) * np.uint32(rows * cols)
    within = np.arange(rows, dtype=np.uint32)[:, None] * np.uint32(cols) + np.arange(cols, dtype=np.uint32)
    # (grid_k, rows, grid_n, cols) is the padded grid's row-major layout: one broadcast add
    return (tile + within[None, :, None, :]).reshape(grid.k_padded, grid.n_padded)


@partial(jax.jit, static_argnames=("rates",))
def _stuck_map(ids, seed, rates):
    off, on = rates
    u = rng.uniform(seed, ids)
    return jnp.where(u < off, jnp.int8(-1), jnp.where(u < off + on, jnp.int8(1), jnp.int8(0)))


def _stuck_seed(spec: ChipSpec, plane: int) -> np.uint32:
    return np.uint32(rng.seed32(spec.seed, 0x57AC, plane))


def _write_seed(seed: int, plane: int) -> int:
    """A plane's programming seed (ispp.seeds derives the write-verify draws' from it)."""
    return rng.seed32(seed, 0xCE11, plane)


def _nu_seed(seed: int, plane: int) -> np.uint32:
    return np.uint32(rng.seed32(rng.seed32(seed, 0xD21F7), 0xD21F7, plane))


def _stuck(ids: np.ndarray, plane: int, spec: ChipSpec) -> np.ndarray:
    """Stuck cells are a property of the physical chip: keyed by the chip seed and cell id only."""
    n = spec.noise
    if n.stuck_off_rate == 0 and n.stuck_on_rate == 0:
        return np.zeros(ids.shape, np.int8)
    seed = _stuck_seed(spec, plane)
    rates = (n.stuck_off_rate, n.stuck_on_rate)
    return map_blocks(lambda i: _stuck_map(i, seed, rates), [ids], [0])[0].astype(np.int8)


@partial(jax.jit, static_argnames=("mean", "std"))
def _draw_nu(ids, seed, mean, std):
    return jnp.maximum(mean + std * rng.normal(seed, ids), 0.0)


def _nu(ids, plane, seed, spec: ChipSpec) -> np.ndarray:
    n = spec.noise
    if not spec.drifts:
        return np.zeros(ids.shape, np.float32)
    seed = _nu_seed(seed, plane)
    if host.native_ispp():
        return vnni.drift_exponents(ids, seed, n.drift_nu_mean, n.drift_nu_std)
    return map_blocks(lambda i: _draw_nu(i, seed, n.drift_nu_mean, n.drift_nu_std), [ids], [0])[0]


def _adc_full_scale(codes: np.ndarray, target_w, grid: TileGrid, spec: ChipSpec) -> np.ndarray:
    """ADC range of each tile column: a fraction of the largest sum the column can produce.

    The fraction is set for a full tile. A partly used tile (the last one along
    K) has a largest sum that shrinks like the rows used but typical sums that
    shrink like their square root, so its fraction grows by sqrt(rows / used)
    to keep the same headroom over typical sums (capped at the largest sum).
    """
    if target_w is not None:
        largest = np.abs(target_w).reshape(grid.grid_k, grid.rows, grid.n_padded).sum(axis=1)
    else:  # |codes| <= 127: exact integer sums
        largest = np.abs(codes).reshape(grid.grid_k, grid.rows, grid.n_padded).sum(axis=1, dtype=np.int32)
        largest = largest.astype(np.float32)
    largest *= 2 ** (spec.dac.bits - 1) - 1 if spec.dac.enabled else 1.0
    used = np.minimum(grid.k - np.arange(grid.grid_k) * grid.rows, grid.rows)
    fraction = np.minimum(spec.adc.full_scale * np.sqrt(grid.rows / used), 1.0)[:, None]
    fs = fraction * largest
    return np.where(fs > 0, fs, 1.0).astype(np.float32)


@partial(jax.jit, static_argnames=("grid",))
def _tile_norms(gp, gm, grid: TileGrid):
    """A reference read of every tile: the response norm to random inputs, i.e. the Frobenius
    norm of the differential conductances (cells holding zero and padding add nothing)."""
    d = (gp - gm).reshape(grid.grid_k, grid.rows, grid.grid_n, grid.cols)
    return jnp.sqrt(jnp.sum(jnp.square(d), axis=(1, 3)))


def _pad(a: np.ndarray, grid: TileGrid, fill=0) -> np.ndarray:
    out = np.full((grid.k_padded, grid.n_padded), fill, dtype=a.dtype)
    out[: grid.k, : grid.n] = a
    return out


def program(
    w=None,
    spec: ChipSpec | None = None,
    *,
    seed: int = 0,
    t_now: float = 0.0,
    first_tile: int = 0,
    tile_ids=None,
    quantised: QuantisedWeight | None = None,
) -> ProgrammedWeight:
    """Program a K x N float weight (or existing INT8 codes) onto fresh tiles.

    Fresh cells start at G_min; ISPP writes every cell towards its target.
    The physical tiles (`tile_ids`, one per grid tile, or consecutive from
    `first_tile`) fix the stuck cells together with the chip seed.

    Args:
        w: The K x N float weight (quantised to INT8 unless the chip holds float weights).
        spec: The chip (required).
        seed: This programming's seed (write-verify, relaxation and drift draws).
        t_now: Device time of the write (s): the cells' programming time.
        first_tile: The first physical tile, when `tile_ids` is not given.
        tile_ids: The physical tile of each grid tile, row-major over (grid_k, grid_n).
        quantised: INT8 codes and scales to write instead of `w`.

    Returns:
        The ProgrammedWeight, its `programming` report included.

    Raises:
        ValueError: No spec, no weight, a weight that is not 2-D or holds NaN or Inf, or a wrong
            number of tile ids.
    """
    if spec is None:
        raise ValueError("program() needs a ChipSpec")
    if quantised is None:
        if w is None:
            raise ValueError("program() needs a weight or INT8 codes")
        w = np.asarray(w, np.float32)
        if w.ndim != 2:
            raise ValueError(f"a crossbar weight is 2-D (K x N), got shape {w.shape}")
        if spec.quantised:
            quantised = quantise_weight(w, spec)  # (which rejects NaN and Inf)
        elif not np.all(np.isfinite(w)):
            raise ValueError("weight contains NaN or Inf; it cannot be programmed into a crossbar")
    grid = tile_grid(*(quantised.codes.shape if quantised is not None else w.shape), spec)
    if quantised is not None:
        codes = _pad(quantised.codes, grid)
        target_w = None
        scale = quantised.scale
    else:
        codes = np.zeros((grid.k_padded, grid.n_padded), np.int8)
        target_w = _pad(w, grid)
        scale = np.ones(grid.n, np.float32)
    if tile_ids is None:
        tile_ids = range(first_tile, first_tile + grid.tiles)
    tile_ids = tuple(int(t) for t in tile_ids)
    if len(tile_ids) != grid.tiles:
        raise ValueError(f"a {grid.k}x{grid.n} weight needs {grid.tiles} tiles, got {len(tile_ids)} tile ids")
    if target_w is None and host.native_ispp():
        return _program_native(grid, codes, scale, tile_ids, spec, seed=seed, t_now=t_now)
    ids = _cell_ids(grid, tile_ids)
    if target_w is not None:
        codes = np.broadcast_to(np.int8(0), codes.shape)  # float mode holds no codes
        stuck = (np.zeros(codes.shape, np.int8),) * 2
    else:
        stuck = (_stuck(ids, 0, spec), _stuck(ids, 1, spec))
    # Fresh cells start at G_min; stuck cells sit at their rail from the start.
    t = spec.tile
    g_min = 0.0 if target_w is not None else t.g_min
    start = tuple(np.where(s > 0, np.float32(t.g_max), np.float32(g_min)).astype(np.float32) for s in stuck)
    targets = _pair_targets(codes, target_w, stuck, start, spec)

    def plane(i: int):
        pulses, g = _write_cells(start[i].ravel(), targets[i].ravel(), stuck[i].ravel(), ids.ravel(), target_w, spec,
                                 _write_seed(seed, i))
        return g.reshape(codes.shape), pulses.reshape(codes.shape)

    (gp, wp), (gm, wm) = _PLANES.map(plane, (0, 1))
    return _programmed(grid, spec, codes, target_w, scale, (gp, gm), stuck, (wp, wm), tile_ids, seed=seed, t_now=t_now)


def _program_native(grid: TileGrid, codes: np.ndarray, scale: np.ndarray, tile_ids: tuple[int, ...],
                    spec: ChipSpec, *, seed: int, t_now: float) -> ProgrammedWeight:
    """program()'s write of INT8 codes in one native pass over the cells (vnni.program): the same
    stuck map, targets, write-verify and residuals as its XLA path, to the bit (the drift
    exponents are drawn again from their stream when read)."""
    lv = _levels(spec)
    q, r, _, _, writes, bits = native_planes(grid, codes, tile_ids, spec, seed=seed, levels=lv)
    held = tuple(lv.held(qi, ri) for qi, ri in zip(q, r))
    del q  # (the 16-bit levels: only the exceptions' are kept)
    return _stored(grid, spec, codes, None, scale, held, tuple(bits), writes, tile_ids, seed=seed, t_now=t_now)


def native_planes(grid: TileGrid, codes: np.ndarray, tile_ids, spec: ChipSpec, *, seed: int, drifts: bool = False,
                  levels=None):
    """vnni.program's planes of a fresh write of padded INT8 codes: (G+, G-) (float32 siemens, or
    uint16 levels of `levels`, a cells.Levels), their residuals (None without `levels`), (nu+, nu-)
    (None unless `drifts`), (stuck+, stuck-), (pulses+, pulses-), and the drift bits."""
    t, n = spec.tile, spec.noise
    planes = (0, 1)
    draws = [ispp.seeds(_write_seed(seed, plane)) for plane in planes]  # as _write_cells draws
    seeds = ([_stuck_seed(spec, plane) for plane in planes] + [d[0] for d in draws] + [d[1] for d in draws]
             + [_nu_seed(seed, plane) for plane in planes])
    cells = (n.stuck_off_rate, n.stuck_off_rate + n.stuck_on_rate, (t.g_max - t.g_min) / QMAX, t.g_min, t.g_max,
             n.drift_nu_mean, n.drift_nu_std)
    return vnni.program(codes, tile_ids, rows=grid.rows, cols=grid.cols, grid_n=grid.grid_n, seeds=seeds, cells=cells,
                        pulses=ispp.pulse_params(spec), ispp=spec.ispp.enabled, drifts=drifts and spec.drifts,
                        levels=levels)


def _levels(spec: ChipSpec) -> Levels:
    """The chip's conductance levels, residual steps sized to its write-verify window."""
    t = spec.tile
    return Levels.of(t.g_min, (t.g_max - t.g_min) / QMAX, spec.ispp.tolerance * t.g_max if spec.ispp.enabled else 0.0)


def _programmed(grid, spec, codes, target_w, scale, g, stuck, writes, tile_ids, *, seed, t_now) -> ProgrammedWeight:
    """The ProgrammedWeight of a fresh write, as sidra_core.cells holds it, from its full planes:
    conductances (S), stuck states and pulses per cell."""
    # a written cell restarts drift with a fresh exponent; a stuck cell does not drift
    bits = tuple(pack_bits((w > 0) & (s == 0)) for w, s in zip(writes, stuck))
    lv = _levels(spec)
    held = g if target_w is not None else tuple(lv.compress(lv.encode(gi), codes, i) for i, gi in enumerate(g))
    return _stored(grid, spec, codes, target_w, scale, held, bits, writes, tile_ids, seed=seed, t_now=t_now)


def _stored(grid, spec, codes, target_w, scale, g, bits, writes, tile_ids, *, seed, t_now) -> ProgrammedWeight:
    """A fresh write's ProgrammedWeight from its held conductances, drift bits and pulses per cell
    (kept per tile)."""
    tile_writes = tuple(tile_max(w, grid).astype(np.int32) for w in writes)
    reports = [_report(w, t, spec, cells_each=grid.rows * grid.cols) for w, t in zip(writes, tile_writes)]
    return ProgrammedWeight(
        grid=grid, spec=spec, codes=codes, target_w=target_w, scale=scale, g=g, seed=int(seed),
        t_prog=np.float32(t_now), drifts=bits, tile_writes=tile_writes, rewrites=(Rewrites.none(), Rewrites.none()),
        adc_full_scale=_adc_full_scale(codes, target_w, grid, spec), tile_ids=tile_ids,
        programming=reports[0] + reports[1],
    )


def _report(pulses: np.ndarray, writes: np.ndarray, spec: ChipSpec, cells_each: int = 1) -> "ProgrammingReport":
    """One plane's ProgrammingReport: the pulses this write gave, and the writes its cells are
    tracked at (ProgrammedWeight.write_counts: a tile's bound, a rewritten cell's own count), per
    cell or per tile (`cells_each`: the cells each value of `writes` stands for)."""
    return ProgrammingReport(
        cells_written=int(np.count_nonzero(pulses)), pulses=int(pulses.sum(dtype=np.int64)),
        max_pulses_cell=int(pulses.max(initial=0)), max_writes_cell=int(writes.max(initial=0)),
        endurance_exceeded=int((writes > spec.ispp.endurance).sum()) * cells_each)


def _write_cells(g0, target, stuck, ids, target_w, spec: ChipSpec, seed: int):
    """Write-verify cells (flat) from `g0` towards `target`: (pulses, final G). Float (ideal) mode
    writes the weight exactly, one pulse per changed cell."""
    if target_w is None:
        res = ispp.program_cells(g0, target, stuck != 0, ids, spec, seed)
        return res.pulses, res.g
    return (g0 != target).astype(np.int32), target


def reprogram(
    state: ProgrammedWeight, w=None, spec: ChipSpec | None = None, *, seed: int = 0, t_now: float = 0.0,
    quantised: QuantisedWeight | None = None,
) -> ProgrammedWeight:
    """Incrementally reprogram: only cells whose target changed are written, from their present G.

    The present conductance includes drift up to `t_now`. Each column keeps
    its weight scale (a fine-tuning step moves codes, not the calibration)
    unless the new weight would saturate it, then the scale grows; given
    INT8 codes and scales are used as they are.

    Args:
        state: The weight as programmed now.
        w: The new K x N float weight, of the programmed shape.
        spec: The chip (required).
        seed: This programming's seed.
        t_now: Device time of the write (s).
        quantised: INT8 codes and scales to write instead of `w`.

    Returns:
        The new ProgrammedWeight, whose `programming` report is this write's.

    Raises:
        ValueError: No spec, or a weight of another shape or holding NaN or Inf.
    """
    if spec is None:
        raise ValueError("reprogram() needs a ChipSpec")
    grid = state.grid
    if quantised is None:
        w = np.asarray(w, np.float32)
        if w.shape != grid_shape(state):
            raise ValueError(f"reprogram() needs a weight of shape {grid_shape(state)}, got {w.shape}")
        if not np.all(np.isfinite(w)):
            raise ValueError("weight contains NaN or Inf; it cannot be programmed into a crossbar")
    if state.target_w is not None:
        target_w, codes, scale = _pad(w, grid), state.codes, state.scale
    else:
        if quantised is None:
            # Keep each column's scale (so a small update rewrites few cells); a weight that
            # outgrows the programmed range by up to 5 % saturates at code 127, past that the
            # column's scale grows, with 10 % headroom, and the column is rewritten whole.
            needed = quantise_weight(w, spec).scale
            saturating = needed > state.scale * 1.05
            scale = np.where(saturating, needed * 1.1, state.scale).astype(np.float32)
            codes_new = np.clip(np.rint(w / scale[None, :]), -QMAX, QMAX).astype(np.int8)
            quantised = from_int8(codes_new, scale)
        target_w, codes, scale = None, _pad(quantised.codes, grid), quantised.scale
    state = dataclasses.replace(state, scale=scale)
    ids = _cell_ids(grid, state.tile_ids)
    stuck = (state.stuck(0, ids), state.stuck(1, ids))
    stored = (state.conductances(0), state.conductances(1))
    old = _pair_targets(state.codes, state.target_w, stuck, stored, spec)
    new = _pair_targets(codes, target_w, stuck, stored, spec)
    # Changed cells are written from their present (drifted) conductance.
    present = drifted(state, t_now, spec)

    def plane(i: int):
        sel = np.flatnonzero(old[i] != new[i])
        pulses, g_new = _write_cells(present[i].ravel()[sel], new[i].ravel()[sel], stuck[i].ravel()[sel],
                                     ids.ravel()[sel], target_w, spec, _write_seed(seed, i))
        hit = pulses > 0
        at = sel[hit]
        # Written cells hold their new G and restart drift with a fresh exponent (a stuck cell does
        # not drift); the others keep their programmed G, exponent and programming time.
        g = stored[i].copy()
        g.ravel()[at] = g_new[hit]
        nu = _nu(ids.ravel()[at], i, seed, spec) * (stuck[i].ravel()[at] == 0)
        writes = state.write_counts(i, at) + pulses[hit]
        rewrites = state.rewrites[i].merged(at, t_now, writes, nu)
        return g, rewrites, pulses

    (gp, rp, pp), (gm, rm, pm) = _PLANES.map(plane, (0, 1))
    levels = None if state.target_w is not None else state.levels
    state = dataclasses.replace(
        state, codes=codes, target_w=target_w,
        g=tuple(gi if levels is None else levels.compress(levels.encode(gi), codes, i) for i, gi in enumerate((gp, gm))),
        rewrites=(rp, rm), adc_full_scale=_adc_full_scale(codes, target_w, grid, spec))
    reports = [_report(p, state.write_counts(i), spec) for i, p in enumerate((pp, pm))]
    return dataclasses.replace(state, programming=reports[0] + reports[1])


def grid_shape(state: ProgrammedWeight) -> tuple[int, int]:
    return state.grid.k, state.grid.n


def _pair_targets(codes, target_w, stuck, g, spec: ChipSpec):
    """Cell targets with stuck cells worked around by their partner.

    Write-verify finds a stuck cell (it never passes verify); the controller
    then writes the partner so the pair still holds the difference G+ - G-
    where that is within the window (a stuck-at-G_max cell is fully
    compensated, a stuck-at-G_min one only when the partner was the active
    cell). `stuck` and `g`: both planes' stuck states and stored conductances.
    """
    tp, tm = _conductance_pair(codes, target_w, spec)
    stuck_p, stuck_m = stuck
    if target_w is not None or not (stuck_p.any() or stuck_m.any()):
        return tp, tm
    # Stuck cells are few: the partners' targets are changed at their indices only.
    t = spec.tile
    at = np.flatnonzero(stuck_p.ravel() | stuck_m.ravel())
    sp, sm = stuck_p.ravel()[at] != 0, stuck_m.ravel()[at] != 0
    p, m = tp.ravel(), tm.ravel()  # views: written in place
    diff = p[at] - m[at]
    plus_only, minus_only = sp & ~sm, sm & ~sp
    m[at[plus_only]] = np.clip(g[0].ravel()[at[plus_only]] - diff[plus_only], t.g_min, t.g_max)
    p[at[minus_only]] = np.clip(g[1].ravel()[at[minus_only]] + diff[minus_only], t.g_min, t.g_max)
    return tp, tm


# The two planes of a weight are written at once: most of a plane's host work (NumPy compaction
# and scatter) releases the GIL, so the planes overlap on two cores.
_PLANES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sidra-plane")


# ---------------------------------------------------------------------------
# Reading the array: drift, IR drop, compensation -> a snapshot the MVM uses.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Snapshot:
    """The array as a read sees it at one device time, in code units, laid out per tile.

    `w` holds each tile's (G+ - G-)/dG including drift and IR drop, (rows, N)
    per tile, in float32, or, when the DAC makes every input an INT8 code, as
    integers (int8, or float32 where int8 dots are slow): exactly (INT8 codes
    without drift) or as a (whole, fraction) pair side by side, (rows, 2N) (see
    `_device_tiles`); one array per tile, as
    XLA:CPU copies a slice of a stacked array before each matmul, or for a
    narrow weight one block-diagonal array of all tiles (see
    _NARROW), or all tiles packed in one array for the VNNI kernel (`shape.packed`,
    with `corr` its column corrections; see sidra_core.vnni); `var` the per-cell
    read-noise variance in the same units (for INT8 codes, integer levels of the
    step `var_scale`: see `variances`), `lsb` the ADC step of each tile column,
    `gain` the drift-compensation gain per tile column, `scale` the weight scale
    per output column.
    """

    w: tuple[jax.Array, ...]
    var: tuple[jax.Array, ...] | None
    lsb: jax.Array | None
    gain: jax.Array | None
    scale: jax.Array
    shape: _Shape
    corr: jax.Array | None = None
    var_scale: jax.Array | None = None  # the step of `var`'s integer levels per tile column, if any

    @property
    def host_bytes(self) -> int:
        """Host memory its arrays hold."""
        arrays = [*self.w, *(self.var or ()), self.lsb, self.gain, self.scale, self.corr, self.var_scale]
        return sum(held_bytes(a) for a in arrays if a is not None)

    @functools.cached_property
    def kernel_weights(self) -> tuple:
        """A packed snapshot's operands as the native read takes them (vnni.mvm_weights), taken once:
        each read passes their addresses (the snapshot keeps the arrays)."""
        noise = self.var is not None
        return vnni.mvm_weights(self.w[0], self.corr, self.var[0] if noise else None,
                                self.var_scale if noise else None, self.lsb, self.gain, self.scale)

    def variances(self) -> jax.Array:
        """The read-noise variances in code units as float32, (grid_k, rows, N)."""
        if self.shape.packed:
            raise ValueError("a packed snapshot holds its variances in the VNNI kernel's layout")
        var = self.tiles([v.astype(jnp.float32) for v in self.var])
        if self.var_scale is None:
            return var
        step = self.var_scale.reshape(-1, self.shape.n) if self.shape.narrow else self.var_scale
        return var * step[:, None, :]

    def weights(self) -> jax.Array:
        """The array's weights in code units as float32, (grid_k, rows, N)."""
        blocks = list(vnni.unpack(self.w[0], self.shape.n)) if self.shape.packed else self.w
        return self.tiles([_join(b) if self.shape.terms == 2 else b.astype(jnp.float32) for b in blocks])

    def tiles(self, blocks) -> jax.Array:
        """Per-tile arrays (grid_k, rows, N) from per-tile or block-diagonal (rows, N) blocks."""
        if not self.shape.narrow:
            return jnp.stack(blocks)
        bd, gk, n = blocks[0], self.shape.grid_k, self.shape.n
        r = bd.shape[0] // gk
        return jnp.stack([bd[i * r:(i + 1) * r, i * n:(i + 1) * n] for i in range(gk)])

    def lhs(self, x):
        """The DAC codes (integer-valued float32) as the partial-sum matmuls take them."""
        return x.astype(jnp.int8) if self.w[0].dtype == jnp.int8 else x

    def partial_sums(self, x, tile: int, used: int):
        """Analog partial sums x @ w in float32 of one tile, x: `lhs` codes (rows, used) for its
        first `used` word lines."""
        w = self.w[tile][:used]
        if w.dtype != jnp.int8:  # float32 weights: integers (exact sums) if shape.terms, else any
            q = jnp.matmul(x, w)
            return _join(q) if self.shape.terms == 2 else q
        # INT8 x INT8 products summed in int32 are exact (256 rows x 127 x 127 < 2^31), and
        # with AMX XLA:CPU's int8 dot is the fastest it has. A (whole, fraction) pair is one dot
        # over both halves side by side.
        q = jnp.matmul(x, w, preferred_element_type=jnp.int32)
        return _join(q) if self.shape.terms == 2 else q.astype(jnp.float32)


def drifted(state: ProgrammedWeight, t_now: float, spec: ChipSpec):
    """Conductances at device time `t_now`: G(t) = G_prog ((t - t_prog + t0)/t0)^-nu.

    Args:
        state: The programmed weight.
        t_now: Device time (s).
        spec: The chip, for its drift parameters.

    Returns:
        (G+, G-): the two planes' conductances (S), (Kp, Np) each; the stored ones without drift.
    """
    if not spec.drifts:
        return state.conductances(0), state.conductances(1)
    return _drift(state, _log_ages(state, t_now, spec))


def _drift(state: ProgrammedWeight, ages):
    """Each plane's cells drifted by their log ages (_log_ages), block by block."""
    age_p, age_m = ages
    ids = _cell_ids(state.grid, state.tile_ids)
    arrays = [state.conductances(0), state.conductances(1), state.exponents(0, ids), state.exponents(1, ids)]
    if np.ndim(age_p) == 0:  # written at once: one age
        return tuple(map_blocks(lambda *a: _drift_kernel(*a, age_p, age_m), arrays, [0] * 4))
    return tuple(map_blocks(_drift_kernel, [*arrays, age_p, age_m], [0] * 6))


def _log_ages(state: ProgrammedWeight, t_now: float, spec: ChipSpec):
    """ln(1 + (t - t_prog) / t0) of each plane's cells, the drift exponent's factor: one value for a
    weight written at once. The age is taken between float32 times, as the cells keep theirs (so a
    read an hour after programming drifts alike at any device time), its logarithm on the host in
    float64, rounded to float32: every backend drifts a cell by the same factor."""
    t0, now = spec.noise.drift_t0, np.float32(t_now)
    if state.written_at_once:
        age = np.float32(math.log1p(max(float(now - np.float32(state.t_latest)), 0.0) / t0))
        return age, age
    return tuple(np.log1p(np.maximum(now - t, 0).astype(np.float64) / t0).astype(np.float32)
                 for t in (state.t_prog_plus, state.t_prog_minus))


# e^x as a short polynomial that the native snapshot repeats operation for operation (XLA's own exp
# would have to be matched bit for bit): x = n ln2 + r with ln2 in two parts (Cephes), |r| <= ln2/2,
# e^r by its degree-7 Taylor polynomial (truncation < 3e-9 relative), times 2^n.
_EXP_TAYLOR = tuple(1.0 / math.factorial(i) for i in range(7, -1, -1))  # highest order first
_LOG2E, _LN2_HI, _LN2_LO = 1.4426950408889634, 0.693359375, -2.12194440e-4


def _exp(x):
    n = jnp.clip(jnp.floor(x * jnp.float32(_LOG2E) + 0.5), -126.0, 127.0)
    r = x + n * jnp.float32(-_LN2_HI)
    r = r + n * jnp.float32(-_LN2_LO)
    p = jnp.float32(_EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        p = c + p * r
    return p * lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)


@jax.jit
def _drift_kernel(gp, gm, nu_p, nu_m, age_p, age_m):
    """Each plane's G drifted by (1 + (t - t_prog) / t0)^-nu, given the log ages (_log_ages)."""
    return gp * _exp(-nu_p * age_p), gm * _exp(-nu_m * age_m)


def _ir_factor(a: float, g_max: float, gp, gm, grid: TileGrid):
    """First-order IR drop: attenuation grows with distance from the drivers and with column load."""
    r = (jnp.arange(grid.rows, dtype=jnp.float32)[:, None] + 1) / grid.rows
    c = (jnp.arange(grid.cols, dtype=jnp.float32)[None, :] + 1) / grid.cols
    pos = jnp.tile((r + c) / 2, (grid.grid_k, grid.grid_n))
    g = (gp + gm).reshape(grid.grid_k, grid.rows, grid.n_padded)
    load = g.sum(axis=1, keepdims=True) / (grid.rows * 2 * g_max)  # column current, 0..1
    return 1.0 - a * pos * jnp.broadcast_to(load, g.shape).reshape(gp.shape)


def _code_reads(spec: ChipSpec, int8_weights: bool) -> bool:
    """Whether reads take INT8 DAC codes against integer weights in code units (INT8 weights and a
    DAC of at most 8 bits): the snapshot's integer forms."""
    return spec.dac.enabled and spec.dac.bits <= _INT8_BITS and int8_weights


def snapshot(state: ProgrammedWeight, t_now: float, spec: ChipSpec) -> Snapshot:
    """Evaluate drift, IR drop and compensation once; MVMs at this time reuse it.

    Args:
        state: The programmed weight.
        t_now: Device time of the read (s).
        spec: The chip.

    Returns:
        The Snapshot that `mvm` reads.
    """
    grid = state.grid
    n = spec.noise
    drift = spec.drifts
    # INT8 DAC codes against weights in code units (|w| <= 127: G+ and G- stay in the window):
    # (whole, fraction) integer pairs, whose partial sums are exact integers in any summation order,
    # so a row's result does not depend on the rows read with it (padding, batching); held as int8
    # where the host's int8 dot is its fastest (host.LOW_PRECISION_DOTS), else as float32 integers
    codes = _code_reads(spec, state.target_w is None)
    packed = codes and host.vnni_dots()
    read = _Read(
        grid=grid, ir_drop=float(n.ir_drop), g_max=float(spec.tile.g_max),
        dg=1.0 if state.target_w is not None else (spec.tile.g_max - spec.tile.g_min) / QMAX,
        read_sigma=float(n.read_sigma), compensate=bool(n.drift_compensation), split=codes,
        int_dots=host.LOW_PRECISION_DOTS or packed, var_dtype=host.narrow_float(),
        # (float inputs stay per tile: the ideal chip's results keep their float32 rounding)
        narrow=codes and 1 < grid.grid_k and grid.grid_k * grid.n <= _NARROW,
    )
    # packed for the VNNI kernel in the same program, as (whole, fraction) pairs first: an array
    # that turns out to hold whole codes only (an exact chip) is read again as one term
    read = dataclasses.replace(read, packed=2 if packed and not read.narrow else 0)
    ages = _log_ages(state, t_now, spec) if drift else None
    if (read.packed and not read.ir_drop and not read.compensate and (ages is None or np.ndim(ages[0]) == 0)
            and host.native_snapshot()):
        w, corr, var, var_scale, gain, terms = _read_native(state, ages, read)
    else:  # the drifted cells first, in a program of their own (as drifted() gives them), then the read
        cells = (state.conductances(0), state.conductances(1)) if ages is None else _drift(state, ages)
        args = (*(buckets.put(g) for g in cells), state.ref_norm if read.compensate else None)
        w, corr, var, var_scale, gain, has_fraction = _read_array(*args, read)
        terms = 0 if not codes else 2 if bool(has_fraction) else 1
        if read.packed and terms == 1:
            read = dataclasses.replace(read, packed=1)
            w, corr, var, var_scale, gain, _ = _read_array(*args, read)
        elif not read.packed:
            w = w[1] if terms == 2 else w[0]  # (whole, pair)
    lsb = None
    if spec.adc.enabled:
        lsb = (state.adc_full_scale[:, :grid.n] / np.float32(2 ** (spec.adc.bits - 1) - 1)).astype(np.float32)
    return Snapshot(
        # (host arrays by DLPack: jnp.asarray would compile a program per shape)
        w=w, var=var, lsb=None if lsb is None else buckets.put(lsb), gain=gain,
        scale=buckets.put(np.array(state.scale, np.float32)),
        shape=_Shape(grid.k, grid.n, grid.rows, grid.cols, terms, read.narrow, bool(read.packed)), corr=corr,
        var_scale=var_scale,
    )


def _read_native(state: ProgrammedWeight, ages, read: "_Read"):
    """_read_array's packed read in the native library (vnni.snapshot), drifted by the log ages
    (None: no drift): the same codes, levels and steps, no program per weight shape. It reads the
    conductances as stored (residuals of the codes) and draws the drift exponents itself, unless
    cells were rewritten (then they are passed in, each rewritten cell's own)."""
    grid, spec = read.grid, state.spec
    nu, drawn = (None, None), {}
    if ages is not None and any(len(r) for r in state.rewrites):
        ids = _cell_ids(grid, state.tile_ids)
        nu = (state.exponents(0, ids), state.exponents(1, ids))
    elif ages is not None:
        drawn = dict(bits=state.drifts, tile_ids=state.tile_ids, nu_seeds=[_nu_seed(state.seed, p) for p in (0, 1)],
                     nu_draw=(spec.noise.drift_nu_mean, spec.noise.drift_nu_std))
    var_c = float(np.float32((read.read_sigma / read.dg) ** 2)) if read.read_sigma > 0 else None
    lv = state.levels
    wp, corr, sp, step, terms = vnni.snapshot(
        *state.g, *nu, *(ages or (0.0, 0.0)), grid_k=grid.grid_k, grid_n=grid.grid_n, cols=grid.cols, k=grid.k,
        n=grid.n, dg=read.dg, var_c=var_c, levels=lv, codes=state.codes, **drawn)
    return ((buckets.put(wp),), buckets.put(corr), None if sp is None else (buckets.put(sp),),
            None if step is None else buckets.put(step), None, terms)


@dataclass(frozen=True)
class _Read:
    """What a read of one weight's array involves (static: one compiled read per weight kind)."""

    grid: TileGrid
    ir_drop: float
    g_max: float
    dg: float
    read_sigma: float
    compensate: bool
    split: bool
    int_dots: bool
    var_dtype: str
    narrow: bool
    packed: int = 0  # terms of the VNNI kernel's packed tiles (sidra_core.vnni.pack), 0: not packed


@partial(jax.jit, static_argnames=("read",))
def _read_array(gp, gm, ref_norm, read: _Read):
    """The snapshot's device arrays from the drifted conductances, in one program: IR drop, weights
    and read-noise variances in code units, the drift-compensation gain."""
    grid = read.grid
    if read.ir_drop > 0:
        f = _ir_factor(read.ir_drop, read.g_max, gp, gm, grid)
        gp, gm = gp * f, gm * f
    # Padding columns hold nothing that is read out: the snapshot keeps the N real columns
    # (the K padding stays, it is how inputs split into 256-row tiles).
    n = grid.n
    shape3 = (grid.grid_k, grid.rows, n)
    w = ((gp[:, :n] - gm[:, :n]) / jnp.float32(read.dg)).reshape(shape3)
    var = None
    if read.read_sigma > 0:
        var = (jnp.float32((read.read_sigma / read.dg) ** 2) * (gp[:, :n] ** 2 + gm[:, :n] ** 2)).reshape(shape3)
    gain = None
    if read.compensate:
        # Reference read of each tile now, against the same read just after programming.
        now_norm = _tile_norms(gp, gm, grid)
        per_tile = jnp.where(now_norm > 0, ref_norm / now_norm, 1.0)
        gain = jnp.repeat(per_tile, grid.cols, axis=1)[:, :n]
    var_scale = None
    if var is not None and read.split:  # integer levels: see _variance
        var, var_scale = _variance_levels(var)
    if read.narrow:
        w = _block_diagonal(w)[None]
        var = None if var is None else _block_diagonal(var)[None]
        var_scale = None if var_scale is None else var_scale.reshape(1, -1)
    whole, pair, var, has_fraction = _device_tiles(w, None if var is None else var.astype(read.var_dtype), read.split,
                                                   read.int_dots)
    if read.packed:
        wp, corr, sp = vnni.pack(pair if read.packed == 2 else whole, var, k=grid.k, terms=read.packed)
        return (wp,), corr, None if var is None else (sp,), var_scale, gain, has_fraction
    return (whole, pair), None, var, var_scale, gain, has_fraction


# DAC codes of up to 8 signed bits (|code| <= 127) are int8 values.
_INT8_BITS = 8

# The fraction of a (whole, fraction) pair in int8 steps of 1/254: |w - whole| <= 1/2 -> +-127.
_FRACTION_STEPS = 254.0


def _join(q):
    """(whole | fraction) side by side (int8 weights or their int32 partial sums) -> float32."""
    h = q.shape[-1] // 2
    return q[..., :h].astype(jnp.float32) + q[..., h:].astype(jnp.float32) * jnp.float32(1 / _FRACTION_STEPS)


# A weight with several tiles along K but few columns (a classifier head: 1024 x 10 is 4 tiles of
# 10 columns) pays XLA:CPU's fixed cost per matmul on every tile for a few kFLOP each.
# Held as one block-diagonal array (tile i's rows meet column block i), one matmul gives every
# tile's partial sums at once; the zero blocks add exact zeros. Used while grid_k x N <= _NARROW.
_NARROW = 512


def _block_diagonal(a):
    """(grid_k, rows, N) tiles -> (grid_k rows, grid_k N) with the tiles on the diagonal."""
    gk, r, n = a.shape
    out = jnp.zeros((gk * r, gk * n), a.dtype)
    for i in range(gk):  # grid_k x N <= _NARROW: a few tiles
        out = out.at[i * r:(i + 1) * r, i * n:(i + 1) * n].set(a[i])
    return out


@partial(jax.jit, static_argnames=("split", "int_dots"))
def _device_tiles(w, var, split: bool, int_dots: bool):
    """One device array per tile of the weights (grid_k, rows, N) and variances.

    With `split` (every input is an INT8 DAC code, w is in code units) the weights are integers
    of int8 range: the whole codes (`whole`) if they hold w exactly (INT8 codes without drift or
    IR drop; `has_fraction` false), else the whole codes and the rest in steps of 1/254 side by
    side, (rows, 2N), which hold w to 1/508 of a code (programming lands within +-1.3 codes on
    y1); as int8 for the host's int8 dots (`int_dots`), else as float32 (exact sums either way).
    """
    var = None if var is None else tuple(var)
    if not split:
        return tuple(w), None, var, False
    whole = jnp.clip(jnp.round(w), -QMAX, QMAX)
    fraction = jnp.round((w - whole) * _FRACTION_STEPS)
    dt = jnp.int8 if int_dots else jnp.float32
    pair = jnp.concatenate([whole, fraction], axis=-1).astype(dt)
    return tuple(whole.astype(dt)), tuple(pair), var, jnp.any(fraction != 0)


# Read-noise variances of an INT8-code read as integer levels 0.._VAR_LEVELS of a per tile column
# step: with x^2 split in two 7-bit halves, every product and sum of the variance dot is an integer
# below 2^24, exact in float32 (and the operands in bfloat16) in any order, and in the VNNI
# kernel's int32 sums (uint8 levels against int8 halves): every backend has the same variances.
# Rounding is dithered (a fixed uniform offset per cell): many cells share one variance (both at
# G_min), and rounding them all the same way would bias a column's sum; dithered, a column's
# error is random, ~0.3 %.
_VAR_LEVELS = 255.0
_DITHER_SEED = 0x5EED


def _variance_levels(var):
    """(levels, step): var ~= levels * step, levels integers in [0, 255], step per tile column."""
    step = jnp.max(var, axis=-2, keepdims=True) / _VAR_LEVELS
    step = jnp.where(step > 0, step, 1.0)
    u = rng.uniform(jnp.uint32(_DITHER_SEED), lax.iota(jnp.uint32, var.size).reshape(var.shape))
    return jnp.minimum(jnp.floor(var / step + u), _VAR_LEVELS), step[..., 0, :]


# ---------------------------------------------------------------------------
# The MVM kernel.


def _adc(p, lsb, gain, qmax: float):
    """Each tile column's ADC (step `lsb`, +-qmax codes) and drift-compensation gain, if any."""
    if lsb is not None:
        p = jnp.clip(jnp.round(p / lsb), -qmax, qmax) * lsb
    if gain is not None:
        p = p * gain
    return p


def _variance(x, var, step=None):
    """Read-noise variance of each partial sum, sum_i x_i^2 sigma_i^2. With `step` (INT8 codes x,
    var in levels: _variance_levels) the sums are exact integers: x^2 < 2^14 goes in as two 7-bit
    halves (2x the rows), both exact in bfloat16, whose dots are fast where host.narrow_float
    picks them. Else float operands: it only sets the noise amplitude."""
    x2 = x * x
    if step is None:
        return jnp.matmul(x2.astype(var.dtype), var, preferred_element_type=jnp.float32)
    hi = jnp.floor(x2 * (1 / 128))
    halves = jnp.concatenate([hi, x2 - 128 * hi]).astype(var.dtype)
    s = jnp.matmul(halves, var, preferred_element_type=jnp.float32)
    r = x.shape[0]
    return (s[:r] * 128 + s[r:]) * step


def _normals_stride(n: int, grid_k: int) -> tuple[int, int]:
    """(per-pair width, per-row stride) of the read-noise counters of an N-column weight of grid_k
    tiles: each row owns a block of counters, so a row's draws do not depend on how many rows
    are read with it (padding to a bucket, or a batch, never shifts them)."""
    width = max(n, -(-n // 32) * 16)
    return width, -(-grid_k // 2) * width


def _read_normals(seed, rows: int, n: int, tile: int, alone: bool, grid_k: int):
    """The read noise's normals for tile pair (tile, tile + 1), each (rows, n): one Box-Muller pair
    per (tile pair, row, column), counter row * stride + pair * width + column (each read draws
    fresh normals; see _normals_stride); the pair's two tiles share its log and sqrt. An unpaired
    last tile (`alone`) uses both normals itself: one pair per (row, 32-column block, lane),
    counter row * stride + pair * width + block * 16 + lane, z0 for the block's first 16 columns,
    z1 the next."""
    width, stride = _normals_stride(n, grid_k)
    row = lax.iota(jnp.uint32, rows)[:, None] * jnp.uint32(stride) + jnp.uint32(tile // 2 * width)
    if not alone:
        return rng.box_muller(seed, row + lax.iota(jnp.uint32, n)[None, :])
    blocks = -(-n // 32)
    z0, z1 = rng.box_muller(seed, row[:, :, None] + lax.iota(jnp.uint32, blocks * 16).reshape(1, blocks, 16))
    return jnp.stack([z0, z1], axis=2).reshape(rows, blocks * 32)[:, :n], None


def _step(snap: Snapshot, tile: int):
    return None if snap.var_scale is None else snap.var_scale[tile]


def _read_tiles(snap: Snapshot, x2, seed, qmax: float):
    """The tiles' sum of one read of DAC codes x2 (rows, K) in XLA: partial sums, read noise, ADC."""
    s = snap.shape
    grid_k, n_pad = s.grid_k, s.n
    rows = x2.shape[0]
    if s.narrow:  # every tile's partial sums and noise variances from one block-diagonal matmul each
        xp = jnp.pad(x2, ((0, 0), (0, grid_k * s.rows - s.k)))
        p_all = snap.partial_sums(snap.lhs(xp), 0, grid_k * s.rows)
        v_all = None if snap.var is None else _variance(xp, snap.var[0], _step(snap, 0))
    # One tile after another (unrolled: XLA:CPU's batched matmul is slower than separate ones),
    # so each tile's partial sums, noise, ADC and accumulation form one chain with a single
    # consumer, which XLA fuses into one pass instead of materialising every tile's noisy sums.
    # The last tile's unused word lines (K not a multiple of the tile) carry zero inputs: skipped.
    y = None
    xl = snap.lhs(x2)
    z = None
    for i in range(grid_k):
        used = min(s.rows, s.k - i * s.rows)
        xi = x2[:, i * s.rows:i * s.rows + used]
        cols = slice(i * n_pad, (i + 1) * n_pad)
        # the tile's analog partial sums
        if s.narrow:
            p = p_all[:, cols]
        else:
            p = snap.partial_sums(xl[:, i * s.rows:i * s.rows + used], i, used)
        if snap.var is not None:
            var = v_all[:, cols] if s.narrow else _variance(xi, snap.var[i][:used], _step(snap, i))
            if i % 2 == 0:
                z = _read_normals(seed, rows, n_pad, i, alone=i + 1 == grid_k, grid_k=grid_k)
            p = p + jnp.sqrt(var) * z[i % 2]
        p = _adc(p, None if snap.lsb is None else snap.lsb[i], None if snap.gain is None else snap.gain[i], qmax)
        y = p if y is None else y + p  # digital accumulation of the tiles
    return y


def check_read(snap: Snapshot, features: int, seed, dac_bits: int | None) -> None:
    """Refuse a read the snapshot cannot take: inputs of another K, no seed for a noisy chip, DAC
    codes wider than its int8 weights."""
    s = snap.shape
    if features != s.k:
        raise ValueError(f"mvm input has {features} features but the weight has K = {s.k}")
    if snap.var is not None and seed is None:
        raise ValueError("this chip has read noise: mvm() needs a noise seed")
    if s.terms and (dac_bits is None or dac_bits > _INT8_BITS):
        raise ValueError(f"this snapshot holds int8 weights for DAC codes of <= {_INT8_BITS} bits, "
                         f"got dac_bits={dac_bits}: run it with the settings of the chip that made it "
                         f"(mvm_kwargs(spec))")


@host.jit(static_argnames=("dac_bits", "adc_bits"))
def mvm(snap: Snapshot, x, seed=None, bias=None, *, dac_bits: int | None = 8, adc_bits: int = 8):
    """y = x @ W (+ bias) as the crossbar computes it, for x of shape (..., K).

    The input is quantised per row (DAC), each tile accumulates its 256-row
    partial sums in the analog domain with read noise, each tile column is
    digitised by its ADC (range, rounding, clipping), the tiles are summed
    digitally, and the result is dequantised. Read noise is exact in
    distribution: independent per-cell noise adds to a column sum a Gaussian
    of variance sum_i x_i^2 sigma_i^2, one extra matmul. `seed` (uint32)
    picks this read's noise.

    Args:
        snap: The weight's snapshot at the read's device time.
        x: Inputs (..., K).
        seed: The read's uint32 noise seed (required where the chip has read noise).
        bias: Added to the result: per column (N,), or anything that broadcasts to (..., N).
        dac_bits: DAC resolution; None: no DAC (float inputs).
        adc_bits: ADC resolution.

    Returns:
        y (..., N), float32.

    Raises:
        ValueError: Inputs of another K, no seed for a noisy chip, or DAC codes wider than the
            snapshot's int8 weights (see `mvm_kwargs`).
    """
    s = snap.shape
    lead = x.shape[:-1]
    check_read(snap, x.shape[-1], seed, dac_bits)
    x2 = x.reshape(-1, s.k).astype(jnp.float32)
    qmax = float(2 ** (adc_bits - 1) - 1)
    if s.packed:  # the whole MVM as one VNNI custom call: DAC, dots, noise, ADC, tile sum, dequantisation
        fused = bias is None or jnp.ndim(bias) <= 1  # a per-column bias goes in; any other is added after
        b = jnp.broadcast_to(bias, (s.n,)).astype(jnp.float32) if fused and bias is not None else None
        y = vnni.mvm(x2, snap.w[0], snap.corr, None if snap.var is None else snap.var[0], snap.var_scale,
                     snap.lsb, snap.gain, snap.scale, b, seed, k=s.k, n=s.n, qmax=qmax,
                     dac_qmax=float(2 ** (dac_bits - 1) - 1))
        y = y.reshape(*lead, s.n)
        return y if fused else y + bias
    if dac_bits is not None:
        x2, xscale = quantise_rows(x2, dac_bits)
    else:
        xscale = None
    y = _read_tiles(snap, x2, seed, qmax)
    if xscale is not None:
        y = y * xscale
    y = (y * snap.scale).reshape(*lead, s.n)
    return y if bias is None else y + bias


def direct(snap: Snapshot, x, bias=None) -> bool:
    """Whether a read of host input x runs by `mvm_direct`: a packed snapshot, concrete float32
    inputs (not traced) and at most a per-column bias."""
    return (snap.shape.packed and not isinstance(x, jax.core.Tracer) and getattr(x, "dtype", None) == np.float32
            and (bias is None or (not isinstance(bias, jax.core.Tracer) and np.ndim(bias) <= 1)))


def mvm_direct(snap: Snapshot, x: np.ndarray, seed: int, bias=None, *, dac_bits: int | None = 8,
               adc_bits: int = 8) -> np.ndarray:
    """`mvm` of a packed snapshot (`direct`) on a host array x (rows, K): the same bits, without an
    XLA program, so a new row count costs no compile and no padding."""
    s = snap.shape
    check_read(snap, x.shape[-1], seed, dac_bits)
    b = None if bias is None else np.ascontiguousarray(np.broadcast_to(np.asarray(bias, np.float32), (s.n,)))
    return vnni.mvm_direct(np.ascontiguousarray(x, np.float32), snap.kernel_weights, b, seed, k=s.k, n=s.n,
                           qmax=float(2 ** (adc_bits - 1) - 1), dac_qmax=float(2 ** (dac_bits - 1) - 1))


def mvm_kwargs(spec: ChipSpec) -> dict:
    """The static kernel settings a chip implies.

    Args:
        spec: The chip.

    Returns:
        `mvm`'s keyword arguments: {"dac_bits": ..., "adc_bits": ...} (dac_bits None without a DAC).
    """
    return {"dac_bits": spec.dac.bits if spec.dac.enabled else None, "adc_bits": spec.adc.bits}


def linear(state_or_snap, x, spec: ChipSpec, *, seed: int = 0, bias=None, t_now: float = 0.0):
    """Convenience: snapshot (if given a programmed state) and run the MVM.

    Args:
        state_or_snap: A ProgrammedWeight (read at `t_now`) or a Snapshot.
        x: Inputs (..., K).
        spec: The chip.
        seed: The read's noise seed.
        bias: Added to the result, as `mvm` takes it.
        t_now: Device time of the read (s), for a ProgrammedWeight.

    Returns:
        y (..., N), float32.
    """
    snap = state_or_snap if isinstance(state_or_snap, Snapshot) else snapshot(state_or_snap, t_now, spec)
    return mvm(snap, x, np.uint32(seed), bias, **mvm_kwargs(spec))


def clipped_fraction(snap: Snapshot, x, spec: ChipSpec) -> float:
    """Fraction of tile-column conversions that hit the ADC rails for input x (diagnostic)."""
    if snap.lsb is None:
        return 0.0
    s = snap.shape
    x2 = jnp.asarray(x, jnp.float32).reshape(-1, s.k)
    if spec.dac.enabled:
        x2, _ = quantise_rows(x2, spec.dac.bits)
    if s.packed:  # the kernel's own partial sums
        p = vnni.tile_dots(x2, snap.w[0], snap.corr, None, None, k=s.k, n=s.n)[0]
    else:
        x2 = jnp.pad(x2, ((0, 0), (0, s.grid_k * s.rows - s.k)))
        p = jnp.matmul(jnp.swapaxes(x2.reshape(x2.shape[0], s.grid_k, s.rows), 0, 1), snap.weights())
    qmax = 2 ** (spec.adc.bits - 1) - 1
    return float(jnp.mean(jnp.abs(p / snap.lsb[:, None, :]) > qmax + 0.5))

"""A running chip: tile allocation, resident weights, the clock, and priced operations.

This is the one stateful object of sidra_core. It holds what a real device
holds (which tiles are programmed with what, its clock and counters, the noise
stream position) and calls the pure kernels; both framework bridges drive the
chip through it, so they price and compute identically.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from . import buckets, crossbar, engine, host, ops, rng, vnni
from .conv import conv as conv_kernel
from .conv import conv_args, output_positions
from .clock import DeviceClock
from .mapping import capacity_error, system_tiles, tile_grid
from .quant import QuantisedWeight
from .spec import ChipSpec, resolve

# A snapshot is re-evaluated once some cell's drift factor may have moved by
# more than this (relative); 1e-4 is far below the read noise of any preset.
_DRIFT_REUSE_TOL = 1e-4


class EnduranceWarning(UserWarning):
    """Some cells were written more often than their endurance allows.

    Args:
        message: How many cells, and the endurance they passed.
    """


def _binary(nbytes: float) -> str:
    """A byte count in KiB, MiB, GiB or TiB, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


class HostMemoryError(MemoryError):
    """A model's programmed state needs more host memory than is available (Chip.check_fits)."""


@dataclass
class Resident:
    """A weight programmed on the chip, with its cached read snapshot.

    Attributes:
        name: The weight's name (profiler rows, error messages).
        state: Its programmed state on its tiles.
        snap: The cached read snapshot, or None until the next read makes one.
        snap_time: The device time the snapshot was taken at.
        version: The bridge's change marker (e.g. a tensor version counter).
        freed: Its tiles were released (`Chip.free`).
    """

    name: str
    state: crossbar.ProgrammedWeight
    snap: crossbar.Snapshot | None = None
    snap_time: float = -1.0
    version: object = None
    freed: bool = False

    @property
    def tiles(self) -> int:
        return self.state.grid.tiles

    @property
    def tile_ids(self) -> tuple[int, ...]:
        return self.state.tile_ids

    @property
    def first_tile(self) -> int:
        return self.state.first_tile

    @property
    def shape(self) -> tuple[int, int]:
        return self.state.shape


@dataclass
class Chip:
    """One SIDRA system (one or more chips of the same spec) as the bridges see it.

    Made by `Chip.create(chip, seed, **overrides)` from a preset name, TOML path or ChipSpec.

    Attributes:
        spec: What the chip is.
        seed: The run seed of its noise streams (programming and read noise).
        clock: Its device clock and counters (background power set from the spec).
    """

    spec: ChipSpec
    seed: int = 0
    clock: DeviceClock = field(default_factory=DeviceClock, repr=False)
    _residents: list[Resident] = field(default_factory=list, repr=False)
    _op_counter: int = 0
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self):
        self.clock.background_w = self.spec.cost.background_w  # the chip's power while it works

    @classmethod
    def create(cls, chip="y1", seed: int = 0, **overrides) -> "Chip":
        return cls(spec=resolve(chip, **overrides), seed=seed)

    # -- capacity ---------------------------------------------------------

    @property
    def tiles_total(self) -> int:
        return system_tiles(self.spec)

    @property
    def residents(self) -> list[Resident]:
        """The weights programmed on the chip now, in programming order."""
        return [r for r in self._residents if not r.freed]

    @property
    def tiles_in_use(self) -> int:
        return sum(r.tiles for r in self.residents)

    def _compact(self) -> None:
        """Drop freed weights from the resident list (under the lock)."""
        if any(r.freed for r in self._residents):
            self._residents = self.residents

    def _allocate(self, tiles: int, name: str) -> np.ndarray:
        """The lowest-numbered free tiles; a weight's tiles need not be adjacent
        (each tile has its own periphery), so freed tiles are always reusable."""
        self._compact()
        used = np.zeros(self.tiles_total, bool)
        for r in self._residents:
            used[list(r.tile_ids)] = True
        free = np.flatnonzero(~used)
        if free.size < tiles:
            raise capacity_error(repr(name), tiles, self.tiles_in_use, self.spec)
        return free[:tiles]

    def check_fits(self, shapes, name: str = "model") -> None:
        """Raise ChipCapacityError before programming anything if these K x N weights cannot fit on
        the tiles, HostMemoryError if their programmed state cannot fit in the host's memory."""
        grids = [tile_grid(k, n, self.spec) for k, n in shapes]
        need = sum(g.tiles for g in grids)
        if need > self.tiles_total - self.tiles_in_use:
            raise capacity_error(name, need, self.tiles_in_use, self.spec)
        per_cell = crossbar.state_bytes_per_cell(self.spec)
        need_bytes = int(per_cell * sum(g.k_padded * g.n_padded for g in grids))
        free = host.available_memory()
        if free is not None and need_bytes > free:
            raise HostMemoryError(
                f"{name} needs {need_bytes:,} bytes ({_binary(need_bytes)}) of host memory for its programmed state "
                f"({sum(g.k * g.n for g in grids):,} weights on {need} tiles, {per_cell} bytes per cell pair), but "
                f"{_binary(free)} is available: free memory, program fewer or smaller weights, or run on a "
                f"host with more memory")

    def host_memory(self) -> dict[str, int]:
        """Host memory of the programmed weights: `weights` (K x N summed), `state_bytes` (their
        programmed state) and `snapshot_bytes` (their cached read snapshots)."""
        live = self.residents
        return {"weights": sum(r.state.grid.k * r.state.grid.n for r in live),
                "state_bytes": sum(r.state.host_bytes for r in live),
                "snapshot_bytes": sum(r.snap.host_bytes for r in live if r.snap is not None)}

    # -- programming --------------------------------------------------------

    def next_seed(self) -> int:
        """A fresh uint32 noise seed: the run seed and a per-chip operation counter."""
        with self._lock:
            self._op_counter += 1
            return rng.seed32(self.seed, self._op_counter)

    def manual_seed(self, seed: int) -> None:
        with self._lock:
            self.seed = int(seed)
            self._op_counter = 0

    def program(self, w=None, *, name: str = "weight", quantised: QuantisedWeight | None = None,
                version: object = None) -> Resident:
        """Map a K x N weight onto free tiles and write it by ISPP; charge the programming."""
        shape = quantised.codes.shape if quantised is not None else np.shape(w)
        if len(shape) != 2:
            raise ValueError(f"a crossbar weight is 2-D (K x N), got shape {tuple(shape)}")
        grid = tile_grid(*shape, self.spec)
        with self._lock:
            tiles = self._allocate(grid.tiles, name)
            state = crossbar.program(w, self.spec, seed=self.next_seed(), t_now=self.clock.now,
                                     tile_ids=tiles, quantised=quantised)
            res = Resident(name=name, state=state, version=version)
            self._residents.append(res)
            self._charge_programming(state)
        host.release_freed_memory()
        return res

    def reprogram(self, res: Resident, w=None, *, quantised: QuantisedWeight | None = None,
                  version: object = None) -> crossbar.ProgrammingReport:
        """Write only the cells whose target changed (incremental ISPP from the present G)."""
        self._check_live(res)
        with self._lock:
            state = crossbar.reprogram(res.state, w, self.spec, seed=self.next_seed(), t_now=self.clock.now,
                                       quantised=quantised)
            res.state, res.snap, res.version = state, None, version
            self._charge_programming(state)
            return state.programming

    def _charge_programming(self, state: crossbar.ProgrammedWeight) -> None:
        rep = state.programming
        self.charge(ops.programming(rep.pulses, rep.cells_written, self.spec))
        if rep.endurance_exceeded:
            warnings.warn(
                f"{rep.endurance_exceeded} cells were written more than their endurance of "
                f"{self.spec.ispp.endurance:.0e} cycles; they may fail on real hardware",
                EnduranceWarning, stacklevel=3,
            )

    @staticmethod
    def _check_live(res: Resident) -> None:
        if res.freed:
            raise RuntimeError(f"weight {res.name!r} was freed from the chip; program it again")

    def free(self, res: Resident) -> None:
        """Release a weight's tiles. Lock-free: it may run from a garbage collection in any
        thread (even an ISPP worker while `program` holds the lock); the list is compacted later."""
        res.freed = True
        res.snap = None

    # -- reads ---------------------------------------------------------------

    def snapshot(self, res: Resident) -> crossbar.Snapshot:
        """The array as read now, reusing the cached one while drift has not moved it."""
        self._check_live(res)
        now = self.clock.now
        if res.snap is None or self._drift_moved(res, now):
            res.snap = crossbar.snapshot(res.state, now, self.spec)
            res.snap_time = now
        return res.snap

    def _drift_moved(self, res: Resident, now: float) -> bool:
        n = self.spec.noise
        if not self.spec.drifts:
            return False
        youngest = res.state.t_latest
        nu_max = n.drift_nu_mean + 6 * n.drift_nu_std
        old_age = max(res.snap_time - youngest, 0.0) + n.drift_t0
        new_age = max(now - youngest, 0.0) + n.drift_t0
        return nu_max * math.log(new_age / old_age) > _DRIFT_REUSE_TOL

    def linear(self, res: Resident, x, bias=None):
        """y = x @ W (+ bias) on the crossbar, x: (..., K); charges the MVM. Runs at the row bucket
        (sidra_core.buckets) of x's rows, or unpadded on host buffers (crossbar.direct: a NumPy x
        then gives a NumPy y); priced for its real rows."""
        k, n = res.shape
        lead = np.shape(x)[:-1]
        rows = math.prod(lead)
        snap = self.snapshot(res)
        kw = crossbar.mvm_kwargs(self.spec)
        crossbar.check_read(snap, np.shape(x)[-1], 0, kw["dac_bits"])  # before a seed is drawn or a read charged
        if crossbar.direct(snap, x, bias):
            y = crossbar.mvm_direct(snap, np.asarray(x).reshape(rows, k), self.next_seed(), bias,
                                    **kw).reshape(*lead, n)
            y = y if isinstance(x, np.ndarray) else buckets.put(y)
        else:
            if bias is not None and np.ndim(bias) > 1:  # a bias per row: padded with the rows
                bias = buckets.pad(buckets.xp(bias).broadcast_to(bias, (*lead, n)), shape=(rows, n))
            elif isinstance(bias, np.ndarray):  # committed, as the bridges' arrays (one program per placement)
                bias = buckets.put(bias)
            y = buckets.take(crossbar.mvm(snap, buckets.pad(x, shape=(rows, k)), np.uint32(self.next_seed()), bias,
                                          **kw), (rows, n), (*lead, n))
        self.charge(ops.mvm(rows, k, n, self.spec))
        return y

    def conv(self, res: Resident, x, w_shape, bias=None, stride=1, padding=0, dilation=1):
        """N-d convolution of x (N, C_in, *spatial) with a programmed conv weight, at the bucket of N."""
        args = conv_args(w_shape, stride, padding, dilation)
        shape = np.shape(x)
        y = conv_kernel(self.snapshot(res), buckets.pad(x), np.uint32(self.next_seed()), bias, **args,
                        **crossbar.mvm_kwargs(self.spec))
        rows = int(shape[0]) * output_positions(shape, w_shape, stride, padding, dilation)
        k, n = res.shape
        self.charge(ops.mvm(rows, k, n, self.spec))
        return buckets.take(y, (shape[0], *y.shape[1:]))

    # -- compute engine -------------------------------------------------------

    def engine(self, op: str, x, **kwargs):
        """An element-wise or normalising op on the compute engine, at the bucket of its rows
        (element-wise: of its elements), or unpadded on host buffers (engine.native: a NumPy x then
        gives NumPy results); charges it for its real size."""
        p = self.spec.engine.precision
        direct = engine.native(op, p) and _on_host(x, kwargs)
        # host operands as the bridges' committed arrays: a program is compiled per argument placement
        kwargs = kwargs if direct else {k: buckets.put(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        if direct:
            y = engine.direct(op, x, precision=p, **kwargs)
        elif op in engine.ELEMENTWISE:
            y = _by_rows(engine.ELEMENTWISE[op], x, 0, precision=p)
        elif op in ("softmax", "log_softmax"):
            axis, last = kwargs.pop("axis", -1) % np.ndim(x), np.ndim(x) - 1
            if axis == last:  # rows as they lie: no host round trip to move an axis
                y = _by_rows(getattr(engine, op), x, 1, precision=p, **kwargs)
            else:
                m = buckets.xp(x)
                y = _by_rows(getattr(engine, op), m.moveaxis(m.asarray(x), axis, -1), 1, precision=p, **kwargs)
                y = m.moveaxis(m.asarray(y), -1, axis)
                y = y if m is jnp else buckets.put(y)
        elif op in engine.NORMS:
            y = _by_rows(getattr(engine, op), x, kwargs.get("ndim", 1), precision=p, **kwargs)
        elif op == "batch_norm":  # channels on axis 1: the batch is the rows
            y = _by_rows(engine.batch_norm, x, np.ndim(x) - 1, precision=p, **kwargs)
        else:
            raise ValueError(f"the compute engine has no op {op!r}")
        self.charge(ops.engine(op, int(np.size(x)), self.spec))
        return y

    def matmul(self, a, b):
        """Activation x activation matmul (attention) on the engine's INT8 MACs, at the buckets of
        its batch, M and N (each row of a and column of b is quantised on its own)."""
        *batch, m, kk = np.shape(a)
        n = np.shape(b)[-1]
        lead = np.broadcast_shapes(tuple(batch), tuple(np.shape(b)[:-2]))
        nb = math.prod(lead)
        mode = self.spec.engine.matmul
        if np.ndim(b) == 2:  # one right operand: a's batch joins its rows
            y = engine.matmul(buckets.pad(a, shape=(nb * m, kk)), buckets.pad(b, axes=(1,)), mode=mode)
            y = buckets.take(y, (nb * m, n), (*lead, m, n))
        else:
            xa, xb = buckets.xp(a), buckets.xp(b)
            ap = buckets.pad(xa.broadcast_to(a, (*lead, m, kk)), axes=(0, 1), shape=(nb, m, kk))
            bp = buckets.pad(xb.broadcast_to(b, (*lead, kk, n)), axes=(0, 2), shape=(nb, kk, n))
            y = buckets.take(engine.matmul(ap, bp, mode=mode), (nb, m, n), (*lead, m, n))
        self.charge(ops.engine_matmul(nb, m, kk, n, self.spec))
        return y

    def attention(self, q, k, v, mask=None, *, scale: float, causal: bool = False, shapes=None):
        """Scaled dot-product attention on the engine (q, k, v: (..., L, E); NumPy ones give a NumPy
        result where it attends directly); charges its two matmuls, the masked scores' element-wise pass and the softmax, as the ops one by one, for
        `shapes` (q, k, v) if given: the caller's own when it padded the lengths (padded_length)."""
        e = self.spec.engine
        if self.attends_directly(q, k, v, mask, causal):
            y = vnni.attention_direct(np.asarray(q), np.asarray(k), np.asarray(v),
                                      None if mask is None else np.asarray(mask), bool(causal),
                                      scale=float(scale), storage=engine.STORAGE[e.precision])
            y = y if isinstance(q, np.ndarray) else buckets.put(y)
        else:
            y = engine.attention(q, k, v, mask, scale=float(scale), causal=bool(causal), precision=e.precision,
                                 mode=e.matmul)
        self.charge(ops.attention_of(*(shapes or (np.shape(q), np.shape(k), np.shape(v))), self.spec))
        return y

    def attends_directly(self, q, k, v, mask=None, causal: bool = False) -> bool:
        """Whether `attention` of these operands calls the VNNI kernel straight on host buffers
        (concrete float32 arrays, a bool or float32 mask or none): any lengths, unpadded, with no
        program."""
        args = (q, k, v) if mask is None else (q, k, v, mask)
        return (not any(isinstance(t, jax.core.Tracer) for t in args)
                and all(getattr(t, "dtype", None) == np.float32 for t in (q, k, v))
                and engine.native_attention(self.spec.engine.matmul, np.shape(q)[-1], np.shape(k)[-2], mask))

    def charge(self, price: ops.Price) -> None:
        """Charge the device clock for one op (sidra_core.ops' price of it)."""
        self.clock.charge(price.cost, **price.counts)

    def charge_memory(self, nbytes: int, level: str = "dram") -> None:
        """Data movement in device memory: `sram` for activations, `dram` for stored tensors."""
        self.charge(ops.memory(nbytes, self.spec, level))

    def charge_host(self, nbytes: int, transfers: int = 1, fallback: bool = False) -> None:
        self.charge(ops.host_transfer(nbytes, self.spec, transfers, fallback))

    def set_drift_compensation(self, enabled: bool) -> None:
        """Switch the global drift compensation (a per-tile gain from a reference read) on or off.

        A read-out setting of the same chip: the programmed cells are kept.
        """
        with self._lock:
            self.spec = self.spec.replace(noise__drift_compensation=bool(enabled))
            for r in self.residents:
                r.snap = None

    def advance(self, seconds: float) -> float:
        """Jump the device clock (drift studies): an hour, a day, a year after programming."""
        return self.clock.advance(seconds)


def _on_host(x, kwargs) -> bool:
    """Whether x is a float32 NumPy array and the other array operands are concrete (a direct call)."""
    return (isinstance(x, np.ndarray) and x.dtype == np.float32
            and not any(isinstance(v, jax.core.Tracer) for v in kwargs.values()))


def _by_rows(fn, x, trailing: int, **kwargs):
    """fn over x's rows (its last `trailing` axes are a row), run at the bucket of the row count;
    each of fn's outputs (one array or a tuple) is cut back to x's leading shape."""
    shape = np.shape(x)
    lead, row = shape[:len(shape) - trailing], shape[len(shape) - trailing:]
    rows = math.prod(lead)
    out = fn(buckets.pad(x, shape=(rows, *row)), **kwargs)

    def cut(o):
        return buckets.take(o, (rows, *o.shape[1:]), (*lead, *o.shape[1:]))

    return tuple(cut(o) for o in out) if isinstance(out, tuple) else cut(out)

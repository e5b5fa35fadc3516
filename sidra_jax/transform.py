"""`sidra_jax.jit`: run a JAX function on a SIDRA chip as one XLA program.

A call flattens the arguments (programmed `Weight`s are crossbar candidates),
looks up the device plan of that input signature (built once by tracing the
function to a jaxpr, see `plan.py`), then

1. makes sure every crossbar weight the plan needs is programmed and current
   (the first call programs them lazily, in first-use order, interleaved with
   the MVM seed draws and the cost charges exactly as sidra_torch's eager
   dispatch does, so two chips of the same spec and seed see the same
   sequence of `Chip.program` / `Chip.next_seed` calls);
2. takes each weight's read snapshot (`Chip.snapshot`: drift at the device
   time now) and draws one fresh noise seed per MVM (`Chip.next_seed`);
3. charges the plan's static cost to `chip.clock`;
4. runs the jitted executor: snapshots, seeds, argument leaves and constants
   go in as arguments, so repeated calls reuse the compiled program and get
   fresh noise.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings

import jax
import numpy as np

from sidra_core import Chip, crossbar
from sidra_core.cost import ZERO, Cost
from sidra_core.report import OpRecord, key_averages

from . import plan as _plan
from . import profiler as _profiler
from .execute import executor
from .weights import PARAM, Weight, is_weight

_warned_traced = False


def _concrete(x):
    """The concrete array behind x (through JVP / linearize tracers), or None under an outer jit."""
    while isinstance(x, jax.core.Tracer):
        p = getattr(x, "primal", None)
        if p is None:
            return None
        x = p
    return x


def _leaf_sig(x) -> tuple:
    """(shape, dtype, weak_type) of an argument leaf, cheaply (this runs on every call)."""
    if type(x) is np.ndarray:
        return x.shape, x.dtype, False
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.shape, x.dtype, x.weak_type
    a = jax.typeof(x)
    return a.shape, a.dtype, getattr(a, "weak_type", False)


class Report:
    """What one call of a function does on the chip: ops, crossbar weights, cost (static, no execution).

    Made by `SidraFunction.report(*args)`.

    Args:
        plan: The call's device plan.
        names: A name per argument leaf (a weight's pytree path, else "arg<i>").
        fn_name: The function's name, for the table's header.
    """

    def __init__(self, plan: _plan.Plan, names: list[str], fn_name: str):
        self.plan = plan
        self.fn_name = fn_name
        watts = plan.spec.cost.background_w  # the chip's background power over the ops' latency
        self.total: Cost = plan.total.with_background(watts)
        self.counts = dict(plan.counts)
        self.weights = [(names[w.leaf], w.k, w.n) for w in plan.wrefs]
        self.records = [OpRecord(s.name, s.where, s.cost.with_background(watts), s.counts.get("host_bytes", 0))
                        for s in plan.steps]

    @property
    def latency_s(self) -> float:
        return self.total.latency_s

    @property
    def energy_j(self) -> float:
        return self.total.energy_j

    def energy_by_component(self) -> dict:
        return self.total.energy_by_component()

    def key_averages(self):
        return key_averages(self.records)

    def table(self, sort_by: str = "device_time_total", row_limit: int = -1) -> str:
        head = [f"{self.fn_name}: {len(self.plan.instrs)} ops, {len(self.weights)} crossbar weights, "
                f"{self.counts.get('mvms', 0)} MVMs per call, {self.plan.fused_bias} biases fused into MVMs"]
        for name, k, n in self.weights:
            head.append(f"  crossbar {name}: {k} x {n}")
        return "\n".join(head) + "\n" + self.key_averages().table(sort_by=sort_by, row_limit=row_limit)

    def __repr__(self):
        return (f"Report({self.fn_name}: {self.total.latency_s * 1e6:.2f} us, {self.total.energy_j * 1e6:.3f} uJ "
                f"per call, {len(self.weights)} crossbar weights)")


class SidraFunction:
    """A JAX function transformed to run on a SIDRA chip (see `sidra_jax.jit`).

    Args:
        fn: The JAX function.
        chip: The chip it runs on; None: the chip its programmed arguments live on.
        static_argnums: Positional arguments that are static (hashable, not traced), as jax.jit's.
        static_argnames: Keyword arguments that are static, as jax.jit's.
        transfers: Charge the host link for argument arrays not in device memory and for results.
        graph: Price a call as one compiled graph instead of op after op.

    Raises:
        TypeError: `chip` is not a sidra_core.Chip.
    """

    def __init__(self, fn, chip: Chip | None = None, *, static_argnums=(), static_argnames=(),
                 transfers: bool = True, graph: bool = False):
        functools.update_wrapper(self, fn)
        if not hasattr(self, "__name__"):
            self.__name__ = getattr(type(fn), "__name__", "function")
        if chip is not None and not isinstance(chip, Chip):
            raise TypeError(f"chip must be a sidra_core.Chip, got {type(chip).__name__}")
        self.fn = fn
        self.chip = chip
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.transfers = bool(transfers)
        self.graph = bool(graph)
        self._plans: dict = {}
        self._executors: dict = {}  # compiled programs, shared by chips whose kernels agree
        self._population_stack = None  # (key, snapshots, stacked): population.call's last stack
        self._lock = threading.RLock()
        self.traces = 0

    # -- arguments -----------------------------------------------------------------

    def _split(self, args, kwargs):
        n = len(args)
        snums = tuple(i % n for i in self.static_argnums if -n <= i < n)
        dyn_args = tuple(a for i, a in enumerate(args) if i not in snums)
        static = tuple((i, args[i]) for i in sorted(snums))
        static += tuple(sorted((k, kwargs[k]) for k in self.static_argnames if k in kwargs))
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return dyn_args, dyn_kwargs, static, n

    def _flatten(self, args, kwargs):
        dyn_args, dyn_kwargs, static, nargs = self._split(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs), is_leaf=is_weight)
        values, slots = [], []
        for leaf in leaves:
            if isinstance(leaf, Weight):
                values.append(leaf.value)
                slots.append(leaf.slot)
            else:
                if isinstance(leaf, (bool, int, float, complex)):
                    leaf = jax.numpy.asarray(leaf)
                elif not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
                    raise TypeError(f"{self.__name__}: argument leaf of type {type(leaf).__name__} is not an array; "
                                    f"mark it static (static_argnums / static_argnames)")
                values.append(leaf)
                slots.append(None)
        return values, slots, treedef, static, nargs

    def _chip(self, slots) -> Chip:
        chip = self.chip
        for s in slots:
            if s is None:
                continue
            if chip is None:
                chip = s.chip
            elif s.chip is not chip:
                raise ValueError(f"{s.name} is programmed on another chip than the one {self.__name__} runs on")
        if chip is None:
            raise ValueError(f"{self.__name__}: no chip; pass chip= to sidra_jax.jit or programmed parameters "
                             f"(sidra_jax.program(params, chip))")
        return chip

    # -- plans ---------------------------------------------------------------------

    def _get_plan(self, values, slots, treedef, static, nargs, chip: Chip) -> _plan.Plan:
        sigs = tuple(_leaf_sig(v) for v in values)
        kinds = tuple(0 if s is None else (1 if s.kind == PARAM else 2) for s in slots)
        key = (treedef, sigs, kinds, static, chip.spec, self.transfers, self.graph)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                return plan
            structs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in sigs]
            plan = self._trace(structs, slots, treedef, static, nargs, chip)
            # The program depends on the spec only through the kernels' static settings (noise levels,
            # conductances and costs are data or Python): chips that agree share one compiled program.
            spec = chip.spec
            ekey = (key[:4], key[5:], spec.engine.precision, spec.engine.matmul,
                    tuple(sorted(crossbar.mvm_kwargs(spec).items())))
            ex = self._executors.get(ekey)
            if ex is None:
                ex = self._executors[ekey] = executor(plan, spec)
            plan.executor = ex
            self._plans[key] = plan
            return plan

    def _trace(self, structs, slots, treedef, static, nargs, chip) -> _plan.Plan:
        out_tree = []
        static_pos = dict((k, v) for k, v in static if isinstance(k, int))
        static_kw = dict((k, v) for k, v in static if isinstance(k, str))
        fn = self.fn

        def flat_fn(*flat):
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, list(flat))
            it = iter(dyn_args)
            args = [static_pos[i] if i in static_pos else next(it) for i in range(nargs)]
            out = fn(*args, **dyn_kwargs, **static_kw)
            flat_out, tree = jax.tree_util.tree_flatten(out)
            out_tree.append(tree)
            return flat_out

        closed = jax.make_jaxpr(flat_fn)(*structs)
        self.traces += 1
        p = _plan.build(closed, chip.spec, [s is not None and s.kind == PARAM for s in slots],
                        [s is not None for s in slots], self.transfers, self.graph)
        p.out_tree = out_tree[0]
        return p

    def plan(self, *args, **kwargs) -> _plan.Plan:
        """The device plan for these arguments (traced once; nothing is programmed or run)."""
        values, slots, treedef, static, nargs = self._flatten(args, kwargs)
        return self._get_plan(values, slots, treedef, static, nargs, self._chip(slots))

    def report(self, *args, **kwargs) -> Report:
        """The ops, crossbar weights and static cost of one call with these arguments (no execution)."""
        values, slots, treedef, static, nargs = self._flatten(args, kwargs)
        p = self._get_plan(values, slots, treedef, static, nargs, self._chip(slots))
        names = [s.name if s is not None else f"arg{i}" for i, s in enumerate(slots)]
        return Report(p, names, self.__name__)

    def cost(self, *args, **kwargs) -> Cost:
        """Device latency and energy of one call (steady state: weights already programmed)."""
        p = self.plan(*args, **kwargs)
        return p.total.with_background(p.spec.cost.background_w)

    # -- calls -----------------------------------------------------------------------

    def population(self, chips, *args, **kwargs):
        """Call on every chip of `chips` (a sidra_core.Population, or Chips of one spec) in one program.

        Each chip is prepared as a call on it alone is (its crossbar copies programmed at first use,
        a read snapshot of each, fresh noise seeds, its clock charged), so chip i's outputs are the
        bits a call on chip i gives; the executor runs once, vmapped over the chips and sharded over
        JAX's devices. The weights' copies on all chips are checked against the host's memory
        first (sidra_core.HostMemoryError names the largest chunk that fits).

        Returns:
            The function's outputs, each with a leading axis of one entry per chip.
        """
        from . import population

        return population.call(self, chips, args, kwargs)

    def __call__(self, *args, **kwargs):
        global _warned_traced
        t0 = time.perf_counter()
        values, slots, treedef, static, nargs = self._flatten(args, kwargs)
        chip = self._chip(slots)
        plan = self._get_plan(values, slots, treedef, static, nargs, chip)
        concrete = [_concrete(v) for v in values]
        traced = any(c is None for c in concrete)  # under an outer jit: abstract values
        nested = traced or any(isinstance(v, jax.core.Tracer) for v in values)  # under any transformation
        for c, s in zip(concrete, slots):
            if c is not None and s is not None and s.kind == PARAM:
                s.observe(c)
        if traced and not _warned_traced:
            _warned_traced = True
            warnings.warn(f"{self.__name__} is traced by an outer jax.jit: its noise seeds and device cost are fixed "
                          f"when it is traced (every call of the outer function reuses them); call sidra_jax "
                          f"functions outside jax.jit (they are compiled already)", stacklevel=2)
        profs = _profiler.active()
        out, records, start = run(plan, slots, values, chip, self.__name__, self._lock, record=bool(profs))
        if profs:
            if not nested:
                out = jax.block_until_ready(out)
            host_s = time.perf_counter() - t0
            total = ZERO
            for r in records:
                total = total + r.cost
            for p in profs:
                p._add_call(f"sidra_jax::{self.__name__}", records, total, host_s, start)
        return jax.tree_util.tree_unflatten(plan.out_tree, out)


def run(plan: _plan.Plan, slots: list, values: list, chip: Chip, name: str, lock, record: bool = False):
    """One call of a plan on `chip`: its crossbar copies current (programmed at first use), a read
    snapshot of each and a fresh noise seed per MVM, the clock charged, the executor run.

    `slots[i]` is leaf i's weight slot (None for data): anything with `fresh(key)`, `resident(key)`
    and `held(key)`. Returns (flat outputs, profiler records or None, the device time it started).
    """
    snaps, seeds, records, start = prepare(plan, slots, chip, name, lock, record)
    return plan.executor(snaps, seeds, values, plan.consts), records, start


def prepare(plan: _plan.Plan, slots: list, chip: Chip, name: str, lock, record: bool = False):
    """What `run` does on the chip before the executor runs: (snapshots, seeds, profiler records or
    None, the device time the call started)."""
    clock = chip.clock
    start = clock.now
    residents = []
    for w in plan.wrefs:
        res = slots[w.leaf].fresh(w.key)
        if res is None:
            residents = None
            break
        residents.append(res)
    records = None
    if residents is None:
        with lock:
            snaps, seeds, records = _first_call(plan, slots, chip, name, record)
    else:
        snaps = tuple(chip.snapshot(r) for r in residents)
        seeds = np.fromiter((chip.next_seed() for _ in range(plan.n_seeds)), np.uint32, plan.n_seeds)
        clock.charge(plan.total, **plan.counts)
    if record and records is None:
        records = step_records(plan, start, clock.background_w)
    return snaps, seeds, records, start


def step_records(plan: _plan.Plan, start: float, background_w: float, host_s: float = 0.0) -> list:
    """Profiler rows of one call's steps from device time `start`; a graph's pipelined latency is
    shared in proportion to its ops' own latencies, and so is `host_s`."""
    own = sum(s.cost.latency_s for s in plan.steps) or 1.0
    k = plan.total.latency_s / own if plan.graph else 1.0
    out, t = [], start
    for s in plan.steps:
        c = s.cost if k == 1.0 else Cost(s.cost.latency_s * k, *s.cost.energies)
        out.append(OpRecord(s.name, s.where, c.with_background(background_w), s.counts.get("host_bytes", 0),
                            host_s * s.cost.latency_s / own, t))
        t += c.latency_s
    return out


def _first_call(plan, slots, chip: Chip, name: str, record: bool):
    """Program what is missing in first-use order, drawing the seeds in step order; op after op
    (a plan not priced as a graph) each step is charged as it runs, as eager dispatch charges."""
    pending, seen = [], set()
    for w in plan.wrefs:
        s = slots[w.leaf]
        if not s.held(w.key) and (id(s), w.key) not in seen:
            seen.add((id(s), w.key))
            pending.append((w.k, w.n))
    if pending:
        chip.check_fits(pending, name=f"{name} ({len(pending)} crossbar weights)")
    clock = chip.clock
    snaps = [None] * len(plan.wrefs)
    seeds = np.zeros(plan.n_seeds, np.uint32)
    records = [] if record and not plan.graph else None
    for s in plan.steps:
        if records is not None:
            before, start = clock.raw(), clock.now
        if s.wref is not None:
            w = plan.wrefs[s.wref]
            res = slots[w.leaf].resident(w.key)
            snap = chip.snapshot(res)
            if snaps[s.wref] is None:
                snaps[s.wref] = snap
            seeds[s.seed] = chip.next_seed()
        if not plan.graph:
            clock.charge(s.cost, **s.counts)
        if records is not None:
            b1, e1, c1 = clock.raw()
            cost = Cost(b1 - before[0], *(y - x for x, y in zip(before[1], e1)))
            records.append(OpRecord(s.name, s.where, cost, c1["host_bytes"] - before[2]["host_bytes"], 0.0, start))
    if plan.graph:
        clock.charge(plan.total, **plan.counts)
    return tuple(snaps), seeds, records


def jit(fn=None, chip: Chip | None = None, *, static_argnums=(), static_argnames=(), transfers: bool = True,
        graph: bool = False):
    """Transform `fn` to run on a SIDRA chip, compiled by `jax.jit` into one XLA program.

    `dot_general` / `conv_general_dilated` on a programmed weight (see `sidra_jax.program`) run on the
    crossbars, the rest on the compute engine (or memory / host, priced as such); each call charges the
    device clock of `chip` (default: the chip the programmed arguments live on). `transfers=True` charges
    the host link for argument arrays not in device memory and for the results, as a PyTorch user's
    `x.to("sidra")` / `y.cpu()` are. `graph=True` prices a call as one compiled graph (MVM epilogues
    fused, rows pipelined across ops), as torch.compile's graphs are; by default op after op, as eager
    PyTorch runs them. Usable as a decorator: `@sidra_jax.jit(chip=chip)`.

    Args:
        fn: The JAX function; None returns a decorator with these settings.
        chip: The chip it runs on; None: the chip its programmed arguments live on.
        static_argnums: Positional arguments that are static (hashable, not traced), as jax.jit's.
        static_argnames: Keyword arguments that are static, as jax.jit's.
        transfers: Charge the host link for argument arrays not in device memory and for results.
        graph: Price a call as one compiled graph instead of op after op.

    Returns:
        The SidraFunction (or, without `fn`, a decorator that makes one).
    """
    if fn is None:
        return lambda f: SidraFunction(f, chip, static_argnums=static_argnums, static_argnames=static_argnames,
                                       transfers=transfers, graph=graph)
    return SidraFunction(fn, chip, static_argnums=static_argnums, static_argnames=static_argnames,
                         transfers=transfers, graph=graph)


transform = jit

"""A sidra_jax function on every chip of a population, in one program (`SidraFunction.population`).

Each chip is prepared as a call on it alone prepares it (its crossbar copies programmed at first
use, its read snapshots, a fresh noise seed per MVM, its clock charged: `transform.prepare`), so
chip i gives the bits a call on chip i alone gives. The snapshots and seeds are then stacked on a
leading chip axis and the plan's executor runs vmapped over it (the native kernels loop over the
chips inside the program). Where JAX has several devices the chip axis is sharded over them: each
runs the same program on its consecutive part of the chips, so a chip's bits do not depend on the
sharding (an SPMD-partitioned program is compiled anew, and XLA may contract its float sums
otherwise, which a later DAC can turn into another code).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sidra_core import Chip, Population, host

from .transform import prepare

CHIPS = "chips"  # the mesh axis the chip axis is sharded over


class OnChip:
    """A weight slot's crossbar copies on one chip of a population (the slot interface of `transform.run`)."""

    __slots__ = ("slot", "chip")

    def __init__(self, slot, chip: Chip):
        self.slot, self.chip = slot, chip

    def fresh(self, key):
        return self.slot.fresh(key, self.chip)

    def resident(self, key):
        return self.slot.resident(key, self.chip)

    def held(self, key) -> bool:
        return self.slot.held(key, self.chip)


def as_population(chips) -> Population:
    """A Population from a Population or a sequence of Chips of one spec."""
    if isinstance(chips, Population):
        return chips
    if isinstance(chips, Chip):
        raise TypeError("population() takes a sidra_core.Population or a sequence of Chips, not one Chip: call the "
                        "function itself to run on one chip")
    return Population(tuple(chips))


def devices_for(n: int) -> int:
    """How many of JAX's devices a population of n chips is sharded over: the most that divide n."""
    d = min(n, jax.device_count())
    while n % d:
        d -= 1
    return d


def _executor(plan):
    """The plan's executor vmapped over a leading chip axis of the snapshots and seeds (one per plan)."""
    ex = plan.__dict__.get("population_executor")
    if ex is None:
        ex = plan.population_executor = host.jit(jax.vmap(plan.executor, in_axes=(0, 0, None, None)))
    return ex


def _sharded(plan, snaps, seeds: np.ndarray, values, consts, devices: int) -> list:
    """The vmapped executor on `devices` devices, each running its consecutive part of the chips (the
    one program, placed there: the same bits as on one device), the parts dispatched at once; the
    outputs as arrays sharded over the devices on the chip axis."""
    n, devs = len(seeds), jax.devices()[:devices]
    per = n // devices
    ex = _executor(plan)

    def part(j):
        at = slice(j * per, (j + 1) * per)
        args = jax.device_put((jax.tree.map(lambda a: a[at], snaps), seeds[at], values, consts), devs[j])
        return jax.block_until_ready(ex(*args))

    with ThreadPoolExecutor(max_workers=devices, thread_name_prefix="sidra-population") as pool:
        parts = list(pool.map(part, range(devices)))
    sharding = NamedSharding(Mesh(np.array(devs), (CHIPS,)), PartitionSpec(CHIPS))
    return [jax.make_array_from_single_device_arrays((n, *parts[0][i].shape[1:]), sharding, [p[i] for p in parts])
            for i in range(len(parts[0]))]


def _stacked(fn, snaps: list) -> tuple | None:
    """The chips' snapshots stacked on a leading axis (host arrays), or None where their layouts
    differ; the last stack is kept while the same snapshots are read again."""
    key = tuple(id(s) for per_chip in snaps for s in per_chip)
    last = fn._population_stack
    if last is not None and last[0] == key:
        return last[2]
    tree = jax.tree.structure(snaps[0])
    if any(jax.tree.structure(s) != tree for s in snaps[1:]):
        return None
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *snaps)
    fn._population_stack = (key, snaps, stacked)  # (the snapshots held, so their ids stay theirs)
    return stacked


def call(fn, chips, args, kwargs):
    """`fn(*args, **kwargs)` on every chip of `chips`: its outputs with a leading chip axis."""
    pop = as_population(chips)
    values, slots, treedef, static, nargs = fn._flatten(args, kwargs)
    plan = fn._get_plan(values, slots, treedef, static, nargs, pop.chips[0])
    pending = {}
    for w in plan.wrefs:
        s = slots[w.leaf]
        lacking = [c for c in pop if not s.held(w.key, c)]
        if lacking:
            pending[(id(s), w.key)] = ((w.k, w.n), len(lacking))
    if pending:
        missing = max(n for _, n in pending.values())
        Population(pop.chips[:missing]).check_fits([shape for shape, _ in pending.values()],
                                                   name=f"{fn.__name__} ({len(pending)} crossbar weights)")
    snaps, seeds = [], []
    for chip in pop:
        on = [None if s is None else OnChip(s, chip) for s in slots]
        sn, se, _, _ = prepare(plan, on, chip, fn.__name__, fn._lock)
        snaps.append(sn)
        seeds.append(se)
    stacked = _stacked(fn, snaps)
    if stacked is None:  # layouts differ (a chip whose weights hold whole codes only): chip by chip
        outs = [plan.executor(sn, se, values, plan.consts) for sn, se in zip(snaps, seeds)]
        flat = [np.stack([np.asarray(o[i]) for o in outs]) for i in range(len(outs[0]))]
    else:
        devices = devices_for(len(pop))
        seeds = np.stack(seeds)
        flat = (_executor(plan)(stacked, seeds, values, plan.consts) if devices == 1 else
                _sharded(plan, stacked, seeds, values, plan.consts, devices))
    return jax.tree_util.tree_unflatten(plan.out_tree, list(flat))

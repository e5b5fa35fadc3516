"""A plan's repeated blocks, compiled once: a transformer's twelve layers are one XLA program run
twelve times, not one program twelve layers long (XLA's compile time grows with the program).

The instruction list is cut where few values are live (between layers: the hidden state and the
attention mask; the fewest that gives repeating blocks), each block holding at least one crossbar
MVM. Blocks whose instructions, shapes, parameters and operand wiring are the same share one jitted
function; it takes its block's inputs, read snapshots and noise seeds as arguments. Nothing is
cut where no block repeats. The blocks run the same instructions in the same order with the same
operands as one program would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .plan import Lit, Plan

MAX_CROSSING = 4  # cut only where at most this many values are live across the cut
# A custom_jvp call's derivative rule is a function object made per call site: calls whose primal
# computations agree share it (the plan keeps such calls only for jax.nn.relu and jax.nn.silu).
_RULES = {"jvp_jaxpr_fun", "jvp_jaxpr_thunk"}


@dataclass
class Block:
    instrs: list
    args: list       # refs read from before the block, in first-use order
    outs: list       # refs the block defines that are read after it
    wrefs: list      # the plan's weight-snapshot indices the block reads, in first-use order
    seeds: np.ndarray  # the plan's seed indices the block draws, in order
    key: tuple = ()


def _freeze(x):
    """A hashable, value-complete form of an instruction parameter (unknown objects by identity,
    which only prevents sharing)."""
    import jax
    from jax.extend.core import ClosedJaxpr, Jaxpr

    if isinstance(x, ClosedJaxpr):
        return ("closed_jaxpr", str(x.jaxpr), tuple(_freeze(c) for c in x.consts))
    if isinstance(x, Jaxpr):
        return ("jaxpr", str(x))
    if isinstance(x, (np.ndarray, jax.Array, np.generic)):
        a = np.asarray(x)
        return ("array", a.shape, str(a.dtype), hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest())
    if isinstance(x, dict):
        return ("dict", tuple(sorted((str(k), ("rule",) if k in _RULES else _freeze(v)) for k, v in x.items())))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze(v) for v in x))
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return (type(x).__name__, x)
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return ("obj", type(x).__qualname__, x) if type(x).__module__.startswith(("jax", "numpy")) else ("id", id(x))


def _aval(a) -> tuple:
    return tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", ""))


def _key(b: Block, avals: dict, weights: list) -> tuple:
    """What makes two blocks the same program: its arguments' types, and per instruction its kind,
    primitive, parameters, result types, and where each operand comes from (a block argument by
    position, an earlier result of the block, or a literal)."""
    local, items = {}, [tuple(_aval(avals[r]) for r in b.args)]
    args = {r: i for i, r in enumerate(b.args)}
    wrefs = {w: i for i, w in enumerate(b.wrefs)}
    for j, ins in enumerate(b.instrs):
        ops = []
        for r in ins.ins:
            if isinstance(r, Lit):
                ops.append(("lit", _freeze(r.val)))
            elif r in local:
                ops.append(("local", local[r]))
            else:
                ops.append(("arg", args[r]))
        # the weight by position and layout; a fused bias by its operand (meta holds its ref)
        meta = {k: (True if k == "bias" else v) for k, v in ins.meta.items() if k != "wref"}
        w = None if ins.wref is None else (wrefs[ins.wref], _freeze(weights[ins.wref].key),
                                           weights[ins.wref].k, weights[ins.wref].n)
        items.append((ins.kind, ins.name, getattr(ins.prim, "name", None), _freeze(ins.params), _freeze(meta),
                      tuple(_aval(a) for a in ins.out_avals), tuple(ops), w, ins.seed is not None))
        for k, r in enumerate(ins.outs):
            local[r] = (j, k)
    return tuple(items)


def blocks(plan: Plan) -> list[Block] | None:
    """The plan cut into blocks, or None where no block would repeat (one program then)."""
    instrs = plan.instrs
    n = len(instrs)
    mvms = [ins.wref is not None for ins in instrs]
    if sum(mvms) < 4:
        return None
    start, last = {}, {}  # a value is live from its definition (an argument: its first use) to its last use
    for i, ins in enumerate(instrs):
        for r in ins.ins:
            if not isinstance(r, Lit):
                start.setdefault(r, i)
                last[r] = i
        for r in ins.outs:
            start[r] = i
    for r in plan.out_refs:
        if not isinstance(r, Lit):
            last[r] = n
    crossing = np.zeros(n + 1, np.int64)  # crossing[i]: values live across the cut after instrs[i]
    for r, d in start.items():
        u = last.get(r, d)
        if u > d:
            crossing[d] += 1
            crossing[u] -= 1
    crossing = np.cumsum(crossing)[:n]
    before = np.cumsum(mvms)
    inner = [i for i in range(n - 1) if 0 < before[i] < before[-1]]
    if not inner:
        return None
    # The fewest live values that still cut the plan into repeating blocks (a mask every layer reads
    # stays live to the last layer, so that layer alone has cuts with fewer).
    for most in range(min(int(crossing[i]) for i in inner), MAX_CROSSING + 1):
        cuts, start_mvms = [], 0
        for i in inner:
            if crossing[i] <= most and before[i] > start_mvms:
                cuts.append(i)
                start_mvms = before[i]
        out, lo = [], 0
        for c in cuts + [n - 1]:
            out.append(_block(plan, instrs[lo:c + 1], last, lo, c))
            lo = c + 1
        keys = [b.key for b in out]
        if len(set(keys)) < len(keys):
            return out
    return None


def _block(plan: Plan, instrs: list, last: dict, lo: int, hi: int) -> Block:
    defined, args = set(), []
    wrefs, seeds = [], []
    for ins in instrs:
        for r in ins.ins:
            if not isinstance(r, Lit) and r not in defined and r not in args:
                args.append(r)
        defined.update(ins.outs)
        if ins.wref is not None and ins.wref not in wrefs:
            wrefs.append(ins.wref)
        if ins.seed is not None:
            seeds.append(ins.seed)
    outs = [r for ins in instrs for r in ins.outs if last.get(r, lo) > hi]
    b = Block(instrs, args, outs, wrefs, np.asarray(seeds, np.int64))
    b.key = _key(b, plan.avals, plan.wrefs)
    return b

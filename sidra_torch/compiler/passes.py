"""Compile passes over the captured aten graph, each a small function.

1. `place`: where every node runs, decided as eager dispatch decides it
   (a matmul with a weight operand on the crossbar, attention on the engine,
   an op without a lowering eagerly, on the host if dispatch sends it there).
2. `fuse`: a crossbar MVM with its bias add, activation and residual add
   becomes one device op (`sidra_fused_*` nodes in the graph).
3. `crossbar_mapping`: which tiles each weight needs, utilisation, fit.
4. `price`: every device op's cost, and the graph's pipelined total.
5. `segments`: maximal runs of lowered nodes (one jitted JAX function each)
   between the nodes that run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from sidra_core import graph_cost, ops, placement, tile_grid
from sidra_core.cost import ZERO, Cost

from ..dispatch import CHIP_FLOATS, nbytes
from .lowering import TABLE

aten = torch.ops.aten

@dataclass(frozen=True)
class CrossbarUse:
    """A weight operand on the crossbar: graph input `weight`, the view ops that make
    the operand from it (replayed at run time to find its programmed copy), and how the
    crossbar holds it."""

    weight: int
    chain: tuple
    transpose: bool = False
    groups: int | None = None  # a convolution's groups (its weight is unrolled to K x N)
    arg: int = 1  # which argument of the node is the weight operand


def _meta(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _numel(v) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else 0


# ---------------------------------------------------------------------------
# 1. placement


def place(gm: fx.GraphModule, is_weight: list[bool]) -> None:
    """Annotate `node.meta['sidra_where']` (crossbar, engine, memory, free, eager) and, for
    views of weights, `sidra_weight` = (input index, view chain); crossbar nodes get
    `sidra_crossbar` (a CrossbarUse)."""
    inputs = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if is_weight[inputs]:
                n.meta["sidra_weight"] = (inputs, ())
            n.meta["sidra_where"] = "input"
            inputs += 1
            continue
        if n.op == "output":
            continue
        n.meta["sidra_where"] = _where(n)


def _weight_of(a):
    return a.meta.get("sidra_weight") if isinstance(a, fx.Node) else None


def _frozen(v):
    """Hashable copy of view arguments (lists of sizes become tuples)."""
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def _chip_dtypes_ok(n) -> bool:
    """Eager dispatch sends float64 / complex work to the host."""
    for a in [*n.args, *n.kwargs.values()]:
        for x in a if isinstance(a, (list, tuple)) else [a]:
            v = _meta(x)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.dtype not in CHIP_FLOATS:
                return False
    return True


def _where(n) -> str:
    low = TABLE.get(n.target)
    if n.op != "call_function" or low is None or not _chip_dtypes_ok(n) or (low.when and not low.when(n)):
        return "eager"
    if low.kind == "free":
        src = _weight_of(n.args[0]) if n.args else None
        if src is not None and getattr(n.target, "is_view", False):
            step = (n.target, _frozen(n.args[1:]), _frozen(sorted(n.kwargs.items())))
            n.meta["sidra_weight"] = (src[0], src[1] + (step,))
        return "free"
    if low.kind != "matmul":
        return "engine" if low.kind in ("engine", "elementwise") else low.kind
    return _place_matmul(n)


def _place_matmul(n) -> str:
    t = n.target
    if t is aten.bmm.default:
        return "engine"
    if t is aten.convolution.default:
        w = _weight_of(n.args[1])
        transposed, padding = n.args[6], n.args[4]
        if w is None or transposed or _meta(n.args[1]).dim() not in (3, 4, 5) or isinstance(padding, str):
            return "eager"
        n.meta["sidra_crossbar"] = CrossbarUse(w[0], w[1], False, groups=int(n.args[8]), arg=1)
        return "crossbar"
    first = 0 if t is aten.mm.default else 1  # mm(a, b); addmm(bias, a, b, beta=1, alpha=1)
    if first and (n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1):
        return "eager"
    wa, wb = _weight_of(n.args[first]), _weight_of(n.args[first + 1])
    if placement.matmul(wa is not None, wb is not None) == "engine":
        return "engine"
    if wb is not None:
        n.meta["sidra_crossbar"] = CrossbarUse(wb[0], wb[1], False, arg=first + 1)
        return "crossbar"
    if first:  # W @ x + bias: eager dispatch's host
        return "eager"
    n.meta["sidra_crossbar"] = CrossbarUse(wa[0], wa[1], True, arg=0)
    return "crossbar"


# ---------------------------------------------------------------------------
# 2. fusion: MVM + bias + activation + residual add -> one device op

_ACTIVATIONS = {aten.relu.default, aten.gelu.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_ADD = aten.add.Tensor


class FusedOp:
    """A fused device op: a crossbar MVM and its epilogue, kept as a small graph so
    the lowering runs exactly the ops eager would, in the same order."""

    def __init__(self, name: str, graph: fx.Graph, parts: list[str]):
        self.__name__ = self.__qualname__ = name
        self.graph = graph
        self.parts = parts

    def __repr__(self):
        return self.__name__

    def __call__(self, *args):  # an FX node target must be callable: run it as plain torch
        return fx.GraphModule(torch.nn.Module(), self.graph)(*args)


def _only_user(n):
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _epilogue(head, order) -> list:
    """The chain of nodes after a crossbar node that fuse into it."""
    chain, cur, stage = [], head, 0  # stages: 0 bias add, 1 activation, 2 residual add
    while True:
        nxt = _only_user(cur)
        if nxt is None or nxt.op != "call_function" or nxt.meta.get("sidra_where") not in ("engine", "free"):
            break
        if nxt.target in _RESHAPES:
            chain.append(nxt)
            cur = nxt
            continue
        if nxt.target in _ACTIVATIONS and stage <= 1:
            stage = 2
        elif nxt.target is _ADD and len(nxt.args) == 2 and not nxt.kwargs and stage <= 2:
            other = nxt.args[1] if nxt.args[0] is cur else nxt.args[0]
            if not isinstance(other, fx.Node) or order[other] > order[head]:
                break  # the other operand must exist before the MVM starts
            bias = stage == 0 and head.target is aten.mm.default and _weight_of(other) is not None
            stage = 1 if bias else 3
        else:
            break
        chain.append(nxt)
        cur = nxt
    while chain and chain[-1].target in _RESHAPES:  # trailing views stay outside
        chain.pop()
    return chain


def fuse(gm: fx.GraphModule) -> int:
    """Replace each crossbar node and its epilogue by one `sidra_fused_*` node; returns how many."""
    count = 0
    for head in list(gm.graph.nodes):
        if head.meta.get("sidra_where") != "crossbar":
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        chain = _epilogue(head, order)
        if not any(c.target not in _RESHAPES for c in chain):
            continue
        _replace(gm, head, chain)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count


def _short(target) -> str:
    return getattr(target, "__name__", str(target)).split(".")[0]


def _replace(gm, head, chain) -> None:
    members = [head, *chain]
    sub = fx.Graph()
    env, ext = {}, []

    def arg(a):
        if isinstance(a, fx.Node) and a not in env:
            ph = sub.placeholder(f"in{len(ext)}")
            ph.meta = dict(a.meta)
            env[a] = ph
            ext.append(a)
        return env[a]

    for m in members:
        new = sub.node_copy(m, arg)
        new.meta = dict(m.meta)
        env[m] = new
    sub.output(env[members[-1]])
    parts = [_short(m.target) for m in members if m.target not in _RESHAPES]
    op = FusedOp("sidra_fused_" + "_".join(parts), sub, parts)
    with gm.graph.inserting_after(members[-1]):
        node = gm.graph.call_function(op, tuple(ext))
    node.meta = dict(members[-1].meta)
    node.meta["sidra_where"] = "crossbar"
    node.meta["sidra_fused"] = [m for m in sub.nodes if m.op == "call_function"]
    members[-1].replace_all_uses_with(node)
    for m in reversed(members):
        gm.graph.erase_node(m)


# ---------------------------------------------------------------------------
# 3. static crossbar mapping


@dataclass(frozen=True)
class WeightMapping:
    name: str
    k: int
    n: int
    tiles: int
    utilisation: float  # cells holding weights / cells of its tiles


@dataclass(frozen=True)
class MappingReport:
    """Which crossbar weights the graph uses, the tiles each needs, and whether they fit."""

    weights: tuple[WeightMapping, ...]
    tiles_total: int
    tiles_free: int
    cells_per_tile: int = 256 * 256

    @property
    def tiles_used(self) -> int:
        return sum(w.tiles for w in self.weights)

    @property
    def utilisation(self) -> float:
        cells = sum(w.k * w.n for w in self.weights)
        return cells / max(self.tiles_used, 1) / self.cells_per_tile if self.weights else 0.0

    @property
    def fits(self) -> bool:
        return self.tiles_used <= self.tiles_free

    def table(self) -> str:
        lines = [f"{'weight':<48}{'K x N':>14}{'tiles':>7}{'util':>7}"]
        for w in self.weights:
            lines.append(f"{w.name[:47]:<48}{f'{w.k} x {w.n}':>14}{w.tiles:>7}{w.utilisation:>7.1%}")
        lines.append(f"{len(self.weights)} crossbar weights on {self.tiles_used} tiles "
                     f"({self.utilisation:.1%} of their cells used); {self.tiles_free} of {self.tiles_total} "
                     f"tiles free: {'fits' if self.fits else 'does NOT fit'} on this chip")
        return "\n".join(lines)


def crossbar_nodes(gm) -> list:
    """Crossbar nodes in program order, the MVMs inside fused nodes included."""
    out = []
    for n in gm.graph.nodes:
        if n.meta.get("sidra_where") != "crossbar":
            continue
        out.extend(crossbars_in(n))
    return out


def crossbars_in(n) -> list:
    """The crossbar node itself, or the MVM inside a fused node."""
    inner = n.meta.get("sidra_fused")
    return [m for m in inner if "sidra_crossbar" in m.meta] if inner else [n]


def crossbar_shape(n) -> tuple[int, int]:
    """K x N of the matrix a crossbar node holds on its tiles."""
    use = n.meta["sidra_crossbar"]
    w = _meta(n.args[use.arg])
    if use.groups is not None:
        return int(np.prod(w.shape[1:])) * use.groups, int(w.shape[0])
    k, nn = w.shape
    return (nn, k) if use.transpose else (k, nn)


def crossbar_mapping(gm, names: list[str], chip) -> MappingReport:
    """The static mapping: one entry per distinct (weight, view) the graph puts on tiles."""
    spec, seen, out = chip.spec, set(), []
    for n in crossbar_nodes(gm):
        use = n.meta["sidra_crossbar"]
        key = (use.weight, use.chain, use.transpose, use.groups)
        if key in seen:
            continue
        seen.add(key)
        k, nn = crossbar_shape(n)
        g = tile_grid(k, nn, spec)
        out.append(WeightMapping(names[use.weight], k, nn, g.tiles, k * nn / (g.tiles * spec.cells_per_tile)))
    return MappingReport(tuple(out), chip.tiles_total, chip.tiles_total - chip.tiles_in_use,
                         cells_per_tile=spec.cells_per_tile)


# ---------------------------------------------------------------------------
# 4. pricing


@dataclass(frozen=True)
class OpPrice:
    """One device op of the compiled graph: its profiler name and its price (sidra_core.ops)."""

    name: str
    price: ops.Price


def _rows(v) -> int:
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return 1
    return max(v.numel() // max(v.shape[-1], 1), 1)


def _price_node(n, spec) -> OpPrice | None:
    where = n.meta.get("sidra_where")
    out = _meta(n)
    name = "sidra::" + _short(n.target)
    if where == "crossbar":
        if "sidra_fused" in n.meta:
            parts = [_price_node(m, spec) for m in n.meta["sidra_fused"]]
            return OpPrice("sidra::" + n.target.__name__.removeprefix("sidra_"),
                           ops.fused([p.price for p in parts if p is not None]))
        use = n.meta["sidra_crossbar"]
        k, nn = crossbar_shape(n)
        if use.groups is not None:  # convolution: one MVM row per output position
            rows = out.shape[0] * int(np.prod(out.shape[2:]))
        elif use.arg == 0:  # W @ x: the columns of x are the input vectors
            rows = _meta(n.args[1]).shape[-1]
        else:
            x = _meta(n.args[use.arg - 1])  # mm(x, W), addmm(bias, x, W)
            rows = x.numel() // x.shape[-1]
        return OpPrice(name, ops.mvm(rows, k, nn, spec))
    if where == "engine":
        low = TABLE[n.target]
        if low.kind == "matmul":  # activation x activation: bmm, or mm/addmm of two activations
            a, b = _meta(n.args[-2]), _meta(n.args[-1])
            *batch, m, kk = a.shape
            nb = int(np.prod(np.broadcast_shapes(tuple(batch), tuple(b.shape[:-2])), dtype=np.int64))
            return OpPrice(name, ops.engine_matmul(nb, m, kk, b.shape[-1], spec, bias=n.target is aten.addmm.default))
        if low.engine_op == "attention":  # priced as its ops, as eager charges them
            return OpPrice(name, ops.attention_of(*(_meta(a).shape for a in n.args[:3]), spec))
        first = out if not isinstance(out, tuple) else out[0]
        if low.kind == "engine":
            return OpPrice(name, ops.engine(low.engine_op, _numel(_meta(n.args[0])), spec, _rows(first)))
        numel = max([_numel(first)] + [_numel(_meta(a)) for a in n.args if isinstance(a, fx.Node)])
        return OpPrice(name, ops.elementwise(numel, spec, _rows(first)))
    if where == "memory":
        level = "dram" if any(_weight_of(a) is not None for a in n.args[:2]) else "sram"
        return OpPrice(name, ops.memory(nbytes(out), spec, level))
    return None


def price(gm, spec) -> list[OpPrice]:
    """Every device op of the graph (nodes that run eagerly are priced by eager dispatch)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            p = _price_node(n, spec)
            if p is not None:
                out.append(p)
    return out


def total(prices: list[OpPrice]) -> tuple[Cost, dict]:
    """The graph's cost (pipelined latency, summed energy) and its counters."""
    counts: dict = {}
    for p in prices:
        for k, v in p.price.counts.items():
            counts[k] = counts.get(k, 0) + v
    return (graph_cost.graph_cost([p.price.stage for p in prices]) if prices else ZERO), counts


def eager_latency(prices: list[OpPrice]) -> float:
    """What the same device ops would take one after another (eager order, no pipelining)."""
    return sum(p.price.cost.latency_s for p in prices)


# ---------------------------------------------------------------------------
# 5. segments


@dataclass
class Segment:
    """Consecutive nodes run as one jitted JAX function, or one node run eagerly."""

    nodes: list
    eager: bool
    inputs: list = field(default_factory=list)   # nodes read from outside
    outputs: list = field(default_factory=list)  # nodes read afterwards


def segments(gm) -> list[Segment]:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    segs: list[Segment] = []
    for n in nodes:
        eager = n.meta.get("sidra_where") == "eager"
        if segs and not eager and not segs[-1].eager:
            segs[-1].nodes.append(n)
        else:
            segs.append(Segment([n], eager))
    for s in segs:
        members = set(s.nodes)
        seen = set()
        for n in s.nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in seen:
                    seen.add(a)
                    s.inputs.append(a)
        s.outputs = [n for n in s.nodes if any(u not in members for u in n.users)]
    return segs


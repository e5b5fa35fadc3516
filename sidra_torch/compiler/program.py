"""A compiled graph: the captured aten graph lowered to JAX and run by sidra_jax.

Built once per input signature (shapes, dtypes, non-tensor arguments): the
aten graph is cut into segments, maximal runs of ops with a lowering
(lowering.py) between the ops that run eagerly. Each segment becomes one JAX
function, which sidra_jax's planner places and prices as one compiled graph
(MVM epilogues fused, rows pipelined) and its executor runs as one XLA
program: compiled PyTorch and sidra_jax are one code path. A call runs the
segments and the eager ops between them; each segment's crossbar weights are
programmed at first use, in program order, into the weights' own registry
(shared with eager dispatch), and each MVM draws a fresh noise seed.
"""

from __future__ import annotations

import copy
import operator
import re
import threading
import time
from dataclasses import dataclass, field

import jax
import torch
import torch.fx as fx
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

from sidra_core import Cost, tile_grid
from sidra_core.dlpack import to_jax
from sidra_jax import plan as jplan
from sidra_jax.execute import executor
from sidra_jax.transform import run as run_plan
from sidra_jax.transform import step_records
from sidra_jax.weights import layout_matrix

from .. import runtime
from .. import tensor as _t
from ..dispatch import CHIP_FLOATS, fused_attention
from ..weights import _version, conv_layout, conv_matrix, fresh, held, host_values, matrix, resident, weight_base
from .lowering import TABLE, jnp_dtype
from .mapping import MappingReport, WeightMapping

aten = torch.ops.aten

_CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default


def _cpu_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The CPU's fused attention in the capture: kept whole where eager on sidra:0 runs the engine's
    attention kernel (lowered to the same kernel), else the math formulation eager dispatch sees."""
    if fused_attention(query, key, value, attn_mask, dropout_p):
        return NotImplemented
    return decomposition_table[_CPU_ATTENTION](query, key, value, dropout_p, is_causal, attn_mask=attn_mask,
                                               scale=scale)


# Decompositions applied while capturing (NotImplemented: the op stays whole).
DECOMPOSITIONS = {_CPU_ATTENTION: _cpu_attention}


def weight_names(gm: fx.GraphModule) -> list[str]:
    """Readable names of dynamo's lifted inputs: `L_self_modules_encoder_..._parameters_weight_`
    -> `encoder.....weight`."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        s = re.sub(r"^[lL]_((self|fn)_)?", "", str(n.target)).rstrip("_")
        s = re.sub(r"_(modules|parameters|buffers)_", ".", s)
        out.append(re.sub(r"^(modules|parameters|buffers)_", "", s))
    return out


def float_inputs(gm: fx.GraphModule) -> list[int]:
    """The inputs dynamo made from Python floats it did not specialise (a module's `eps`,
    attention's `scaling`): 0-d tensors that the graph only reads with `.item()`."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(phs) if n.users and all(u.op == "call_method" and u.target == "item"
                                                            for u in n.users)]


def _on_host(gm: fx.GraphModule, floats: dict) -> fx.GraphModule:
    """The dynamo graph with every `device=sidra` (factories, `.to`) pointing at the CPU
    tensors that hold device memory, so it can be traced on them, and the float inputs `floats`
    (placeholder index -> value) specialised to their values, as a plan is to its signature."""
    def host(a):
        if isinstance(a, torch.device) and a.type == _t.DEVICE_TYPE:
            return torch.device("cpu")
        if isinstance(a, str) and a.split(":")[0] == _t.DEVICE_TYPE:
            return "cpu"
        return a

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    phs = [n for n in out.graph.nodes if n.op == "placeholder"]
    for i, value in floats.items():
        for item in list(phs[i].users):
            for u in list(item.users):
                u.args = fx.node.map_arg(u.args, lambda a: value if a is item else a)
                u.kwargs = fx.node.map_arg(u.kwargs, lambda a: value if a is item else a)
            out.graph.erase_node(item)
    for n in out.graph.nodes:
        n.args = fx.node.map_aggregate(n.args, host)
        n.kwargs = fx.node.map_aggregate(n.kwargs, host)
    out.recompile()
    return out


@dataclass
class Segment:
    """Consecutive lowered nodes run as one sidra_jax plan, or one node run eagerly."""

    nodes: list
    eager: bool
    inputs: list = field(default_factory=list)   # nodes read from outside
    outputs: list = field(default_factory=list)  # nodes read afterwards
    leaves: list = field(default_factory=list)   # the inputs the lowered function takes (tensors)
    weights: list = field(default_factory=list)  # which leaves are crossbar weights
    plan: jplan.Plan | None = None


def _lowered(n) -> bool:
    """Whether a node has a device lowering for these arguments (else it runs eagerly)."""
    low = TABLE.get(n.target)
    if low is None or (low.when and not low.when(n)):
        return False
    for a in [*n.args, *n.kwargs.values()]:  # eager dispatch sends float64 / complex work to the host
        for x in a if isinstance(a, (list, tuple)) else [a]:
            v = x.meta.get("val") if isinstance(x, fx.Node) else None
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.dtype not in CHIP_FLOATS:
                return False
    return True


def segments(gm: fx.GraphModule) -> list[Segment]:
    segs: list[Segment] = []
    eager_nodes: set = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        # an eager op's tuple result is taken apart eagerly too (the lowered ops see its tensors)
        eager = not _lowered(n) or (n.target is operator.getitem and n.args[0] in eager_nodes)
        if eager:
            eager_nodes.add(n)
        if segs and not eager and not segs[-1].eager:
            segs[-1].nodes.append(n)
        else:
            segs.append(Segment([n], eager))
    for s in segs:
        members = set(s.nodes)
        for n in s.nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in s.inputs:
                    s.inputs.append(a)
        s.outputs = [n for n in s.nodes if any(u not in members for u in n.users)]
        s.leaves = [a for a in s.inputs if isinstance(a.meta.get("val"), torch.Tensor) and a.op != "get_attr"]
    return segs


def lowered_function(nodes: list, leaves: list, outputs: list, consts: dict):
    """The JAX function of aten nodes through the lowering table: the leaves' values in, the
    outputs' values out (a list); `consts` (node -> value) are closed over."""
    def fn(*vals):
        env = {**consts, **dict(zip(leaves, vals))}
        for n in nodes:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format")}
            env[n] = TABLE[n.target].fn(n, *args, **kwargs)
        return [env[n] for n in outputs]

    return fn


class TorchSlot:
    """A device weight as sidra_jax's planner sees a weight leaf: its crossbar copies by the planner's
    resident keys, kept in the weight's own registry, where eager dispatch finds the same copies."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @staticmethod
    def _layout(key):
        """The weight registry's (layout, matrix_fn) of a sidra_jax resident key."""
        chain, kind = key[0], key[1]
        if not chain and kind == "dot":
            return key[2] == 1, matrix  # contracted on dim 1: the crossbar holds W^T
        if not chain and kind == "conv" and key[2] == tuple(range(len(key[2]))):
            return conv_layout(key[3]), conv_matrix
        return ("jax", key), lambda v, _: layout_matrix(host_values(v), key)

    def fresh(self, key):
        return fresh(runtime.current_chip(), self.tensor, self._layout(key)[0])

    def held(self, key) -> bool:
        return held(runtime.current_chip(), self.tensor, self._layout(key)[0])

    def resident(self, key):
        return resident(runtime.current_chip(), self.tensor, *self._layout(key))


class Plan:
    """One input signature's segments, each lowered to a sidra_jax plan."""

    def __init__(self, gm: fx.GraphModule, args: list, names: list[str]):
        chip = runtime.current_chip()
        self.spec = chip.spec
        plain = [host_value(a) for a in args]
        # A fresh fake mode with these concrete shapes, not dynamo's symbolic one: a plan
        # is specialised to its signature.
        with torch.no_grad(), torch._guards.tracing(None):
            floats = {i: args[i].item() for i in float_inputs(gm)}
            self.graph = make_fx(_on_host(gm, floats), tracing_mode="fake", decomposition_table=DECOMPOSITIONS)(*plain)
        self.placeholders = [n for n in self.graph.graph.nodes if n.op == "placeholder"]
        index = {n: i for i, n in enumerate(self.placeholders)}
        weights = {n for n, a in zip(self.placeholders, args) if isinstance(a, _t.SidraTensor) and weight_base(a) is not None}
        # Constants the trace captured (e.g. a masking value), and the non-tensor arguments of this signature.
        self.constants = {n: _to_jax_tree(getattr(self.graph, n.target))
                          for n in self.graph.graph.nodes if n.op == "get_attr"}
        self.constants.update({n: a for n, a in zip(self.placeholders, args) if not isinstance(a, torch.Tensor)})
        self.output = next(n for n in self.graph.graph.nodes if n.op == "output")
        self.segments = segments(self.graph)
        for seg in self.segments:
            if not seg.eager:
                seg.plan = self._lower(seg, weights)
        lowered = [s.plan for s in self.segments if s.plan is not None]
        self.cost = sum((p.total for p in lowered), Cost(0.0))
        self.counts: dict = {}
        for p in lowered:
            for k, v in p.counts.items():
                self.counts[k] = self.counts.get(k, 0) + v
        self.fused = sum(p.fused for p in lowered)
        # each crossbar weight once: (placeholder index, resident key) -> K x N
        self.crossbar = {}
        for seg in self.segments:
            for w in seg.plan.wrefs if seg.plan is not None else ():
                self.crossbar.setdefault((index[seg.leaves[w.leaf]], w.key), (w.k, w.n))
        self.mapping = _mapping(self.crossbar, names, chip)
        self._lock = threading.RLock()
        self._slots: dict = {}   # placeholder -> TorchSlot of the weight it holds
        self._arrays: dict = {}  # placeholder -> (weight, version, jax array)

    def _lower(self, seg: Segment, weights: set) -> jplan.Plan:
        """The segment as a JAX function of its leaves, planned by sidra_jax as one compiled graph."""
        consts = {a: self.constants[a] for a in seg.inputs if a not in seg.leaves}
        fn = lowered_function(seg.nodes, seg.leaves, seg.outputs, consts)
        structs = [jax.ShapeDtypeStruct(tuple(n.meta["val"].shape), jnp_dtype(n.meta["val"].dtype)) for n in seg.leaves]
        closed = jax.make_jaxpr(fn)(*structs)
        seg.weights = [n in weights for n in seg.leaves]
        plan = jplan.build(closed, self.spec, seg.weights, [True] * len(seg.leaves), transfers=False, graph=True)
        plan.executor = executor(plan, self.spec)
        return plan

    # -- running ------------------------------------------------------------------

    def _slot(self, node, w):
        hit = self._slots.get(node)
        if hit is None or hit.tensor is not w:
            hit = self._slots[node] = TorchSlot(w)
        return hit

    def _check_fits(self, chip, args) -> None:
        """Like eager's whole-model check: refuse before programming anything that cannot fit."""
        pending = []
        for (i, key), shape in self.crossbar.items():
            if not self._slot(self.placeholders[i], args[i]).held(key):
                pending.append(shape)
        if pending:
            chip.check_fits(pending, name=f"compiled graph ({len(pending)} crossbar weights)")

    def run(self, args: list):
        chip = runtime.current_chip()
        self._check_fits(chip, args)
        env: dict = dict(self.constants)
        env.update((ph, a) for ph, a in zip(self.placeholders, args) if isinstance(a, torch.Tensor))
        prof = _t.observer.__self__ if _t.observer is not None else None
        for seg in self.segments:
            if seg.eager:  # (a crossbar op placed eager programs and draws its seed as it runs)
                n = seg.nodes[0]
                env[n] = _eager(n, env)
                continue
            t0 = time.perf_counter()
            values = [self._jax_input(n, env) for n in seg.leaves]
            slots = [self._slot(n, env[n]) if w else None for n, w in zip(seg.leaves, seg.weights)]
            outs, _, start = run_plan(seg.plan, slots, values, chip, "compiled graph", self._lock)
            env.update(zip(seg.outputs, outs))
            if prof is not None:
                jax.block_until_ready(outs)
                prof.records.extend(step_records(seg.plan, start, chip.clock.background_w, time.perf_counter() - t0))
        return fx.node.map_arg(self.output.args[0], lambda n: _to_torch(env[n], n))

    def _jax_input(self, node, env):
        v = env[node]
        if isinstance(v, jax.Array):
            return v
        base = weight_base(v) if node.op == "placeholder" and isinstance(v, _t.SidraTensor) else None
        if base is not None:  # a weight: converted once per version
            ver = _version(base)
            hit = self._arrays.get(node)
            if hit is None or hit[0] is not v or hit[1] != ver:
                self._arrays[node] = hit = (v, ver, _to_jax(v))
            return hit[2]
        return _to_jax_tree(v)


def _mapping(crossbar: dict, names: list[str], chip) -> MappingReport:
    spec, out = chip.spec, []
    for (i, _), (k, n) in crossbar.items():
        g = tile_grid(k, n, spec)
        out.append(WeightMapping(names[i], k, n, g.tiles, k * n / (g.tiles * spec.cells_per_tile)))
    return MappingReport(tuple(out), chip.tiles_total, chip.tiles_total - chip.tiles_in_use,
                         cells_per_tile=spec.cells_per_tile)


def _eager(n, env):
    """An op without a lowering: run it on sidra tensors through eager dispatch."""
    args = fx.node.map_arg(n.args, lambda a: _to_torch(env[a], a))
    kwargs = fx.node.map_arg(n.kwargs, lambda a: _to_torch(env[a], a))
    return n.target(*args, **kwargs)


def host_value(v):
    """A value as the host holds it: a sidra tensor's own CPU tensor (aliased, no transfer), anything
    else as it is."""
    return _t.unwrap(v) if isinstance(v, _t.SidraTensor) else v


def _to_jax(t: torch.Tensor):
    inner = host_value(t)
    if inner.dtype == torch.int64:
        inner = inner.to(torch.int32)
    elif inner.dtype == torch.float64:
        inner = inner.to(torch.float32)
    return to_jax(inner.detach().contiguous())


def _to_jax_tree(v):
    if isinstance(v, torch.Tensor):
        return _to_jax(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_to_jax_tree(x) for x in v)
    return v


def _to_torch(v, node):
    if not isinstance(v, jax.Array):
        return v
    out = torch.from_dlpack(v)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and out.dtype != val.dtype:
        out = out.to(val.dtype)
    _t.track_new(out)
    return _t._wrap(out)


class CompiledGraph:
    """What the `sidra` backend returns for one dynamo graph: plans per input signature, or, for a
    graph with dynamic sizes, eager dispatch, whose kernels run at row buckets (sidra_core.buckets)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list):
        self.gm = gm
        self.names = weight_names(gm)
        self.plans: dict = {}
        self.floats = float_inputs(gm)
        # Dynamo makes a size dynamic once it has seen two; a plan is one XLA program per concrete
        # shape, so such a graph runs op by op instead, each op's kernel at its rows' bucket: a
        # new length reuses the kernels (a plan cannot pad: its ops are not all row-wise).
        self.dynamic = any(_symbolic(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder")
        # The module's parameters and buffers dynamo lifted are weights (stored tensors), as eager's
        # module hooks name them, whether or not the module has run eagerly.
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        for a, name, target in zip(example_inputs, self.names, targets):
            lifted = "_parameters_" in target or "_buffers_" in target
            if isinstance(a, _t.SidraTensor) and (weight_base(a) is a or (lifted and weight_base(a) is None)):
                a.__dict__.setdefault("_sidra_weight", name)
        # capture and check now, so errors surface at compile time (dynamo passes the sizes and
        # scalars it made dynamic as symbols: their example values specialise this first plan)
        self.plan([a.node.hint if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) else a
                   for a in example_inputs])

    def plan(self, args) -> Plan:
        # a plan is lowered for one chip (its precision, converters, noise) and one input signature
        key = (runtime.current_chip().spec,
               *((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args),
               *(args[i].item() for i in self.floats))
        p = self.plans.get(key)
        if p is None:
            p = self.plans[key] = Plan(self.gm, list(args), self.names)
        return p

    @runtime.on_one_torch_thread
    def __call__(self, *args):
        if self.dynamic or (torch.is_grad_enabled()
                            and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            # Dynamic sizes, or training: eager dispatch (bucketed kernels; autograd records
            # straight-through gradients on the host).
            return self.gm(*args)
        return self.plan(args).run(list(args))


def _symbolic(v) -> bool:
    """Whether a placeholder's example value is a symbol or a tensor with a symbolic size."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)

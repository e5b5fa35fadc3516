"""A compiled graph: the captured aten graph after the passes, lowered to jitted JAX.

Built once per input signature (shapes, dtypes, non-tensor arguments); a
repeated signature reuses the plan and its XLA executables. Each call
resolves the programmed copy of every crossbar weight in program order
(programming or reprogramming it exactly when eager would, consuming the
same noise seeds), runs the JAX segments and the eager nodes between them,
and charges the device clock once with the graph's pipelined cost.
"""

from __future__ import annotations

import copy
import re
import time

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

from sidra_core import host
from sidra_core.conv import weight_matrix as conv_weight_matrix
from sidra_core.dlpack import to_jax
from sidra_core.report import OpRecord

from .. import runtime
from ..dispatch import fused_attention
from .. import tensor as _t
from ..weights import _version, programmed_on, resident, weight_base
from . import passes
from .lowering import TABLE

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


def _on_host(gm: fx.GraphModule) -> fx.GraphModule:
    """The dynamo graph with every `device=sidra` (factories, `.to`) pointing at the CPU
    tensors that hold device memory, so it can be traced on them."""
    def host(a):
        if isinstance(a, torch.device) and a.type == _t.DEVICE_TYPE:
            return torch.device("cpu")
        if isinstance(a, str) and a.split(":")[0] == _t.DEVICE_TYPE:
            return "cpu"
        return a

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for n in out.graph.nodes:
        n.args = fx.node.map_aggregate(n.args, host)
        n.kwargs = fx.node.map_aggregate(n.kwargs, host)
    out.recompile()
    return out


class Plan:
    """One input signature's lowered program."""

    def __init__(self, gm: fx.GraphModule, args: list, names: list[str]):
        chip = runtime.current_chip()
        self.spec = chip.spec
        plain = [_t.unwrap(a) if isinstance(a, _t.SidraTensor) else a for a in args]
        is_weight = [isinstance(a, _t.SidraTensor) and weight_base(a) is not None for a in args]
        # A fresh fake mode with these concrete shapes, not dynamo's symbolic one: a plan
        # is specialised to its signature.
        with torch.no_grad(), torch._guards.tracing(None):
            self.graph = make_fx(_on_host(gm), tracing_mode="fake", decomposition_table=DECOMPOSITIONS)(*plain)
        passes.place(self.graph, is_weight)
        self.fused = passes.fuse(self.graph)
        self.mapping = passes.crossbar_mapping(self.graph, names, chip)
        self.prices = passes.price(self.graph, self.spec)
        self.cost, self.counts = passes.total(self.prices)
        self.crossbar = passes.crossbar_nodes(self.graph)
        self._xbar_index = {n: i for i, n in enumerate(self.crossbar)}
        self.segments = passes.segments(self.graph)
        self.placeholders = [n for n in self.graph.graph.nodes if n.op == "placeholder"]
        # Constants the trace captured (e.g. a masking value): on the device once, as jax arrays.
        self.constants = {n: _to_jax_tree(getattr(self.graph, n.target))
                          for n in self.graph.graph.nodes if n.op == "get_attr"}
        self.output = next(n for n in self.graph.graph.nodes if n.op == "output")
        self._dead = _weight_operands_only(self.graph)
        self._fns = [None if s.eager else self._jit(s) for s in self.segments]
        self._views: dict = {}   # (input index, chain) -> (weight object, its view)
        self._arrays: dict = {}  # placeholder -> (version, jax array) of weights read as data

    # -- lowering ---------------------------------------------------------------

    def _jit(self, seg: passes.Segment):
        inputs = [a for a in seg.inputs if a not in self._dead]
        xbars = sorted({self._xbar_index[m] for n in seg.nodes for m in passes.crossbars_in(n)
                        if m in self._xbar_index})
        local = {x: i for i, x in enumerate(xbars)}
        spec, index = self.spec, self._xbar_index
        nodes = [n for n in seg.nodes if n not in self._dead]

        def fn(acts, snaps, seeds):
            ctx = _Ctx(spec, index, local, snaps, seeds)
            env = dict(zip(inputs, acts))
            for n in nodes:
                env[n] = ctx.run(n, env)
            return tuple(env[n] for n in seg.outputs if n not in self._dead)

        seg.live_inputs = inputs
        seg.xbars = xbars
        return jax.jit(fn, compiler_options=host.XLA_COMPILER_OPTIONS)

    # -- running ------------------------------------------------------------------

    def _check_fits(self, chip, args) -> None:
        """Like eager's whole-model check: refuse before programming anything that cannot fit."""
        pending, seen = [], set()
        for n in self.crossbar:
            use = n.meta["sidra_crossbar"]
            base = weight_base(args[use.weight])
            if id(base) not in seen and not programmed_on(base, chip):
                seen.add(id(base))
                pending.append(passes.crossbar_shape(n))
        if pending:
            chip.check_fits(pending, name=f"compiled graph ({len(pending)} crossbar weights)")

    def run(self, args: list):
        chip = runtime.current_chip()
        t0 = time.perf_counter()
        self._check_fits(chip, args)
        env: dict = dict(self.constants)
        for ph, a in zip(self.placeholders, args):
            env[ph] = a
        start = chip.clock.now
        for seg, fn in zip(self.segments, self._fns):
            if seg.eager:  # (a crossbar op placed eager programs and draws its seed as it runs)
                n = seg.nodes[0]
                env[n] = _eager(n, env)
                continue
            snaps, seeds = [], []
            for i in seg.xbars:  # eager's order: program on first use, then this read's seed
                res = self._resident(chip, args, self.crossbar[i].meta["sidra_crossbar"])
                snaps.append(chip.snapshot(res))
                seeds.append(chip.next_seed())
            acts = tuple(self._jax_input(a, env, args) for a in seg.live_inputs)
            outs = fn(acts, tuple(snaps), jnp.asarray(seeds, jnp.uint32))
            for n, v in zip([o for o in seg.outputs if o not in self._dead], outs):
                env[n] = v
        result = fx.node.map_arg(self.output.args[0], lambda n: _to_torch(env[n], n))
        chip.clock.charge(self.cost, **self.counts)
        if _t.observer is not None:
            self._record(_t.observer.__self__, start, time.perf_counter() - t0)
        return result

    def _resident(self, chip, args, use: passes.CrossbarUse):
        key = (use.weight, use.chain)
        w = args[use.weight]
        hit = self._views.get(key)
        if hit is None or hit[0] is not w:
            view = w
            for target, vargs, vkw in use.chain:
                view = target(view, *vargs, **dict(vkw))
            self._views[key] = hit = (w, view)
        view = hit[1]
        if use.groups is not None:
            groups = use.groups
            return resident(chip, view, False, matrix_fn=lambda v, _: conv_weight_matrix(
                v._inner.detach().to(torch.float32).numpy(), groups))
        return resident(chip, view, use.transpose)

    def _jax_input(self, node, env, args):
        v = env[node]
        if isinstance(v, jax.Array):
            return v
        base = weight_base(v) if node.op == "placeholder" and isinstance(v, _t.SidraTensor) else None
        if base is not None:  # a weight read as data: converted once per version
            ver = _version(base)
            hit = self._arrays.get(node)
            if hit is None or hit[0] != ver:
                self._arrays[node] = hit = (ver, _to_jax(v))
            return hit[1]
        return _to_jax_tree(v)

    def _record(self, prof, start: float, host_s: float) -> None:
        """Profiler rows: one per device op, the graph's pipelined latency shared by their eager latencies."""
        eager = passes.eager_latency(self.prices) or 1.0
        k = self.cost.latency_s / eager
        watts = runtime.current_chip().clock.background_w
        t = start
        for p in self.prices:
            c = p.price.cost
            share = c.latency_s / eager
            c = type(c)(c.latency_s * k, *c.energies).with_background(watts)
            prof.records.append(OpRecord(p.name, p.price.where, c, 0, host_s * share, t))
            t += c.latency_s


class _Ctx:
    """What a lowering sees while the segment is traced."""

    def __init__(self, spec, index, local, snaps, seeds):
        self.spec, self._index, self._local, self._snaps, self._seeds = spec, index, local, snaps, seeds

    def crossbar(self, node):
        i = self._local[self._index[node]]
        return self._snaps[i], self._seeds[i]

    def weight_side(self, node):
        use = node.meta.get("sidra_crossbar")
        return None if use is None else use.arg

    def run(self, n, env):
        if isinstance(n.target, passes.FusedOp):
            sub = dict(zip([p for p in n.target.graph.nodes if p.op == "placeholder"],
                           [env.get(a) if isinstance(a, fx.Node) else a for a in n.args]))
            last = None
            for m in n.target.graph.nodes:
                if m.op == "call_function":
                    sub[m] = last = self.run(m, sub)
            return last
        args = fx.node.map_arg(n.args, lambda a: env.get(a))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env.get(a))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format")}
        return TABLE[n.target].fn(self, n, *args, **kwargs)


def _weight_operands_only(gm) -> set:
    """Nodes whose values nothing needs: views of weights read only as crossbar operands
    (the crossbar reads its programmed tiles, not the tensor)."""
    dead: set = set()
    for n in reversed(list(gm.graph.nodes)):
        if n.op not in ("call_function", "placeholder") or "sidra_weight" not in n.meta:
            continue
        if n.users and all(_reads_as_operand(u, n) or u in dead for u in n.users):
            dead.add(n)
    return dead


def _reads_as_operand(user, n) -> bool:
    inner = user.meta.get("sidra_fused")
    if inner is not None:
        i = user.args.index(n)
        ph = [p for p in user.target.graph.nodes if p.op == "placeholder"][i]
        return all(_reads_as_operand(u, ph) for u in ph.users)
    use = user.meta.get("sidra_crossbar")
    return use is not None and user.args[use.arg] is n and not any(
        a is n for j, a in enumerate(user.args) if j != use.arg)


def _eager(n, env):
    """An op without a lowering: run it on sidra tensors through eager dispatch."""
    args = fx.node.map_arg(n.args, lambda a: _to_torch(env[a], a))
    kwargs = fx.node.map_arg(n.kwargs, lambda a: _to_torch(env[a], a))
    return n.target(*args, **kwargs)


def _to_jax(t: torch.Tensor):
    inner = _t.unwrap(t) if isinstance(t, _t.SidraTensor) else t
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
        # Dynamo makes a size dynamic once it has seen two; a plan is one XLA program per concrete
        # shape, so such a graph runs op by op instead, each op's kernel at its rows' bucket: a
        # new length reuses the kernels (a plan cannot pad: its ops are not all row-wise).
        self.dynamic = any(_symbolic(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder")
        for a, name in zip(example_inputs, self.names):
            if isinstance(a, _t.SidraTensor) and weight_base(a) is a:
                a.__dict__.setdefault("_sidra_weight", name)
        # capture and check now, so errors surface at compile time (dynamo passes the sizes and
        # scalars it made dynamic as symbols: their example values specialise this first plan)
        self.plan([a.node.hint if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) else a
                   for a in example_inputs])

    def plan(self, args) -> Plan:
        # a plan is lowered for one chip (its precision, converters, noise) and one input signature
        key = (runtime.current_chip().spec,
               *((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
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

"""From a jaxpr to a device plan: every equation placed (crossbar, engine, memory, host, free) and priced.

`build(closed_jaxpr, ...)` walks the jaxpr once, in order, inlining calls
(`jit`, `custom_jvp_call`, `custom_vjp_call`, `closed_call`, `remat`), and
emits a flat list of `Instr`. Each primitive's unit comes from
`sidra_core.placement` (the table sidra_torch's dispatch reads for aten ops):

- crossbar: `dot_general` with one operand a marked 2-D weight (or a view of
  one: transpose, cast, reshape) and one contracting dimension; a following
  `add` of a bias along the output features is fused into the MVM, as
  sidra_torch's `addmm`/`linear`; `conv_general_dilated` with a marked kernel;
- engine: activation x activation `dot_general` (INT8 MACs), `sidra_jax.nn`
  ops, `jax.nn.relu`/`silu`, `tanh`, `logistic`, and element-wise arithmetic,
  comparisons and reductions (rounded to the engine precision);
- memory: gathers, scatters, concatenation, padding, dynamic slices, iota;
- free: reshapes, transposes, broadcasts, slices, casts (views);
- host: everything else (pooling windows, sorting, control flow, RNG):
  computed exactly, paying the host link both ways, as sidra_torch's fallback.

Prices are static: `sidra_core.ops` of the jaxpr's shapes, as the chip charges them. The plan is built
once per input signature; executing it is `execute.run` under `jax.jit`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from sidra_core import graph_cost, ops, placement
from sidra_core.cost import ZERO, Cost
from sidra_core.spec import ChipSpec

from . import nn as _nn
from .weights import ViewOp, conv_key, dot_key, dot_nd_key

# ---------------------------------------------------------------------------
# Primitives that are calls: their bodies are planned inline.
CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call",
         "custom_vjp_call_jaxpr", "custom_lin"}


@dataclass(frozen=True)
class Lit:
    """A literal operand (a constant folded into the jaxpr)."""

    val: object


@dataclass
class WeightRef:
    """A crossbar copy an instruction needs: which argument leaf, and how it is presented."""

    leaf: int
    key: tuple
    k: int
    n: int


@dataclass
class Instr:
    kind: str  # bind | elementwise | engine_op | marked | matmul | mvm | conv | memory | host
    name: str  # profiler row
    where: str | None  # crossbar | engine | memory | host | None (free)
    ins: list
    outs: list
    out_avals: list
    prim: object = None
    params: dict = field(default_factory=dict)
    cost: Cost = ZERO
    counts: dict = field(default_factory=dict)
    price: ops.Price | None = None  # what the chip charges for it (None: free)
    meta: dict = field(default_factory=dict)
    wref: int | None = None  # index into Plan.wrefs
    seed: int | None = None  # index into the call's seed vector


@dataclass
class Plan:
    """The device plan of one function signature: its instructions, crossbar weights and prices.

    Attributes:
        in_refs: The refs of the call's flattened argument leaves.
        out_refs: The refs (or literals) of its flattened outputs.
        const_refs: The refs of the jaxpr's constants.
        consts: Their values.
        instrs: The instructions (Instr), in program order.
        wrefs: The crossbar copies the instructions need (WeightRef), in first-use order.
        n_seeds: Noise seeds a call draws: one per MVM, in program order.
        steps: The priced steps (instructions and host transfers) in device order, for charging
            and the profiler.
        total: One call's cost (without background power).
        counts: One call's counters (mvms, engine_ops, ...).
        spec: The chip it was planned for.
        out_tree: The outputs' pytree structure.
        fused_bias: Biases fused into their MVMs.
        fused: MVMs fused with their epilogue (graph pricing).
        graph: Priced as one pipelined graph (sidra_core.graph_cost), as torch.compile prices.
        executor: The compiled program that runs the plan (sidra_jax.execute.executor).
        avals: Each ref's shape and dtype.
    """

    in_refs: list
    out_refs: list
    const_refs: list
    consts: list
    instrs: list
    wrefs: list
    n_seeds: int
    steps: list
    total: Cost
    counts: dict
    spec: ChipSpec
    out_tree: object = None
    fused_bias: int = 0
    fused: int = 0
    graph: bool = False
    executor: object = None
    avals: dict = field(default_factory=dict)

    def crossbar_weights(self) -> list[tuple[int, int, int]]:
        return [(w.leaf, w.k, w.n) for w in self.wrefs]


@dataclass
class Transfer:
    """A host-link transfer of one input or output array (when the call charges them)."""

    name: str
    price: ops.Price  # ops.host_transfer of the array's bytes
    where: str = "host"
    wref: None = None
    seed: None = None

    @property
    def cost(self) -> Cost:
        return self.price.cost

    @property
    def counts(self):
        return self.price.counts


def _numel(aval) -> int:
    return int(math.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _nbytes(aval) -> int:
    try:
        return _numel(aval) * np.dtype(aval.dtype).itemsize
    except TypeError:  # tokens, keys
        return 0


def _rows(aval) -> int:
    """The rows an op streams in a pipelined graph: its result's vectors along the last axis."""
    shape = getattr(aval, "shape", ())
    return max(_numel(aval) // max(int(shape[-1]), 1), 1) if shape else 1


def _is_float(aval) -> bool:
    """A float array the chip computes in (float64, with JAX's x64 on, goes to the host)."""
    return getattr(getattr(aval, "dtype", None), "name", None) in placement.CHIP_FLOATS


class _Builder:
    def __init__(self, spec: ChipSpec, leaf_is_weight: list[bool]):
        self.spec = spec
        self.instrs: list[Instr] = []
        self.avals: dict = {}
        self.origin: dict = {}  # ref -> (leaf index, chain of ViewOps)
        self.consts: list = []
        self.const_refs: list = []
        self._next = 0
        self.leaf_is_weight = leaf_is_weight
        self.warned: set = set()

    # -- refs ------------------------------------------------------------------

    def new(self, aval) -> int:
        r = self._next
        self._next += 1
        self.avals[r] = aval
        return r

    def aval(self, ref):
        if isinstance(ref, Lit):
            v = ref.val
            return _LitAval(np.shape(v), jnp.result_type(v))
        return self.avals[ref]

    def const(self, value) -> int:
        r = self.new(_LitAval(np.shape(value), jnp.result_type(value)))
        self.consts.append(value)
        self.const_refs.append(r)
        return r

    # -- walk ------------------------------------------------------------------

    def walk(self, jaxpr, consts, in_refs) -> list:
        env = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.const(c)
        for v, r in zip(jaxpr.invars, in_refs):
            env[v] = r

        def read(a):
            return Lit(a.val) if isinstance(a, Literal) else env[a]

        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, r in zip(eqn.outvars, outs):
                env[v] = r
        return [read(a) for a in jaxpr.outvars]

    def _emit(self, kind, name, eqn, ins, price: ops.Price | None = None, **kw) -> list:
        """One instruction; `price` None for a free op (views, metadata)."""
        outs = [self.new(v.aval) for v in eqn.outvars]
        if price is None:
            kw["where"] = None
        else:
            kw.update(where=price.where, cost=price.cost, counts=dict(price.counts), price=price)
        ins_ = Instr(kind=kind, name=name, ins=list(ins), outs=outs,
                     out_avals=[v.aval for v in eqn.outvars], prim=eqn.primitive, params=dict(eqn.params), **kw)
        self.instrs.append(ins_)
        return outs

    def _crossbar(self, kind, name, eqn, ins, meta: dict, rows: int, k: int, n: int) -> list:
        """An MVM of `rows` inputs through a K x N crossbar weight, priced and counted."""
        return self._emit(kind, name, eqn, ins, ops.mvm(rows, k, n, self.spec), meta=meta)

    def eqn(self, eqn, ins) -> list:
        name = eqn.primitive.name
        p = eqn.params
        if name in CALLS:
            return self.call(eqn, ins)
        if name == "dot_general":
            return self.dot(eqn, ins)
        if name == "conv_general_dilated":
            return self.conv(eqn, ins)
        unit = placement.jax_unit(name)
        if unit == "free":
            outs = self._emit("bind", "sidra::" + name, eqn, ins)
            src = ins[0] if ins else None
            if (name in placement.JAX_WEIGHT_VIEWS and not isinstance(src, Lit) and src in self.origin
                    and len(outs) == 1):
                leaf, chain = self.origin[src]
                self.origin[outs[0]] = (leaf, chain + (ViewOp(eqn.primitive, p),))
            return outs
        if unit == "engine":
            op = placement.JAX_ENGINE[name]
            return self._emit("engine_op", "sidra::" + op, eqn, ins, self._engine(op, eqn, ins), meta={"op": op})
        if unit == "elementwise":
            return self._emit("elementwise", "sidra::" + name, eqn, ins, self._elementwise(eqn, ins))
        if unit == "memory":
            return self._emit("memory", "sidra::" + name, eqn, ins, self._memory(eqn, ins))
        return self.host(eqn, ins)

    def _engine(self, op, eqn, ins) -> ops.Price:
        return ops.engine(op, _numel(self.aval(ins[0])), self.spec, _rows(eqn.outvars[0].aval))

    def _elementwise(self, eqn, ins) -> ops.Price:
        numel = max([_numel(v.aval) for v in eqn.outvars] + [_numel(self.aval(r)) for r in ins])
        return ops.elementwise(numel, self.spec, _rows(eqn.outvars[0].aval))

    def _memory(self, eqn, ins) -> ops.Price:
        """Stored tensors (a weight's rows: an embedding) move in DRAM, activations in SRAM."""
        level = "dram" if any(self._weight(r) is not None for r in ins) else "sram"
        return ops.memory(sum(_nbytes(v.aval) for v in eqn.outvars), self.spec, level)

    def host(self, eqn, ins, name=None) -> list:
        if eqn.primitive.name in ("scan", "while", "cond") and eqn.primitive.name not in self.warned:
            self.warned.add(eqn.primitive.name)
            warnings.warn(f"lax.{eqn.primitive.name} runs on the host, exactly (its body is not mapped onto the "
                          f"chip); unroll it with a Python loop to run its matmuls on the crossbars",
                          stacklevel=2)
        nbytes = sum(_nbytes(self.aval(r)) for r in ins) + sum(_nbytes(v.aval) for v in eqn.outvars)
        return self._emit("bind", name or "sidra::" + eqn.primitive.name, eqn, ins, ops.host_fallback(nbytes, self.spec))

    # -- calls -------------------------------------------------------------------

    def call(self, eqn, ins) -> list:
        name = eqn.primitive.name
        p = eqn.params
        fname = _call_name(eqn)
        if name in ("pjit", "jit") and fname in _nn.REGISTRY:
            op, kw = _nn.REGISTRY[fname]
            if op == "elementwise":  # an aten element-wise op whole (sidra_jax.nn.device_op)
                return self._emit("elementwise", "sidra::" + kw["name"], eqn, ins, self._elementwise(eqn, ins))
            if op == "memory":
                return self._emit("memory", "sidra::" + kw["name"], eqn, ins, self._memory(eqn, ins))
            if op == "attention":  # priced as sidra_torch prices scaled_dot_product_attention: its 4 ops
                q, k, v = (tuple(self.aval(r).shape) for r in ins[:3])
                if kw.get("layout", "bshd") == "bshd":  # as (batch, heads, seq, dim)
                    q, k, v = ((*t[:-3], t[-2], t[-3], t[-1]) for t in (q, k, v))
                price = ops.attention_of(q, k, v, self.spec)
            else:
                price = self._engine(op, eqn, ins)
            return self._emit("marked", "sidra::" + op.replace("gelu_tanh", "gelu"), eqn, ins, price,
                              meta={"op": op, "kw": kw})
        if name in ("pjit", "jit", "custom_jvp_call") and fname in placement.JAX_ENGINE_CALLS and len(ins) == 1 \
                and len(eqn.outvars) == 1 and _is_float(self.aval(ins[0])) and _from_jax_nn(eqn):
            op = placement.JAX_ENGINE_CALLS[fname]
            # executed as the engine's op; its straight-through backward binds this very call (and so
            # keeps jax.nn.relu's own derivative rule, 0 at 0)
            return self._emit("engine_op", "sidra::" + op, eqn, ins, self._engine(op, eqn, ins), meta={"op": op})
        if name in ("pjit", "jit"):
            sub = p["jaxpr"]
        elif name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "closed_call", "core_call"):
            sub = p.get("call_jaxpr") or p.get("fun_jaxpr")
        elif name in ("remat", "checkpoint"):
            sub = p["jaxpr"]
        else:
            return self.host(eqn, ins)
        if sub is None:
            return self.host(eqn, ins)
        if hasattr(sub, "jaxpr"):  # ClosedJaxpr
            return self.walk(sub.jaxpr, sub.consts, ins)
        return self.walk(sub, (), ins)

    # -- matmuls -------------------------------------------------------------------

    def _weight(self, ref):
        if isinstance(ref, Lit):
            return None
        o = self.origin.get(ref)
        if o is None or not self.leaf_is_weight[o[0]]:
            return None
        return o

    def dot(self, eqn, ins) -> list:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        la, ra = self.aval(ins[0]), self.aval(ins[1])
        wl, wr = self._weight(ins[0]), self._weight(ins[1])
        out_aval = eqn.outvars[0].aval
        side = None
        if placement.matmul(wl is not None, wr is not None) == "crossbar":
            side = 1 if wr is not None else 0
        if side is not None:
            w_aval, x_aval = (ra, la) if side == 1 else (la, ra)
            wc, xc = (rc, lc) if side == 1 else (lc, rc)
            wb = rb if side == 1 else lb
            if (len(w_aval.shape) == 2 and not wb and len(wc) == 1 and _is_float(w_aval) and _is_float(x_aval)
                    and _is_float(out_aval)):
                leaf, chain = wr if side == 1 else wl
                cdim = int(wc[0])
                # W.T contracted on dim 0 is W contracted on dim 1: one crossbar copy for both.
                while chain and chain[-1].prim.name == "transpose" and tuple(chain[-1].params["permutation"]) == (1, 0):
                    chain, cdim = chain[:-1], 1 - cdim
                k = int(w_aval.shape[wc[0]])
                n = int(w_aval.shape[1 - wc[0]])
                rows = _numel(x_aval) // max(k, 1)
                wref = WeightRef(leaf, dot_key(chain, cdim), k, n)
                return self._crossbar("mvm", "sidra::linear", eqn, ins,
                                      {"side": side, "xc": int(xc[0]), "wref": wref, "feature_axis":
                                       len(out_aval.shape) - 1 if side == 1 else 0, "n": n}, rows, k, n)
            if not wb and wc and _is_float(w_aval) and _is_float(x_aval) and _is_float(out_aval):
                # an N-d weight (Flax DenseGeneral: attention's per-head projections) as a matrix
                leaf, chain = wr if side == 1 else wl
                free = tuple(d for d in range(len(w_aval.shape)) if d not in wc)
                k = math.prod(int(w_aval.shape[d]) for d in wc)
                n = math.prod(int(w_aval.shape[d]) for d in free)
                rows = _numel(x_aval) // max(k, 1)
                wref = WeightRef(leaf, dot_nd_key(chain, tuple(wc), free), k, n)
                return self._crossbar("mvm", "sidra::linear", eqn, ins,
                                      {"side": side, "xc": tuple(int(d) for d in xc), "wref": wref,
                                       "feature_axis": None, "n": n,
                                       "w_free": tuple(int(w_aval.shape[d]) for d in free)}, rows, k, n)
        # activation x activation, weight x weight, or a weight the crossbar cannot take: the engine
        if not (_is_float(la) and _is_float(ra)):
            numel = max(_numel(out_aval), _numel(la), _numel(ra))
            return self._emit("elementwise", "sidra::dot_general", eqn, ins, ops.elementwise(numel, self.spec))
        nb = math.prod(la.shape[d] for d in lb)
        kk = math.prod(la.shape[d] for d in lc)
        m = math.prod(s for d, s in enumerate(la.shape) if d not in lc and d not in lb)
        n = math.prod(s for d, s in enumerate(ra.shape) if d not in rc and d not in rb)
        return self._emit("matmul", "sidra::matmul", eqn, ins, ops.engine_matmul(int(nb), int(m), int(kk), int(n), self.spec))

    def conv(self, eqn, ins) -> list:
        p = eqn.params
        dn = p["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        w = self._weight(ins[1])
        xa, wa = self.aval(ins[0]), self.aval(ins[1])
        out_aval = eqn.outvars[0].aval
        ok = (w is not None and self._weight(ins[0]) is None
              and p["batch_group_count"] == 1 and _is_float(xa) and _is_float(wa)
              and all(lo >= 0 and hi >= 0 for lo, hi in p["padding"]))
        if not ok:
            return self.host(eqn, ins, name="sidra::conv_general_dilated")
        groups = int(p["feature_group_count"])
        c_out = int(wa.shape[rhs_spec[0]])
        c_in_g = int(wa.shape[rhs_spec[1]])
        ksp = tuple(int(wa.shape[d]) for d in rhs_spec[2:])
        k = c_in_g * groups * math.prod(ksp)
        rows = int(out_aval.shape[out_spec[0]]) * math.prod(int(out_aval.shape[d]) for d in out_spec[2:])
        leaf, chain = w
        wref = WeightRef(leaf, conv_key(chain, rhs_spec, groups), k, c_out)
        return self._crossbar("conv", "sidra::convolution", eqn, ins,
                              {"wref": wref, "lhs_spec": tuple(lhs_spec), "out_spec": tuple(out_spec),
                               "kernel": ksp, "feature_axis": int(out_spec[1]), "n": c_out}, rows, k, c_out)


def _call_name(eqn) -> str | None:
    """The function name of a call equation: jit's `name`, or a jax.nn function's own name
    (custom_jvp calls carry it in their jaxpr's debug info)."""
    p = eqn.params
    if "name" in p and p["name"] in _nn.REGISTRY:
        return p["name"]
    sub = p.get("jaxpr") or p.get("call_jaxpr") or p.get("fun_jaxpr")
    info = getattr(getattr(sub, "jaxpr", sub), "debug_info", None)
    src = getattr(info, "func_src_info", None) or ""
    # e.g. "relu at .../jax/_src/nn/functions.py:71": only jax.nn's own functions are recognised
    if "jax/_src/nn/" in src.replace("\\", "/"):
        return src.split(" ")[0]
    return p.get("name")


def _from_jax_nn(eqn) -> bool:
    p = eqn.params
    sub = p.get("jaxpr") or p.get("call_jaxpr")
    info = getattr(getattr(sub, "jaxpr", sub), "debug_info", None)
    return "jax/_src/nn/" in (getattr(info, "func_src_info", None) or "").replace("\\", "/")


@dataclass(frozen=True)
class _LitAval:
    shape: tuple
    dtype: object


# ---------------------------------------------------------------------------
# Bias fusion: dot/conv on the crossbar, then `add` of a vector along the output features.


_VECTOR_VIEWS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy")


def _bias_source(b: _Builder, defs: dict, ref, out_shape, axis: int):
    """If operand `ref` of the add is a bias along `axis` of `out_shape`, the earliest ref holding its N values."""
    if isinstance(ref, Lit):
        return None
    n = out_shape[axis]

    def vector(shp):  # N values, in order, however shaped
        return math.prod(shp) == n and sum(1 for s in shp if s != 1) <= 1

    shape = tuple(b.aval(ref).shape)
    src = None
    if len(shape) == len(out_shape) and shape[axis] == n and all(s == 1 for i, s in enumerate(shape) if i != axis):
        src = ref
    else:
        d = defs.get(ref)
        if d is not None and d.prim is not None and d.prim.name == "broadcast_in_dim" and d.where is None \
                and not isinstance(d.ins[0], Lit):
            s_shape = tuple(b.aval(d.ins[0]).shape)
            bd = d.params["broadcast_dimensions"]
            if tuple(d.params["shape"]) == tuple(out_shape) and vector(s_shape) and \
                    all(bd[i] == axis for i, s in enumerate(s_shape) if s != 1):
                src = d.ins[0]
    if src is None:
        return None
    # Walk back through views that keep the N values (broadcast of the vector, reshape, cast).
    while True:
        d = defs.get(src)
        if d is None or d.prim is None or d.prim.name not in _VECTOR_VIEWS or d.where is not None \
                or isinstance(d.ins[0], Lit) or not vector(tuple(b.aval(d.ins[0]).shape)) \
                or not _is_float(b.aval(d.ins[0])):
            return src
        src = d.ins[0]


@dataclass
class _Uses:
    """Where each ref of a builder's instructions is defined and used (taken before a pass edits them)."""

    defs: dict     # ref -> the instruction defining it
    index: dict    # id(instruction) -> its position
    users: dict    # ref -> [(instruction, operand position)], one entry per use
    outputs: set   # the refs the function returns

    def only_user(self, r):
        """(instruction, operand position) of r's one use, or None (several, none, or an output)."""
        u = self.users.get(r, ())
        return u[0] if len(u) == 1 and r not in self.outputs else None

    def position(self, r) -> int:
        """The position of r's defining instruction; -1 for an argument or constant."""
        d = None if isinstance(r, Lit) else self.defs.get(r)
        return -1 if d is None else self.index[id(d)]


def _uses(b: _Builder, out_refs: list) -> _Uses:
    u = _Uses({}, {}, {}, {r for r in out_refs if not isinstance(r, Lit)})
    for idx, ins in enumerate(b.instrs):
        u.index[id(ins)] = idx
        for r in ins.outs:
            u.defs[r] = ins
        for pos, r in enumerate(ins.ins):
            if not isinstance(r, Lit):
                u.users.setdefault(r, []).append((ins, pos))
    return u


def _fuse_bias(b: _Builder, out_refs: list) -> int:
    uses = _uses(b, out_refs)
    fused = 0
    drop = set()
    for idx, ins in enumerate(b.instrs):
        if ins.kind not in ("mvm", "conv"):
            continue
        hit = uses.only_user(ins.outs[0])
        if hit is None:
            continue
        add, pos = hit
        if add.prim is None or add.prim.name != "add" or add.kind != "elementwise":
            continue
        other = add.ins[1 - pos]
        out_shape = tuple(add.out_avals[0].shape)
        if out_shape != tuple(ins.out_avals[0].shape) or add.out_avals[0].dtype != ins.out_avals[0].dtype:
            continue
        axis = ins.meta["feature_axis"]
        if axis is None:  # an N-d weight's output: its bias stays an engine add
            continue
        src = _bias_source(b, uses.defs, other, out_shape, axis)
        # The MVM stays where the matmul was: its bias must exist by then.
        if src is None or not _is_float(b.aval(src)) or uses.position(src) >= idx:
            continue
        bshape = [1] * len(out_shape)
        bshape[axis] = out_shape[axis]
        ins.meta.update(bias=src, bias_shape=tuple(bshape), bias_pos=1 - pos, add_params=dict(add.params),
                        add_prim=add.prim)
        ins.ins = ins.ins + [src]
        ins.outs = add.outs
        ins.out_avals = add.out_avals
        drop.add(id(add))
        fused += 1
    if drop:
        b.instrs = [i for i in b.instrs if id(i) not in drop]
    return fused


# ---------------------------------------------------------------------------
# Graph pricing: an MVM and the ops that consume its results as they leave the accumulators.

ACTIVATIONS = {"relu", "gelu", "gelu_tanh", "tanh", "sigmoid", "silu"}


def _activation(ins) -> bool:
    return ins.kind in ("engine_op", "marked") and ins.meta.get("op") in ACTIVATIONS


def _epilogue(head, only_user, defined_after) -> list:
    """The instructions after a crossbar MVM that fuse into it: an activation, then a residual add
    (its other operand ready before the MVM starts), through reshapes between them."""
    chain, cur, stage = [], head, 0  # 0: after the MVM (and its bias), 1: after the activation
    while True:
        nxt = only_user(cur.outs[0]) if len(cur.outs) == 1 else None
        if nxt is None:
            break
        if nxt.kind == "bind" and nxt.where is None and nxt.prim.name == "reshape":
            chain.append(nxt)
        elif _activation(nxt) and stage == 0:
            chain.append(nxt)
            stage = 1
        elif nxt.kind == "elementwise" and nxt.name == "sidra::add" and len(nxt.ins) == 2:
            other = nxt.ins[1] if nxt.ins[0] == cur.outs[0] else nxt.ins[0]
            if defined_after(other, head):
                break
            chain.append(nxt)
            break
        else:
            break
        cur = nxt
    while chain and chain[-1].where is None:  # trailing reshapes stay outside
        chain.pop()
    return chain


def _fuse_epilogues(b: _Builder, out_refs: list) -> int:
    """Each crossbar MVM with its epilogue becomes one device op (sidra_core.ops.fused): the
    epilogue's results stream beside the MVM's; the instructions still run as they are."""
    uses = _uses(b, out_refs)

    def only_user(r):
        hit = uses.only_user(r)
        return None if hit is None else hit[0]

    def defined_after(r, head) -> bool:
        return uses.position(r) > uses.index[id(head)]

    fused = 0
    for head in b.instrs:
        if head.kind not in ("mvm", "conv"):
            continue
        chain = [i for i in _epilogue(head, only_user, defined_after) if i.where is not None]
        if not chain:
            continue
        parts = [head.name.removeprefix("sidra::")] + [i.name.removeprefix("sidra::") for i in chain]
        head.price = ops.fused([head.price] + [i.price for i in chain])
        head.cost, head.counts, head.name = head.price.cost, dict(head.price.counts), "sidra::fused_" + "_".join(parts)
        for i in chain:
            i.where, i.price, i.cost, i.counts = None, None, ZERO, {}
        fused += 1
    return fused


# ---------------------------------------------------------------------------


def build(closed, spec: ChipSpec, leaf_is_weight: list[bool], leaf_resident: list[bool],
          transfers: bool, graph: bool = False) -> Plan:
    """The device plan of a closed jaxpr whose inputs are the call's flattened argument leaves.

    `leaf_is_weight[i]`: leaf i is a crossbar-programmable Weight; `leaf_resident[i]`: it is in device
    memory already (a Weight of either kind); other leaves cross the host link when `transfers`.
    `graph`: price the whole as one compiled graph (MVM epilogues fused, rows pipelined across ops,
    as torch.compile's graphs are priced) instead of op after op, as eager runs them.
    """
    b = _Builder(spec, leaf_is_weight)
    in_refs = [b.new(v.aval) for v in closed.jaxpr.invars]
    for i, r in enumerate(in_refs):
        if leaf_is_weight[i]:
            b.origin[r] = (i, ())
    out_refs = b.walk(closed.jaxpr, closed.consts, in_refs)
    fused = _fuse_bias(b, out_refs)
    epilogues = _fuse_epilogues(b, out_refs) if graph else 0
    # Crossbar copies in first-use order, one seed per MVM in program order.
    wrefs: list[WeightRef] = []
    index: dict = {}
    n_seeds = 0
    for ins in b.instrs:
        if ins.kind in ("mvm", "conv"):
            w = ins.meta["wref"]
            key = (w.leaf, w.key)
            if key not in index:
                index[key] = len(wrefs)
                wrefs.append(w)
            ins.wref = index[key]
            ins.seed = n_seeds
            n_seeds += 1
    steps: list = []
    if transfers:
        for i, v in enumerate(closed.jaxpr.invars):
            if not leaf_resident[i]:
                nb = _nbytes(v.aval)
                steps.append(Transfer("sidra::host_to_device", ops.host_transfer(nb, spec)))
    steps += [i for i in b.instrs if i.where is not None]
    if transfers:
        for r in out_refs:
            nb = _nbytes(b.aval(r))
            steps.append(Transfer("sidra::device_to_host", ops.host_transfer(nb, spec)))
    total = ZERO
    counts: dict = {}
    for s in steps:
        total = total + s.cost
        for k, v in s.counts.items():
            counts[k] = counts.get(k, 0) + int(v)
    if graph and steps:
        total = graph_cost.graph_cost([s.price.stage for s in steps])
    return Plan(in_refs=in_refs, out_refs=out_refs, const_refs=b.const_refs, consts=b.consts, instrs=b.instrs,
                wrefs=wrefs, n_seeds=n_seeds, steps=steps, total=total, counts=counts, spec=spec,
                fused_bias=fused, fused=epilogues, graph=graph, avals=b.avals)

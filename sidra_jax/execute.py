"""Executing a device plan under `jax.jit`: the sidra_core kernels with straight-through gradients.

Every instruction that the chip computes differently from float (crossbar
MVMs, engine ops at reduced precision, INT8 engine matmuls) is wrapped in a
`jax.custom_vjp` whose forward is the device numerics and whose backward is
the vector-Jacobian product of the original primitive: the digital, exact
derivative, evaluated at the device's forward values (straight-through). For
a crossbar MVM that is d/dx = g W^T and d/dW = x^T g of y = x @ W.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import sidra_core
from sidra_core import crossbar, engine, host

from . import nn as _nn
from . import repeats
from .plan import Lit, Plan


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def straight_through(device_fn, exact_fn, xs: tuple, aux=()):
    """device_fn(*xs, aux) forward; backward: VJP of exact_fn(*xs) for the float xs; aux gets none.

    Args:
        device_fn: The forward computation, `device_fn(*xs, aux)` (the chip's kernels).
        exact_fn: The digital, exact function whose VJP is the backward, `exact_fn(*xs)`.
        xs: The differentiable operands (only floating ones get a gradient).
        aux: Further operands of device_fn (seeds, snapshots), with no gradient.

    Returns:
        device_fn's result, differentiable by jax.grad with exact_fn's gradients.
    """
    xs = tuple(xs)
    diff = tuple(i for i, x in enumerate(xs) if _inexact(x))

    @jax.custom_vjp
    def f(xs, aux):
        return device_fn(*xs, aux)

    def fwd(xs, aux):
        return device_fn(*xs, aux), xs

    def bwd(xs, g):
        def exact(*d):
            full = list(xs)
            for i, v in zip(diff, d):
                full[i] = v
            return exact_fn(*full)

        _, vjp = jax.vjp(exact, *[xs[i] for i in diff])
        cts = vjp(g)
        out = [None] * len(xs)
        for i, c in zip(diff, cts):
            out[i] = c
        return tuple(out), None

    f.defvjp(fwd, bwd)
    return f(xs, aux)


def _bind(prim, params, vals):
    """Bind a primitive as jax's own jaxpr evaluator does (call primitives get their sub-functions)."""
    bind_params = prim.get_bind_params(params)
    subfuns = ()
    if isinstance(bind_params, tuple):  # older JAX: (sub-functions, params)
        subfuns, bind_params = bind_params
    out = prim.bind(*subfuns, *vals, **bind_params)
    return list(out) if prim.multiple_results else [out]


def _materialise(y):
    """A crossbar result is computed once (see sidra_core.host.XLA_COMPILER_OPTIONS), not re-derived inside its consumers."""
    return jax.lax.optimization_barrier(y) if BARRIER_OUTPUTS else y


BARRIER_OUTPUTS = True


def _cast(y, aval):
    return y if y.dtype == aval.dtype else y.astype(aval.dtype)


def _storage(precision: str):
    """The engine's storage of element-wise results (sidra_core.engine.store); None at float32."""
    if engine.STORAGE[precision] == "float32":
        return None
    return partial(engine.store, precision=precision)


def _canonical_matmul(a, b, dims):
    """dot_general operands as (batch, M, K) and (batch, K, N), and the output shape."""
    (lc, rc), (lb, rb) = dims
    lf = [d for d in range(a.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(b.ndim) if d not in rc and d not in rb]
    bshape = [a.shape[d] for d in lb]
    m = int(np.prod([a.shape[d] for d in lf], dtype=np.int64))
    k = int(np.prod([a.shape[d] for d in lc], dtype=np.int64))
    n = int(np.prod([b.shape[d] for d in rf], dtype=np.int64))
    a2 = jnp.transpose(a, list(lb) + lf + list(lc)).reshape(*bshape, m, k)
    b2 = jnp.transpose(b, list(rb) + list(rc) + rf).reshape(*bshape, k, n)
    out_shape = bshape + [a.shape[d] for d in lf] + [b.shape[d] for d in rf]
    return a2, b2, out_shape


class _Runner:
    def __init__(self, plan: Plan, spec):
        self.plan = plan
        self.spec = spec
        self.precision = spec.engine.precision
        self.round = _storage(self.precision)
        self.mvm_kw = crossbar.mvm_kwargs(spec)

    def __call__(self, snaps, seeds, leaves, consts):
        plan = self.plan
        env = dict(zip(plan.in_refs, leaves))
        env.update(zip(plan.const_refs, consts))
        self.run(plan.instrs, env, snaps, seeds)
        return [_read(env, r) for r in plan.out_refs]

    def run(self, instrs, env: dict, snaps, seeds) -> None:
        """Run `instrs` in order on `env` (ref -> value), adding their results to it."""
        for ins in instrs:
            vals = [_read(env, r) for r in ins.ins]
            outs = getattr(self, "_" + ins.kind)(ins, vals, snaps, seeds)
            for r, o in zip(ins.outs, outs):
                env[r] = o

    # -- exact (free, memory, host) ------------------------------------------------

    def _bind(self, ins, vals, snaps, seeds):
        return _bind(ins.prim, ins.params, vals)

    _memory = _bind

    # -- engine ------------------------------------------------------------------------

    def _elementwise(self, ins, vals, snaps, seeds):
        rnd = self.round
        if rnd is None or not any(jnp.issubdtype(a.dtype, jnp.floating) for a in ins.out_avals):
            return _bind(ins.prim, ins.params, vals)
        prim, params = ins.prim, ins.params
        out = straight_through(lambda *xs_aux: [rnd(y) for y in _bind(prim, params, xs_aux[:-1])],
                               lambda *xs: _bind(prim, params, xs), vals)
        return out

    def _engine_op(self, ins, vals, snaps, seeds):
        op, p = ins.meta["op"], self.precision
        aval = ins.out_avals[0]
        prim, params = ins.prim, ins.params

        def exact(*xs):  # the original op, with its own derivative rule (jax.nn.relu's custom_jvp)
            return _bind(prim, params, xs)

        def device(x, aux):
            return [_cast(engine.ELEMENTWISE[op](x, precision=p), aval)]

        return straight_through(device, exact, vals)

    def _marked(self, ins, vals, snaps, seeds):
        op, kw, p = ins.meta["op"], ins.meta["kw"], self.precision
        avals = ins.out_avals
        mode = self.spec.engine.matmul

        def outs(ys):  # one result, or several (layer norm's statistics)
            return [_cast(y, a) for y, a in zip(ys if isinstance(ys, tuple) else (ys,), avals)]

        def device(*xs_aux):
            return outs(_nn.engine_call(op, xs_aux[:-1], kw, p, mode))

        def exact(*xs):
            return outs(_nn.engine_call(op, xs, kw, "fp32"))

        return straight_through(device, exact, vals)

    def _matmul(self, ins, vals, snaps, seeds):
        dims = ins.params["dimension_numbers"]
        prim, params, aval = ins.prim, ins.params, ins.out_avals[0]
        mode = self.spec.engine.matmul

        def device(a, b, aux):
            a2, b2, out_shape = _canonical_matmul(a, b, dims)
            return [_cast(engine.matmul(a2, b2, mode=mode).reshape(out_shape), aval)]

        return straight_through(device, lambda *xs: _bind(prim, params, xs), vals)

    # -- crossbar ----------------------------------------------------------------------

    def _exact_fused(self, ins):
        """The original dot/conv (and the fused bias add) as float: the straight-through backward."""
        prim, params, meta = ins.prim, ins.params, ins.meta
        if "bias" not in meta:
            return lambda x, w, *rest: _bind(prim, params, (x, w))
        add_prim, add_params, pos, bshape = meta["add_prim"], meta["add_params"], meta["bias_pos"], meta["bias_shape"]

        def exact(x, w, src):
            y = _bind(prim, params, (x, w))[0]
            other = src.reshape(bshape).astype(y.dtype)
            args = (y, other) if pos == 1 else (other, y)
            return [add_prim.bind(*args, **add_params)]

        return exact

    def _mvm(self, ins, vals, snaps, seeds):
        meta, aval = ins.meta, ins.out_avals[0]
        side, xc, n = meta["side"], meta["xc"], meta["n"]
        has_bias = "bias" in meta
        kw = self.mvm_kw

        w_free = meta.get("w_free")

        def device(*xs_aux):
            *xs, (snap, seed) = xs_aux
            x = xs[1 - side]
            if w_free is None:
                x = jnp.moveaxis(x, xc, -1)
            else:  # an N-d weight: the contracted dims flattened in the matmul's order
                x = jnp.moveaxis(x, xc, tuple(range(-len(xc), 0)))
                x = x.reshape(*x.shape[:x.ndim - len(xc)], -1)
            bias = xs[2].reshape(n).astype(jnp.float32) if has_bias else None
            y = _materialise(crossbar.mvm(snap, x, seed, bias, **kw))
            if w_free is not None:
                y = y.reshape(*y.shape[:-1], *w_free)
            nf = 1 if w_free is None else len(w_free)
            if side == 0:
                y = jnp.moveaxis(y, tuple(range(-nf, 0)), tuple(range(nf)))
            return [_cast(y, aval)]

        return straight_through(device, self._exact_fused(ins), vals, (snaps[ins.wref], seeds[ins.seed]))

    def _conv(self, ins, vals, snaps, seeds):
        meta, p, aval = ins.meta, ins.params, ins.out_avals[0]
        lhs_spec, out_spec, kernel, n = meta["lhs_spec"], meta["out_spec"], meta["kernel"], meta["n"]
        has_bias = "bias" in meta
        kw = self.mvm_kw
        pads = tuple((int(lo), int(hi)) for lo, hi in p["padding"])
        inv_out = tuple(int(i) for i in np.argsort(out_spec))

        def device(*xs_aux):
            *xs, (snap, seed) = xs_aux
            x = jnp.transpose(xs[0], lhs_spec)  # (N, C, *spatial)
            bias = xs[2].reshape(n).astype(jnp.float32) if has_bias else None
            y = _materialise(sidra_core.conv(snap, x, seed, bias, kernel=kernel, stride=tuple(p["window_strides"]),
                                             padding=pads, dilation=tuple(p["rhs_dilation"]),
                                             lhs_dilation=tuple(p["lhs_dilation"]), **kw))
            return [_cast(jnp.transpose(y, inv_out), aval)]

        return straight_through(device, self._exact_fused(ins), vals, (snaps[ins.wref], seeds[ins.seed]))


def _read(env: dict, r):
    return r.val if isinstance(r, Lit) else env[r]


class _BlockFn:
    """One repeated block's program, built from the first block with its shape (sidra_jax.repeats):
    (its snapshots, its seeds, its arguments) -> its outputs."""

    def __init__(self, runner: _Runner, block):
        self.runner, self.block = runner, block

    def __call__(self, snaps, seeds, args):
        b = self.block
        env = dict(zip(b.args, args))
        self.runner.run(b.instrs, env, dict(zip(b.wrefs, snaps)), dict(zip(b.seeds.tolist(), seeds)))
        return [env[r] for r in b.outs]


class _Chained:
    """A plan run block after block, each block's program shared by the blocks like it."""

    def __init__(self, plan: Plan, spec, blocks: list):
        runner, shared = _Runner(plan, spec), {}
        self.plan = plan
        self.steps = []
        for b in blocks:
            fn = shared.get(b.key)
            if fn is None:
                fn = shared[b.key] = host.jit(_BlockFn(runner, b))
            self.steps.append((fn, b))
        self.programs = len(shared)

    def __call__(self, snaps, seeds, leaves, consts):
        plan = self.plan
        env = dict(zip(plan.in_refs, leaves))
        env.update(zip(plan.const_refs, consts))
        for fn, b in self.steps:
            outs = fn(tuple(snaps[w] for w in b.wrefs), seeds[b.seeds], [env[r] for r in b.args])
            env.update(zip(b.outs, outs))
        return [_read(env, r) for r in plan.out_refs]


def split(plan: Plan):
    """The plan's repeated blocks to compile once (sidra_jax.repeats), or None for one program.
    Where the VNNI kernel reads the crossbars an MVM is one custom call: the whole plan compiles in
    a fraction of a second and runs without a call per block. Where XLA's dots do, each MVM is a
    large piece of the program, and one program per distinct block compiles and runs faster."""
    return None if host.vnni_dots() else repeats.blocks(plan)


def executor(plan: Plan, spec):
    """The function (snapshots, seeds, leaves, consts) -> flat outputs of one plan: one program
    compiled with XLA_COMPILER_OPTIONS at top level (a plain nested jit under jax.grad or an outer
    jit), or one program per distinct repeated block (`split`)."""
    blocks = split(plan)
    return host.jit(_Runner(plan, spec)) if blocks is None else _Chained(plan, spec, blocks)

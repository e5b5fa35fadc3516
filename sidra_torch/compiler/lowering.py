"""The aten-to-JAX lowering table of the compiled path, and what each op costs.

Every entry computes what eager dispatch computes for that op on the chip
(dispatch.py): the same sidra_core kernels for the crossbar and the engine's
non-linear ops, element-wise results rounded to the engine's storage format,
views and data movement exact. An op missing here has no device lowering:
the graph splits around it and it runs eagerly (dispatch decides where).

A lowering is `fn(ctx, node, *args, **kwargs) -> jax value`, where `ctx`
holds the chip spec and, for crossbar ops, the programmed snapshot and noise
seed of that node. Its `kind` says which hardware runs it (crossbar, engine,
memory, free) and so how the graph pricer charges it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from sidra_core import crossbar, engine
from sidra_core.conv import conv as conv_kernel
from sidra_core.conv import conv_args

aten = torch.ops.aten

# torch dtypes as the lowered program holds them (64-bit values are narrowed: JAX runs with x64 off).
_JNP = {torch.float32: jnp.float32, torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16,
        torch.int64: jnp.int32, torch.int32: jnp.int32, torch.int16: jnp.int16, torch.int8: jnp.int8,
        torch.uint8: jnp.uint8, torch.bool: jnp.bool_, torch.float64: jnp.float32}


def jnp_dtype(dt: torch.dtype):
    if dt not in _JNP:
        raise NotImplementedError(f"no lowering for dtype {dt}")
    return _JNP[dt]


@dataclass(frozen=True)
class Lowering:
    fn: Callable
    kind: str  # crossbar | engine | elementwise | matmul | memory | free
    engine_op: str | None = None  # the cost model's name for an engine op
    when: Callable | None = None  # (node) -> bool: the lowering applies to this call (else: eager)


TABLE: dict = {}


def _reg(ops, kind, engine_op=None, when=None):
    def deco(fn):
        for op in ops if isinstance(ops, (list, tuple)) else [ops]:
            TABLE[op] = Lowering(fn, kind, engine_op, when)
        return fn

    return deco


def out_dtype(node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _cast(y, node):
    dt = out_dtype(node)
    return y if dt is None else y.astype(jnp_dtype(dt))


def _round_engine(y, node, precision: str):
    """The node's result in its dtype, as the engine stores it (sidra_core.engine.store); a tuple
    result (values and indices) as it is, as eager dispatch leaves it."""
    return y if out_dtype(node) is None else engine.store(_cast(y, node), precision)


def _f32(x):
    return x.astype(jnp.float32)


# ---------------------------------------------------------------------------
# free: views and metadata


def _dim(d, nd):
    return d + nd if d < 0 else d


@_reg([aten.view.default, aten._unsafe_view.default, aten.reshape.default], "free")
def _view(ctx, node, x, shape):
    return jnp.reshape(x, tuple(int(s) for s in shape))


@_reg(aten.t.default, "free")
def _t(ctx, node, x):
    return x.T if x.ndim == 2 else x


@_reg(aten.transpose.int, "free")
def _transpose(ctx, node, x, d0, d1):
    return jnp.swapaxes(x, d0, d1)


@_reg(aten.permute.default, "free")
def _permute(ctx, node, x, dims):
    return jnp.transpose(x, tuple(_dim(d, x.ndim) for d in dims))


@_reg(aten.expand.default, "free")
def _expand(ctx, node, x, sizes, implicit=False):
    lead = len(sizes) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(sizes))
    return jnp.broadcast_to(x, shape)


@_reg(aten.unsqueeze.default, "free")
def _unsqueeze(ctx, node, x, d):
    return jnp.expand_dims(x, _dim(d, x.ndim + 1))


@_reg([aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default], "free")
def _squeeze(ctx, node, x, dims=None):
    if dims is None:
        return jnp.squeeze(x)
    dims = [dims] if isinstance(dims, int) else dims
    return jnp.squeeze(x, tuple(_dim(d, x.ndim) for d in dims if x.shape[_dim(d, x.ndim)] == 1))


@_reg(aten.slice.Tensor, "free")
def _slice(ctx, node, x, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(start, end, step)
    return x[tuple(idx)]


@_reg(aten.select.int, "free")
def _select(ctx, node, x, dim, index):
    return jnp.take(x, index, axis=_dim(dim, x.ndim))


@_reg([aten.split.Tensor, aten.split_with_sizes.default], "free")
def _split(ctx, node, x, sizes, dim=0):
    dim = _dim(dim, x.ndim)
    if isinstance(sizes, int):
        sizes = [min(sizes, x.shape[dim] - s) for s in range(0, x.shape[dim], sizes)]
    return tuple(jax.lax.slice_in_dim(x, int(a), int(a) + int(s), axis=dim)
                 for a, s in zip(np.cumsum([0, *sizes[:-1]]), sizes))


@_reg(aten.unbind.int, "free")
def _unbind(ctx, node, x, dim=0):
    return tuple(jnp.moveaxis(x, dim, 0))


@_reg([aten.alias.default, aten.detach.default], "free")
def _alias(ctx, node, x):
    return x


@_reg(operator.getitem, "free")
def _getitem(ctx, node, seq, i):
    return seq[i]


# ---------------------------------------------------------------------------
# memory: data movement in SRAM (activations) or DRAM (stored tensors)


@_reg(aten.embedding.default, "memory")
def _embedding(ctx, node, weight, indices, padding_idx=-1, scale_grad=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@_reg(aten.index_select.default, "memory")
def _index_select(ctx, node, x, dim, index):
    return jnp.take(x, index, axis=_dim(dim, x.ndim))


@_reg(aten.gather.default, "memory")
def _gather(ctx, node, x, dim, index, sparse_grad=False):
    return jnp.take_along_axis(x, index, axis=_dim(dim, x.ndim))


@_reg(aten.cat.default, "memory")
def _cat(ctx, node, tensors, dim=0):
    dt = jnp_dtype(out_dtype(node))
    return jnp.concatenate([t.astype(dt) for t in tensors if t.size or t.ndim > 1], axis=dim)


@_reg(aten.stack.default, "memory")
def _stack(ctx, node, tensors, dim=0):
    return jnp.stack(tensors, axis=dim)


@_reg([aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default], "memory")
def _copy(ctx, node, x, **_):
    return _cast(x, node)


@_reg([aten.arange.start_step, aten.arange.start, aten.arange.default], "memory")
def _arange(ctx, node, *args, **_):
    return _cast(jnp.arange(*args), node)


@_reg([aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format], "memory")
def _full(ctx, node, size, fill=None, **_):
    value = {aten.zeros.default: 0, aten.ones.default: 1, aten.empty.memory_format: 0}.get(node.target, fill)
    return jnp.full(tuple(size), value, jnp_dtype(out_dtype(node)))


@_reg([aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default], "memory")
def _new_full(ctx, node, x, size, fill=None, **_):
    value = {aten.new_zeros.default: 0, aten.new_ones.default: 1, aten.new_empty.default: 0}.get(node.target, fill)
    return jnp.full(tuple(size), value, jnp_dtype(out_dtype(node)))


@_reg(aten.index.Tensor, "memory")
def _index(ctx, node, x, indices):
    return x[tuple(slice(None) if i is None else i for i in indices)]


@_reg(aten.scalar_tensor.default, "memory")
def _scalar_tensor(ctx, node, value, **_):
    return jnp.asarray(value, jnp_dtype(out_dtype(node)))


@_reg([aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default],
      "memory")
def _full_like(ctx, node, x, fill=None, **_):
    value = {aten.zeros_like.default: 0, aten.ones_like.default: 1, aten.empty_like.default: 0}.get(node.target, fill)
    return jnp.full(x.shape, value, jnp_dtype(out_dtype(node)))


# ---------------------------------------------------------------------------
# engine: element-wise arithmetic, rounded to the engine's storage format


def _elementwise(ops, f):
    @_reg(ops, "elementwise")
    def run(ctx, node, *args, **kwargs):
        return _round_engine(f(*args, **kwargs), node, ctx.spec.engine.precision)

    return run


def _alpha(f):
    return lambda a, b, alpha=1: f(a, b * alpha if alpha != 1 else b)


_elementwise([aten.add.Tensor, aten.add.Scalar], _alpha(jnp.add))
_elementwise([aten.sub.Tensor, aten.sub.Scalar], _alpha(jnp.subtract))
_elementwise([aten.rsub.Scalar, aten.rsub.Tensor], _alpha(lambda a, b: b - a))
_elementwise([aten.mul.Tensor, aten.mul.Scalar], jnp.multiply)
_elementwise([aten.div.Tensor, aten.div.Scalar], jnp.true_divide)
_elementwise(aten.neg.default, jnp.negative)
_elementwise(aten.abs.default, jnp.abs)
_elementwise(aten.exp.default, jnp.exp)
_elementwise(aten.log.default, jnp.log)
_elementwise(aten.sqrt.default, jnp.sqrt)
_elementwise(aten.rsqrt.default, jax.lax.rsqrt)
_elementwise(aten.erf.default, jax.lax.erf)
_elementwise(aten.reciprocal.default, jnp.reciprocal)
_elementwise([aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor], jnp.power)
_elementwise(aten.where.self, jnp.where)
_elementwise([aten.masked_fill.Scalar, aten.masked_fill.Tensor], lambda x, m, v: jnp.where(m, v, x))
_elementwise(aten.clamp.default, lambda x, lo=None, hi=None: jnp.clip(x, lo, hi))
_elementwise(aten.clamp_min.default, jnp.maximum)
_elementwise(aten.clamp_max.default, jnp.minimum)
_elementwise(aten.maximum.default, jnp.maximum)
_elementwise(aten.minimum.default, jnp.minimum)
for _name, _f in (("eq", jnp.equal), ("ne", jnp.not_equal), ("lt", jnp.less), ("le", jnp.less_equal),
                  ("gt", jnp.greater), ("ge", jnp.greater_equal)):
    _elementwise([getattr(aten, _name).Tensor, getattr(aten, _name).Scalar], _f)
_elementwise(aten.logical_not.default, jnp.logical_not)
_elementwise(aten.logical_and.default, jnp.logical_and)
_elementwise(aten.logical_or.default, jnp.logical_or)
_elementwise(aten.bitwise_not.default, jnp.invert)
_elementwise([aten.bitwise_and.Tensor, aten.bitwise_and.Scalar], jnp.bitwise_and)
_elementwise([aten.bitwise_or.Tensor, aten.bitwise_or.Scalar], jnp.bitwise_or)
_elementwise([aten.tril.default], lambda x, k=0: jnp.tril(x, k))
_elementwise([aten.triu.default], lambda x, k=0: jnp.triu(x, k))


def _reduce(f):
    def run(x, dims=None, keepdim=False, dtype=None):
        axes = None if dims is None or len(dims) == 0 else tuple(_dim(d, x.ndim) for d in dims)
        return f(x, axis=axes, keepdims=keepdim)

    return run


_elementwise([aten.sum.dim_IntList], _reduce(jnp.sum))
_elementwise([aten.sum.default], lambda x, dtype=None: jnp.sum(x))
_elementwise([aten.mean.dim], _reduce(jnp.mean))
_elementwise([aten.amax.default], _reduce(jnp.max))
_elementwise([aten.amin.default], _reduce(jnp.min))
_elementwise([aten.any.dim], lambda x, d, keepdim=False: jnp.any(x, axis=d, keepdims=keepdim))
_elementwise([aten.all.dim], lambda x, d, keepdim=False: jnp.all(x, axis=d, keepdims=keepdim))
_elementwise([aten.argmax.default], lambda x, dim=None, keepdim=False: jnp.argmax(x, axis=dim, keepdims=keepdim))
_elementwise([aten.cumsum.default], lambda x, dim, dtype=None: jnp.cumsum(x, axis=dim))


# ---------------------------------------------------------------------------
# engine: non-linear and normalising ops (sidra_core.engine at the chip's precision)


def _unary(op, name):
    @_reg(op, "engine", name)
    def run(ctx, node, x, *_, **__):
        return _cast(engine.ELEMENTWISE[name](_f32(x), precision=ctx.spec.engine.precision), node)

    return run


_unary(aten.relu.default, "relu")
_unary(aten.tanh.default, "tanh")
_unary(aten.sigmoid.default, "sigmoid")
_unary(aten.silu.default, "silu")


@_reg(aten.gelu.default, "engine", "gelu")
def _gelu(ctx, node, x, approximate="none"):
    name = "gelu_tanh" if approximate == "tanh" else "gelu"
    return _cast(engine.ELEMENTWISE[name](_f32(x), precision=ctx.spec.engine.precision), node)


@_reg([aten._softmax.default, aten._log_softmax.default], "engine", "softmax")
def _softmax(ctx, node, x, dim, half_to_float=False):
    f = engine.log_softmax if node.target is aten._log_softmax.default else engine.softmax
    return _cast(f(_f32(x), axis=int(dim), precision=ctx.spec.engine.precision), node)


@_reg(aten._safe_softmax.default, "engine", "softmax")
def _safe_softmax(ctx, node, x, dim, dtype=None):
    return _cast(engine.softmax(_f32(x), axis=int(dim), precision=ctx.spec.engine.precision, safe=True), node)


@_reg(aten._scaled_dot_product_flash_attention_for_cpu.default, "engine", "attention")
def _attention(ctx, node, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Attention the capture kept whole (program.DECOMPOSITIONS): eager's engine kernel. The
    logsumexp output (for a backward pass) is not computed."""
    e = ctx.spec.engine
    s = scale or 1.0 / float(np.sqrt(q.shape[-1]))
    y = engine.attention(_f32(q), _f32(k), _f32(v), attn_mask, scale=s, causal=bool(is_causal),
                         precision=e.precision, mode=e.matmul)
    lse = node.meta["val"][1]
    return y, jnp.zeros(tuple(lse.shape), jnp_dtype(lse.dtype))


@_reg(aten.native_layer_norm.default, "engine", "layer_norm")
def _layer_norm(ctx, node, x, shape, w, b, eps):
    # with mean and 1/std: the statistics autograd would save (dead in an inference graph)
    y, mean, rstd = engine.layer_norm(_f32(x), weight=None if w is None else _f32(w), bias=None if b is None else _f32(b),
                                      eps=float(eps), ndim=len(shape), precision=ctx.spec.engine.precision, stats=True)
    return y.astype(x.dtype), mean, rstd


@_reg(aten._native_batch_norm_legit_no_training.default, "engine", "batch_norm")
def _batch_norm(ctx, node, x, w, b, rm, rv, momentum, eps):
    y = engine.batch_norm(_f32(x), _f32(rm), _f32(rv), weight=None if w is None else _f32(w),
                          bias=None if b is None else _f32(b), eps=float(eps), precision=ctx.spec.engine.precision)
    empty = jnp.zeros((0,), x.dtype)
    return y.astype(x.dtype), empty, empty


@_reg(aten.native_batch_norm.default, "engine", "batch_norm", when=lambda n: not n.args[5])
def _native_batch_norm(ctx, node, x, w, b, rm, rv, training, momentum, eps):
    """Inference only: training batch norm (batch statistics) runs eagerly, on the host."""
    return _batch_norm(ctx, node, x, w, b, rm, rv, momentum, eps)


# ---------------------------------------------------------------------------
# matmuls: on the crossbar when an operand is a weight, else the engine's INT8 MACs


def _engine_matmul(ctx, a, b):
    return engine.matmul(_f32(a), _f32(b), mode=ctx.spec.engine.matmul)


def _mvm(ctx, node, x, bias=None):
    snap, seed = ctx.crossbar(node)
    y = crossbar.mvm(snap, _f32(x), seed, None if bias is None else _f32(bias), **crossbar.mvm_kwargs(ctx.spec))
    return jax.lax.optimization_barrier(y)  # computed once (see host.XLA_COMPILER_OPTIONS)


@_reg(aten.bmm.default, "matmul")
def _bmm(ctx, node, a, b):
    return _cast(_engine_matmul(ctx, a, b), node)


@_reg(aten.mm.default, "matmul")
def _mm(ctx, node, a, b):
    side = ctx.weight_side(node)
    if side == 1:
        return _cast(_mvm(ctx, node, a), node)
    if side == 0:  # W @ x = (x^T @ W^T)^T
        return _cast(_mvm(ctx, node, b.T).T, node)
    return _cast(_engine_matmul(ctx, a, b), node)


@_reg(aten.addmm.default, "matmul")
def _addmm(ctx, node, bias, a, b, beta=1, alpha=1):
    if ctx.weight_side(node) == 2:
        return _cast(_mvm(ctx, node, a, bias), node)
    out = _engine_matmul(ctx, a, b).astype(jnp_dtype(out_dtype(node))) + bias
    return _round_engine(out, node, ctx.spec.engine.precision)


@_reg(aten.convolution.default, "matmul")
def _convolution(ctx, node, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    snap, seed = ctx.crossbar(node)
    w_shape = tuple(node.args[1].meta["val"].shape)  # the weight's value is not read: its tiles are
    args = conv_args(w_shape, tuple(stride), tuple(padding), tuple(dilation))
    y = conv_kernel(snap, _f32(x), seed, None if bias is None else _f32(bias), **args,
                    **crossbar.mvm_kwargs(ctx.spec))
    return _cast(jax.lax.optimization_barrier(y), node)


# Which argument of a matmul node is the weight operand when it runs on the crossbar:
# mm(x, W) -> 1, mm(W, x) -> 0, addmm(bias, x, W) -> 2, convolution(x, W, ...) -> 1.
MATMULS = {aten.mm.default, aten.addmm.default, aten.convolution.default, aten.bmm.default}

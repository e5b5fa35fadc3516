"""The aten-to-JAX table of the compiled path: one plain JAX function per aten op.

A lowering computes its op's float result in JAX, as `torch` would on the CPU;
what the chip does to it is sidra_jax's: the lowered graph runs through
sidra_jax's planner and executor (program.py), which place every op (a matmul
or convolution with a weight operand on the crossbars), price it and apply the
device's numerics. Each aten op reaches the planner as one device op, as eager
dispatch runs it: element-wise ops and data movement through
`sidra_jax.nn.device_op`, the engine's non-linear ops through `sidra_jax.nn`;
views are free. An op missing here has no lowering: the graph splits around
it and it runs eagerly (dispatch decides where).

A lowering is `fn(node, *args, **kwargs) -> jax value(s)`; `node` gives the
result's dtype. Which device op an element-wise or data-movement op becomes is
`sidra_core.placement.ATEN`'s, the table eager dispatch reads.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

import sidra_jax.nn as snn
from sidra_core import placement

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
    when: Callable | None = None  # (node) -> bool: the lowering applies to this call (else: eager)


TABLE: dict = {}


def _reg(ops, when=None):
    def deco(fn):
        for op in ops if isinstance(ops, (list, tuple)) else [ops]:
            TABLE[op] = Lowering(fn, when)
        return fn

    return deco


def _reg_device_op(ops, f):
    """`f` as the one device op (element-wise or data movement) placement.ATEN makes each op."""
    for op in ops if isinstance(ops, (list, tuple)) else [ops]:
        unit = placement.aten_unit(op.name())
        if unit not in ("elementwise", "memory"):
            raise ValueError(f"{op}: placement.ATEN puts it on {unit!r}, not the engine's vector unit or memory")
        TABLE[op] = Lowering(_device_op(unit, f))


def out_dtype(node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _cast(y, node):
    dt = out_dtype(node)
    return y if dt is None else y.astype(jnp_dtype(dt))


def _f32(x):
    return x.astype(jnp.float32)


def _is_array(x) -> bool:
    return isinstance(x, jax.Array)


def _device_op(kind: str, f):
    """The lowering `f` as one device op (sidra_jax.nn.device_op): its arrays are the op's operands,
    everything else (sizes, dims, scalars) is closed over."""
    def run(node, *args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: x is None)
        at = [i for i, x in enumerate(flat) if _is_array(x)]

        def g(*arrays):
            full = list(flat)
            for i, a in zip(at, arrays):
                full[i] = a
            a, kw = jax.tree_util.tree_unflatten(tree, full)
            return f(node, *a, **kw)

        return snn.device_op(kind, _short(node.target), g, *[flat[i] for i in at])

    return run


def _short(target) -> str:
    return getattr(target, "__name__", str(target)).split(".")[0]


# ---------------------------------------------------------------------------
# free: views and metadata


def _dim(d, nd):
    return d + nd if d < 0 else d


@_reg([aten.view.default, aten._unsafe_view.default, aten.reshape.default])
def _view(node, x, shape):
    return jnp.reshape(x, tuple(int(s) for s in shape))


@_reg(aten.t.default)
def _t(node, x):
    return x.T if x.ndim == 2 else x


@_reg(aten.transpose.int)
def _transpose(node, x, d0, d1):
    return jnp.swapaxes(x, d0, d1)


@_reg(aten.permute.default)
def _permute(node, x, dims):
    return jnp.transpose(x, tuple(_dim(d, x.ndim) for d in dims))


@_reg(aten.expand.default)
def _expand(node, x, sizes, implicit=False):
    lead = len(sizes) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(sizes))
    return jnp.broadcast_to(x, shape)


@_reg(aten.unsqueeze.default)
def _unsqueeze(node, x, d):
    return jnp.expand_dims(x, _dim(d, x.ndim + 1))


@_reg([aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default])
def _squeeze(node, x, dims=None):
    if dims is None:
        return jnp.squeeze(x)
    dims = [dims] if isinstance(dims, int) else dims
    return jnp.squeeze(x, tuple(_dim(d, x.ndim) for d in dims if x.shape[_dim(d, x.ndim)] == 1))


@_reg(aten.slice.Tensor)
def _slice(node, x, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(start, end, step)
    return x[tuple(idx)]


@_reg(aten.select.int)
def _select(node, x, dim, index):
    dim = _dim(dim, x.ndim)
    return jax.lax.index_in_dim(x, index % x.shape[dim], dim, keepdims=False)


@_reg([aten.split.Tensor, aten.split_with_sizes.default])
def _split(node, x, sizes, dim=0):
    dim = _dim(dim, x.ndim)
    if isinstance(sizes, int):
        sizes = [min(sizes, x.shape[dim] - s) for s in range(0, x.shape[dim], sizes)]
    return tuple(jax.lax.slice_in_dim(x, int(a), int(a) + int(s), axis=dim)
                 for a, s in zip(np.cumsum([0, *sizes[:-1]]), sizes))


@_reg(aten.unbind.int)
def _unbind(node, x, dim=0):
    dim = _dim(dim, x.ndim)
    return tuple(jax.lax.index_in_dim(x, i, dim, keepdims=False) for i in range(x.shape[dim]))


@_reg([aten.alias.default, aten.detach.default])
def _alias(node, x):
    return x


@_reg(operator.getitem)
def _getitem(node, seq, i):
    return seq[i]


# ---------------------------------------------------------------------------
# memory: data movement in SRAM (activations) or DRAM (stored tensors)


def _memory(ops):
    def deco(f):
        _reg_device_op(ops, f)
        return f

    return deco


@_memory(aten.embedding.default)
def _embedding(node, weight, indices, padding_idx=-1, scale_grad=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@_memory(aten.index_select.default)
def _index_select(node, x, dim, index):
    return jnp.take(x, index, axis=_dim(dim, x.ndim))


@_memory(aten.gather.default)
def _gather(node, x, dim, index, sparse_grad=False):
    return jnp.take_along_axis(x, index, axis=_dim(dim, x.ndim))


@_memory(aten.cat.default)
def _cat(node, tensors, dim=0):
    dt = jnp_dtype(out_dtype(node))
    return jnp.concatenate([t.astype(dt) for t in tensors if t.size or t.ndim > 1], axis=dim)


@_memory(aten.stack.default)
def _stack(node, tensors, dim=0):
    return jnp.stack(tensors, axis=dim)


@_memory([aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default])
def _copy(node, x, **_):
    return _cast(x, node)


@_memory([aten.arange.start_step, aten.arange.start, aten.arange.default])
def _arange(node, *args, **_):
    return _cast(jnp.arange(*args), node)


_FILL = {aten.zeros.default: 0, aten.ones.default: 1, aten.empty.memory_format: 0,
         aten.new_zeros.default: 0, aten.new_ones.default: 1, aten.new_empty.default: 0,
         aten.zeros_like.default: 0, aten.ones_like.default: 1, aten.empty_like.default: 0}


@_memory([aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format])
def _full(node, size, fill=None, **_):
    return jnp.full(tuple(size), _FILL.get(node.target, fill), jnp_dtype(out_dtype(node)))


@_memory([aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default])
def _new_full(node, x, size, fill=None, **_):
    return jnp.full(tuple(size), _FILL.get(node.target, fill), jnp_dtype(out_dtype(node)))


@_memory(aten.index.Tensor)
def _index(node, x, indices):
    return x[tuple(slice(None) if i is None else i for i in indices)]


@_memory(aten.scalar_tensor.default)
def _scalar_tensor(node, value, **_):
    return jnp.asarray(value, jnp_dtype(out_dtype(node)))


@_memory([aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default])
def _full_like(node, x, fill=None, **_):
    return jnp.full(x.shape, _FILL.get(node.target, fill), jnp_dtype(out_dtype(node)))


# ---------------------------------------------------------------------------
# engine: element-wise arithmetic, comparisons and reductions (sidra_jax rounds their results to
# the engine's storage format, once per op)


def _elementwise(ops, f):
    _reg_device_op(ops, lambda node, *a, **k: _cast(f(*a, **k), node))


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
# engine: non-linear and normalising ops (sidra_jax.nn: one engine op each, at the chip's precision)

_UNARY = {aten.relu.default: snn.relu, aten.tanh.default: snn.tanh, aten.sigmoid.default: snn.sigmoid,
          aten.silu.default: snn.silu}


@_reg(list(_UNARY))
def _unary(node, x, *_, **__):
    return _cast(_UNARY[node.target](_f32(x)), node)


@_reg(aten.gelu.default)
def _gelu(node, x, approximate="none"):
    return _cast(snn.gelu(_f32(x), approximate=approximate == "tanh"), node)


@_reg([aten._softmax.default, aten._log_softmax.default])
def _softmax(node, x, dim, half_to_float=False):
    f = snn.log_softmax if node.target is aten._log_softmax.default else snn.softmax
    return _cast(f(_f32(x), axis=int(dim)), node)


@_reg(aten._safe_softmax.default)
def _safe_softmax(node, x, dim, dtype=None):
    return _cast(snn.softmax(_f32(x), axis=int(dim), safe=True), node)


@_reg(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _attention(node, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Attention the capture kept whole (program.DECOMPOSITIONS): the engine's attention op. The
    logsumexp output (for a backward pass) is not computed."""
    y = snn.dot_product_attention(_f32(q), _f32(k), _f32(v), scale=scale, mask=attn_mask, causal=bool(is_causal),
                                  layout="bhsd")
    lse = node.meta["val"][1]
    return y, jnp.zeros(tuple(lse.shape), jnp_dtype(lse.dtype))


@_reg(aten.native_layer_norm.default)
def _layer_norm(node, x, shape, w, b, eps):
    # with mean and 1/std: the statistics autograd would save (dead in an inference graph)
    y, mean, rstd = snn.layer_norm(_f32(x), None if w is None else _f32(w), None if b is None else _f32(b),
                                   eps=float(eps), ndim=len(shape), stats=True)
    return y.astype(x.dtype), mean, rstd


@_reg(aten._native_batch_norm_legit_no_training.default)
def _batch_norm(node, x, w, b, rm, rv, momentum, eps):
    y = snn.batch_norm(_f32(x), _f32(rm), _f32(rv), None if w is None else _f32(w), None if b is None else _f32(b),
                       eps=float(eps))
    empty = jnp.zeros((0,), x.dtype)
    return y.astype(x.dtype), empty, empty


@_reg(aten.native_batch_norm.default, when=lambda n: not n.args[5])
def _native_batch_norm(node, x, w, b, rm, rv, training, momentum, eps):
    """Inference only: training batch norm (batch statistics) runs eagerly, on the host."""
    return _batch_norm(node, x, w, b, rm, rv, momentum, eps)


# ---------------------------------------------------------------------------
# matmuls: sidra_jax places them (a weight operand: the crossbars, else the engine's INT8 MACs)


@_reg([aten.mm.default, aten.bmm.default])
def _mm(node, a, b):
    return _cast(jnp.matmul(a, b), node)


@_reg(aten.addmm.default, when=lambda n: n.kwargs.get("beta", 1) == 1 and n.kwargs.get("alpha", 1) == 1)
def _addmm(node, bias, a, b, beta=1, alpha=1):
    return _cast(jnp.matmul(a, b) + bias, node)


_CONV_LAYOUTS = {3: ("NCH", "OIH", "NCH"), 4: ("NCHW", "OIHW", "NCHW"), 5: ("NCDHW", "OIDHW", "NCDHW")}


def _plain_conv(n) -> bool:
    """Eager's crossbar convolutions: not transposed, numeric padding, 1-3 spatial dimensions."""
    w = n.args[1].meta.get("val") if hasattr(n.args[1], "meta") else None
    return not n.args[6] and not isinstance(n.args[4], str) and w is not None and w.dim() in _CONV_LAYOUTS


@_reg(aten.convolution.default, when=_plain_conv)
def _convolution(node, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    y = jax.lax.conv_general_dilated(x, w, tuple(stride), [(int(p), int(p)) for p in padding],
                                     rhs_dilation=tuple(dilation), dimension_numbers=_CONV_LAYOUTS[w.ndim],
                                     feature_group_count=int(groups))
    if bias is not None:
        y = y + bias.reshape(1, -1, *([1] * (w.ndim - 2)))
    return _cast(y, node)

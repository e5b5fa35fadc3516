"""The dispatch table: where each aten op runs on the chip (priced by sidra_core.ops, through Chip).

Every op that reaches the device is one of:

- crossbar: `mm`/`addmm`/`linear`/`matmul` with a weight operand, `convolution`
  with a weight: the sidra_core MVM kernels, weights programmed once and cached;
- engine: activation x activation matmuls (attention), the non-linear and
  normalising ops, and element-wise arithmetic: the compute engine's numerics
  at its precision;
- memory: data movement inside device memory (embedding lookups, copies,
  concatenation, factories);
- free: views and metadata;
- host: everything else runs on the host CPU, paying the host link both ways
  (counted as a fallback op). So does the backward pass: Y1 computes
  gradients digitally on the host (straight-through gradients of the analog
  ops), and so do dtypes the chip cannot compute (float64, complex).

A runner takes (func, args, uargs, ukwargs): the original arguments (to find
weights) and their unwrapped CPU tensors, and returns the unwrapped result.
"""

from __future__ import annotations

import math
import warnings

import jax
import numpy as np
import torch
import torch.nn.functional as F

from sidra_core import engine, ops, placement
from sidra_core.engine import STORAGE

from . import rnn, runtime, transformer
from sidra_core.dlpack import to_jax
from .weights import conv_layout, conv_matrix, host_values, resident, weight_base

aten = torch.ops.aten

CHIP_FLOATS = tuple(getattr(torch, name) for name in placement.CHIP_FLOATS)
_warned_dtypes: set = set()


# ---------------------------------------------------------------------------
# torch <-> jax, zero-copy where the layout allows


def _to_jax(t: torch.Tensor):
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return to_jax(t.detach().contiguous())


def _to_host(t: torch.Tensor | None) -> np.ndarray | None:
    """A float32 NumPy view of t (a copy if it is another dtype or strided), for the chip's reads
    that run straight on host buffers (Chip.linear, Chip.attention): no JAX array in or out."""
    if t is None:
        return None
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.detach().contiguous().numpy()


def _to_torch(a, dtype=torch.float32) -> torch.Tensor:
    if isinstance(a, jax.ShapeDtypeStruct):  # a kernel's output in a dry run (runtime.dry_run): zeros
        return torch.zeros(a.shape, dtype=dtype)
    out = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return out if dtype == torch.float32 else out.to(dtype)


def _arg(uargs, ukwargs, i: int, name: str, default=None):
    """Argument `i` (keyword `name`) of an op as it arrived, or its default."""
    return uargs[i] if len(uargs) > i else ukwargs.get(name, default)


def nbytes(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _float_dtype(uargs) -> torch.dtype | None:
    for a in uargs:
        if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex()):
            return a.dtype
        if isinstance(a, (list, tuple)):
            d = _float_dtype(a)
            if d is not None:
                return d
    return None


def _unsupported_dtype(uargs) -> bool:
    d = _float_dtype(uargs)
    if d is None or d in CHIP_FLOATS:
        return False
    if d not in _warned_dtypes:
        _warned_dtypes.add(d)
        warnings.warn(
            f"the SIDRA chip cannot compute {d}: ops on {d} tensors run on the host CPU (exactly, "
            f"paying the host link both ways); cast to float32/float16/bfloat16 to run them on the chip",
            stacklevel=4,
        )
    return True


# ---------------------------------------------------------------------------
# host fallback


def host(func, args, uargs, ukwargs):
    """Run on the host CPU (with the caller's torch threads): the inputs go over the host link,
    the result comes back."""
    with runtime.users_torch_threads():
        out = HOST_ONLY_ON_ACCELERATORS.get(func, func._op)(*uargs, **ukwargs)
    chip = runtime.current_chip()
    chip.charge_host(nbytes(uargs) + nbytes(ukwargs.values()) + nbytes(out), transfers=2, fallback=True)
    return out


def _guard(runner):
    """Backward passes and dtypes the chip cannot compute go to the host instead."""

    def run(func, args, uargs, ukwargs):
        if _in_backward() or _unsupported_dtype(uargs):
            return host(func, args, uargs, ukwargs)
        return runner(func, args, uargs, ukwargs)

    run.__name__ = runner.__name__
    run.where = getattr(runner, "where", "engine")
    return run


# ---------------------------------------------------------------------------
# crossbar


def _linear(x: torch.Tensor, w_view, transpose: bool, bias: torch.Tensor | None, left: bool = False):
    """y = x @ M (+ bias) where M is the weight view (transposed if asked), on the crossbar; `left`:
    the op was W @ x' with x = x'^T (for the shapes in a mismatch error, worded as PyTorch's)."""
    k, n = (w_view.shape[1], w_view.shape[0]) if transpose else (w_view.shape[0], w_view.shape[1])
    if x.shape[-1] != k:  # before anything is programmed
        rows = x.numel() // max(x.shape[-1], 1)
        a, b = ((n, k), (x.shape[-1], rows)) if left else ((rows, x.shape[-1]), (k, n))
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a[0]}x{a[1]} and {b[0]}x{b[1]})")
    chip = runtime.current_chip()
    res = resident(chip, w_view, transpose)
    return _to_torch(chip.linear(res, _to_host(x), _to_host(bias)), x.dtype)


def linear_dynamic(func, args, uargs, ukwargs):
    """quantized::linear_dynamic of a quantize_dynamic model: its INT8 codes on the crossbar."""
    from .weights import quantised_resident

    x = uargs[0]
    chip = runtime.current_chip()
    found = quantised_resident(chip, args[1])
    if found is None:  # called outside a quantized Linear module: no home for its tiles
        return host(func, args, uargs, ukwargs)
    res, bias = found
    return _to_torch(chip.linear(res, _to_host(x), _to_host(bias)), x.dtype)


def _engine_matmul(a: torch.Tensor, b: torch.Tensor):
    chip = runtime.current_chip()
    return _to_torch(chip.matmul(_to_jax(a), _to_jax(b)), a.dtype)


def _weights(a, b) -> tuple[bool, bool, str]:
    """Which operands of a @ b are weights, and the product's unit (sidra_core.placement)."""
    wa, wb = weight_base(a) is not None, weight_base(b) is not None
    return wa, wb, placement.matmul(wa, wb)


def mm(func, args, uargs, ukwargs):
    a, b = args[0], args[1]
    _, wb, unit = _weights(a, b)
    if unit == "engine":
        return _engine_matmul(uargs[0], uargs[1])
    if wb:
        return _linear(uargs[0], b, False, None)
    return _linear(uargs[1].t(), a, True, None, left=True).t()  # W @ x = (x^T @ W^T)^T


def addmm(func, args, uargs, ukwargs):
    a, b = args[1], args[2]
    _, wb, unit = _weights(a, b)
    if ukwargs.get("beta", 1) != 1 or ukwargs.get("alpha", 1) != 1:
        return host(func, args, uargs, ukwargs)
    if unit == "engine":
        out = _engine_matmul(uargs[1], uargs[2])
        return _elementwise_finish(out + uargs[0], out.numel())
    if wb:
        return _linear(uargs[1], b, False, uargs[0])
    return host(func, args, uargs, ukwargs)  # W @ x + bias


def bmm(func, args, uargs, ukwargs):
    return _engine_matmul(uargs[0], uargs[1])


def baddbmm(func, args, uargs, ukwargs):
    beta, alpha = ukwargs.get("beta", 1), ukwargs.get("alpha", 1)
    prod = _engine_matmul(uargs[1], uargs[2])
    out = beta * uargs[0] + alpha * prod if (beta != 1 or alpha != 1) else uargs[0] + prod
    return _elementwise_finish(out, out.numel())


def linear(func, args, uargs, ukwargs):
    """aten.linear arrives whole under inference_mode: weight (N, K), so the crossbar holds W^T."""
    w = args[1]
    bias = uargs[2] if len(uargs) > 2 else ukwargs.get("bias")
    _, ww, unit = _weights(args[0], w)
    if unit == "engine":
        out = _engine_matmul(uargs[0], uargs[1].t())
        return out if bias is None else _elementwise_finish(out + bias, out.numel())
    if ww:
        return _linear(uargs[0], w, True, bias)
    return host(func, args, uargs, ukwargs)  # a weight times an activation's transpose


def matmul(func, args, uargs, ukwargs):
    """aten.matmul arrives whole under inference_mode."""
    a, b = args[0], args[1]
    wa, wb, unit = _weights(a, b)
    if unit == "crossbar" and wb and b.dim() == 2:
        return _linear(uargs[0], b, False, None)
    if unit == "crossbar" and wa and a.dim() == 2 and b.dim() == 2:
        return _linear(uargs[1].t(), a, True, None, left=True).t()  # W @ x = (x^T @ W^T)^T
    if unit == "engine" and a.dim() >= 2 and b.dim() >= 2:
        return _engine_matmul(uargs[0], uargs[1])
    return host(func, args, uargs, ukwargs)


def convolution(func, args, uargs, ukwargs):
    w = args[1]
    bias = uargs[2]
    stride, padding, dilation, transposed, output_padding, groups = uargs[3:9]
    if transposed and groups == 1 and weight_base(w) is not None and w.dim() in (3, 4) and uargs[0].dim() == w.dim():
        return _conv_transpose(uargs[0], w, bias, stride, padding, dilation, output_padding)
    if transposed or weight_base(w) is None or w.dim() not in (3, 4, 5) or isinstance(padding, str):
        return host(func, args, uargs, ukwargs)
    x = uargs[0]
    if x.dim() != w.dim() or x.shape[1] != w.shape[1] * groups:  # before anything is programmed
        raise RuntimeError(f"Given groups={groups}, weight of size {list(w.shape)}, expected input{list(x.shape)} "
                           f"to have {w.shape[1] * groups} channels, but got {x.shape[1] if x.dim() > 1 else 0} "
                           f"channels instead")
    chip = runtime.current_chip()
    res = resident(chip, w, conv_layout(groups), conv_matrix)
    y = chip.conv(res, _to_jax(uargs[0]), tuple(w.shape), None if bias is None else _to_jax(bias),
                  stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation))
    return _to_torch(y, uargs[0].dtype)


def _conv_transpose(x, w, bias, stride, padding, dilation, output_padding):
    """Transposed 1d/2d convolution: the crossbar holds the weight as (C_in) x (C_out k_h k_w) and
    multiplies every input position (one MVM), and the overlapping outputs are summed digitally
    into the output grid (col2im, with the bias) on the engine."""
    c_in = w.shape[0]
    if x.shape[1] != c_in:
        raise RuntimeError(f"Given transposed=1, weight of size {list(w.shape)}, expected input{list(x.shape)} "
                           f"to have {c_in} channels, but got {x.shape[1]} channels instead")
    if w.dim() == 3:  # 1d as 2d of height 1
        y = _conv_transpose(x.unsqueeze(2), w.unsqueeze(2), bias, [1, *stride], [0, *padding], [1, *dilation],
                            [0, *output_padding])
        return y.squeeze(2)
    n, _, h, wd = x.shape
    kh, kw = w.shape[-2:]
    chip = runtime.current_chip()
    res = resident(chip, w, "transposed conv", matrix_fn=lambda v, _: host_values(v).reshape(c_in, -1))
    cols = _to_torch(chip.linear(res, _to_host(x.permute(0, 2, 3, 1).reshape(-1, c_in))), x.dtype)
    # The whole grid the input positions reach, then `padding` cropped at the start of each axis and
    # `padding - output_padding` at its end (output padding past the grid is zeros).
    full = [(i - 1) * s + d * (k - 1) + 1 for i, s, d, k in zip((h, wd), stride, dilation, (kh, kw))]
    y = F.fold(cols.reshape(n, h * wd, -1).transpose(1, 2), full, (kh, kw), dilation=dilation, stride=stride)
    end = [f - p + o for f, p, o in zip(full, padding, output_padding)]
    y = F.pad(y, (0, max(end[1] - full[1], 0), 0, max(end[0] - full[0], 0)))
    y = y[:, :, padding[0]:end[0], padding[1]:end[1]]
    if bias is not None:
        y = y + bias.reshape(1, -1, 1, 1)
    return _elementwise_finish(y, y.numel())


def _conv_whole(args, uargs, ukwargs, names, transposed: bool):
    """conv{1,2,3}d / conv_transpose{1,2,3}d (whole under inference_mode, arguments `names` after x and
    w) as aten.convolution; an unbatched input (C, *spatial), as they accept, gets a batch of one."""
    defaults = {"bias": None, "stride": 1, "padding": 0, "output_padding": 0, "groups": 1, "dilation": 1}
    p = {**defaults, **{n: _arg(uargs, ukwargs, 2 + i, n, defaults[n]) for i, n in enumerate(names)}}
    x, w = uargs[0], uargs[1]
    nd = w.dim() - 2

    def expand(v):
        return v if isinstance(v, str) else [v] * nd if isinstance(v, int) else list(v)

    unbatched = x.dim() == w.dim() - 1
    new_uargs = [x.unsqueeze(0) if unbatched else x, w, p["bias"], expand(p["stride"]), expand(p["padding"]),
                 expand(p["dilation"]), transposed, expand(p["output_padding"]), p["groups"]]
    out = convolution(aten.convolution.default, list(args[:2]) + [None] * 7, new_uargs, {})
    return out.squeeze(0) if unbatched else out


def conv_nd(func, args, uargs, ukwargs):
    return _conv_whole(args, uargs, ukwargs, ("bias", "stride", "padding", "dilation", "groups"), False)


def conv_transpose_nd(func, args, uargs, ukwargs):
    return _conv_whole(args, uargs, ukwargs, ("bias", "stride", "padding", "output_padding", "groups", "dilation"),
                       True)


# ---------------------------------------------------------------------------
# compute engine


def _round_engine(t: torch.Tensor) -> torch.Tensor:
    """Round a float result to the engine's storage format (identity at fp32), saturating: a finite value
    beyond the format's range becomes its largest finite value, not +-inf, so an fp32 model's finfo.min
    attention mask stays finite (a fully masked row softmaxes as on the host instead of to NaN)."""
    dt = getattr(torch, STORAGE[runtime.current_chip().spec.engine.precision])
    if dt == torch.float32 or not t.is_floating_point() or t.dtype == dt:
        return t
    r = t.to(dt)
    if not math.isfinite(r.sum(dtype=torch.float32).item()):  # an overflow, or a real inf / NaN (one cheap check)
        big = torch.finfo(dt).max  # clamped in float32, which holds every format's largest value exactly
        r = torch.where(t.isfinite(), t.float().clamp(-big, big).to(dt), r)
    return r.to(t.dtype)


def _elementwise_finish(out, numel: int):
    chip = runtime.current_chip()
    chip.charge(ops.elementwise(numel, chip.spec))
    return _round_engine(out) if isinstance(out, torch.Tensor) else out


def elementwise(func, args, uargs, ukwargs):
    """Element-wise arithmetic and reductions on the engine's vector unit."""
    out = func._op(*uargs, **ukwargs)
    if isinstance(out, torch.Tensor):
        return _elementwise_finish(out, max(out.numel(), _max_numel(uargs)))
    chip = runtime.current_chip()
    chip.charge(ops.elementwise(_max_numel(uargs), chip.spec))
    return out


def elementwise_inplace(func, args, uargs, ukwargs):
    """In-place arithmetic: computed exactly (optimizer updates must not be rounded), priced on the engine."""
    out = func._op(*uargs, **ukwargs)
    chip = runtime.current_chip()
    chip.charge(ops.elementwise(_max_numel(uargs), chip.spec))
    return out


def _max_numel(uargs) -> int:
    n = 0
    for a in uargs:
        if isinstance(a, torch.Tensor):
            n = max(n, a.numel())
    return n


def _engine_op(name: str, x: torch.Tensor, **kw) -> torch.Tensor:
    chip = runtime.current_chip()
    return _to_torch(chip.engine(name, _to_host(x), **kw), x.dtype)


def relu(func, args, uargs, ukwargs):
    return _engine_op("relu", uargs[0])


def gelu(func, args, uargs, ukwargs):
    approx = ukwargs.get("approximate", uargs[1] if len(uargs) > 1 else "none")
    return _engine_op("gelu_tanh" if approx == "tanh" else "gelu", uargs[0])


def unary(name):
    def run(func, args, uargs, ukwargs):
        return _engine_op(name, uargs[0])

    run.__name__ = name
    return run


def softmax(func, args, uargs, ukwargs):
    x, dim = uargs[0], uargs[1]
    half_to_float = uargs[2] if len(uargs) > 2 else False
    name = "log_softmax" if func in (aten._log_softmax.default,) else "softmax"
    out = _engine_op(name, x, axis=int(dim))
    return out.to(torch.float32) if half_to_float else out


def softmax_int(func, args, uargs, ukwargs):
    """softmax.int / log_softmax.int (whole under inference_mode): (x, dim, dtype=None)."""
    x, dim = uargs[0], int(uargs[1])
    dtype = ukwargs.get("dtype", uargs[2] if len(uargs) > 2 else None)
    name = "log_softmax" if func is aten.log_softmax.int else "softmax"
    out = _engine_op(name, x if dtype is None else x.to(dtype), axis=dim)
    return out


def layer_norm_whole(func, args, uargs, ukwargs):
    """layer_norm (whole under inference_mode): (x, normalized_shape, weight, bias, eps, cudnn_enable)."""
    names = ("weight", "bias", "eps")
    vals = [uargs[2 + i] if len(uargs) > 2 + i else ukwargs.get(n, d) for i, (n, d) in enumerate(zip(names, (None, None, 1e-5)))]
    return _layer_norm(uargs[0], uargs[1], *vals, stats=False)


def batch_norm_whole(func, args, uargs, ukwargs):
    """batch_norm (whole under inference_mode): (x, w, b, running_mean, running_var, training, momentum, eps, cudnn)."""
    x, w, b, rm, rv, training, momentum, eps = uargs[:8]
    if training and rm is None:
        return native_batch_norm(func, args, uargs[:8], {})[0]
    if training or rm is None:
        return host(func, args, uargs, ukwargs)
    return batch_norm_inference(func, args, [x, w, b, rm, rv, momentum, eps], {})[0]


def dropout(func, args, uargs, ukwargs):
    """dropout(x, p, train): the identity in eval mode (no device work); training dropout on the host."""
    train = ukwargs.get("train", uargs[2] if len(uargs) > 2 else True)
    if not train or uargs[1] == 0:
        return uargs[0]
    return host(func, args, uargs, ukwargs)


def safe_softmax(func, args, uargs, ukwargs):
    """softmax where fully masked rows give 0 (the sdpa math path)."""
    x, dim = uargs[0], int(uargs[1])
    out = _engine_op("softmax", x, axis=dim, safe=True)
    dtype = ukwargs.get("dtype", uargs[2] if len(uargs) > 2 else None)
    return out if dtype is None else out.to(dtype)


def layer_norm(func, args, uargs, ukwargs):
    """native_layer_norm: the output, and the mean and 1/std that autograd saves for backward."""
    return _layer_norm(*uargs[:5], stats=True)


def _layer_norm(x, shape, w, b, eps, stats: bool):
    chip = runtime.current_chip()
    out = chip.engine("layer_norm", _to_host(x), weight=_to_host(w), bias=_to_host(b), eps=float(eps),
                      ndim=len(shape), stats=stats)
    if not stats:
        return _to_torch(out, x.dtype)
    y, mean, rstd = out
    return _to_torch(y, x.dtype), _to_torch(mean), _to_torch(rstd)


def rms_norm(func, args, uargs, ukwargs):
    """rms_norm (whole under inference_mode): (x, normalized_shape, weight=None, eps=None)."""
    x, shape = uargs[0], uargs[1]
    w, eps = _arg(uargs, ukwargs, 2, "weight"), _arg(uargs, ukwargs, 3, "eps")
    chip = runtime.current_chip()
    y = chip.engine("rms_norm", _to_host(x), weight=_to_host(w),
                    eps=float(torch.finfo(x.dtype).eps if eps is None else eps), ndim=len(shape))
    return _to_torch(y, x.dtype)


def _group_norm(x, groups: int, w, b, eps: float, stats: bool):
    """Group norm as the engine's layer norm over each group's (C/G x spatial) values, then the
    per-channel scale and shift as an element-wise op."""
    n = x.shape[0]
    rows = x.reshape(n, groups, -1)
    out = _layer_norm(rows, rows.shape[-1:], None, None, eps, stats)
    y = _channel_affine((out[0] if stats else out).reshape(x.shape), w, b)
    return (y, out[1].reshape(n, groups), out[2].reshape(n, groups)) if stats else y


def _channel_affine(y, w, b):
    """A norm's per-channel scale and shift (dim 1), as one element-wise engine op."""
    if w is None and b is None:
        return y
    per_channel = (1, y.shape[1]) + (1,) * (y.dim() - 2)
    y = y * w.reshape(per_channel) if w is not None else y
    y = y + b.reshape(per_channel) if b is not None else y
    return _elementwise_finish(y, y.numel())


def group_norm(func, args, uargs, ukwargs):
    """group_norm (whole under inference_mode): (x, num_groups, weight, bias, eps, cudnn_enabled)."""
    return _group_norm(uargs[0], int(uargs[1]), _arg(uargs, ukwargs, 2, "weight"), _arg(uargs, ukwargs, 3, "bias"),
                       float(_arg(uargs, ukwargs, 4, "eps", 1e-5)), stats=False)


def native_group_norm(func, args, uargs, ukwargs):
    """native_group_norm(x, weight, bias, N, C, HxW, group, eps): output, mean and 1/std (N, G)."""
    x, w, b, _n, _c, _hw, groups, eps = uargs[:8]
    return _group_norm(x, int(groups), w, b, float(eps), stats=True)


def instance_norm(func, args, uargs, ukwargs):
    """instance_norm (whole under inference_mode): each sample's channels normalised over their own
    values (group norm with a group per channel), or by running statistics."""
    x, w, b, rm, rv, use_input_stats, momentum, eps = uargs[:8]
    if use_input_stats:
        if rm is not None:  # also updates the running statistics: the host does that
            return host(func, args, uargs, ukwargs)
        return _group_norm(x, x.shape[1], w, b, float(eps), stats=False)
    return batch_norm_inference(func, args, [x, w, b, rm, rv, momentum, eps], {})[0]


def batch_norm_inference(func, args, uargs, ukwargs):
    """_native_batch_norm_legit_no_training(x, w, b, running_mean, running_var, momentum, eps)."""
    x, w, b, rm, rv, _momentum, eps = uargs[:7]
    chip = runtime.current_chip()
    y = chip.engine("batch_norm", _to_jax(x), mean=_to_jax(rm), var=_to_jax(rv),
                    weight=None if w is None else _to_jax(w), bias=None if b is None else _to_jax(b), eps=float(eps))
    empty = x.new_empty(0)
    return _to_torch(y, x.dtype), empty, empty


def native_batch_norm(func, args, uargs, ukwargs):
    x, w, b, rm, rv, training, momentum, eps = uargs[:8]
    if training and rm is None:  # batch statistics, none kept (instance norm): a norm per channel
        c = x.shape[1]
        per_channel = x.movedim(1, 0).reshape(c, -1)
        y, mean, rstd = _layer_norm(per_channel, (per_channel.shape[1],), None, None, eps, stats=True)
        y = _channel_affine(y.reshape((c,) + x.shape[:1] + x.shape[2:]).movedim(0, 1), w, b)
        return y.contiguous(), mean.reshape(c), rstd.reshape(c)
    if training or rm is None:  # training batch norm updates its running statistics: on the host
        return host(func, args, uargs, ukwargs)
    y, _, _ = batch_norm_inference(func, args, [x, w, b, rm, rv, momentum, eps], {})
    empty = x.new_empty(0)
    return y, empty, empty


def sdpa(func, args, uargs, ukwargs):
    """scaled_dot_product_attention (arrives whole under inference_mode): engine matmuls and softmax."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    vals = dict(zip(names, uargs[3:]))
    vals.update({k: v for k, v in ukwargs.items() if k in names})
    q, k, v = uargs[:3]
    if vals.get("dropout_p", 0.0):
        return host(func, args, uargs, ukwargs)
    if vals.get("enable_gqa", False) and k.shape[-3] != q.shape[-3]:
        # grouped-query attention: each key/value head serves q heads / kv heads query heads (device memory copies)
        rep = q.shape[-3] // k.shape[-3]
        k, v = (memory(aten.repeat_interleave.self_int, (t,), (t, rep, -3), {}) for t in (k, v))
    scale = vals.get("scale") or 1.0 / float(np.sqrt(q.shape[-1]))
    mask, causal = vals.get("attn_mask"), bool(vals.get("is_causal"))
    if fused_attention(q, k, v, mask):  # the engine's attention kernel: the ops of _sdpa_ops in one program
        return _fused_sdpa(q, k, v, mask, scale, causal)
    return _sdpa_ops(q, k, v, mask, scale, causal)


def _fused_sdpa(q, k, v, mask, scale: float, causal: bool):
    """The engine's attention kernel: straight on host buffers at its own lengths where the VNNI
    kernel runs, else at padded lengths (engine.padded_length: one
    compiled kernel serves a range of lengths, as a KV cache grows), padded keys masked out;
    priced as unpadded."""
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    chip = runtime.current_chip()
    shapes = (q.shape, k.shape, v.shape)
    if engine.native_attention(chip.spec.engine.matmul, q.shape[-1], seq_k):
        # the kernel on host buffers (Chip.attends_directly): any lengths, unpadded
        return _to_torch(chip.attention(_to_host(q), _to_host(k), _to_host(v),
                                        None if mask is None else mask.detach().contiguous().numpy(),
                                        scale=scale, causal=causal, shapes=shapes))
    pad_q, pad_k = engine.padded_length(seq_q) - seq_q, engine.padded_length(seq_k) - seq_k
    if pad_q or pad_k:
        q = F.pad(q, (0, 0, 0, pad_q))
        k, v = F.pad(k, (0, 0, 0, pad_k)), F.pad(v, (0, 0, 0, pad_k))
        mask = _padded_mask(mask, seq_q, seq_k, pad_q, pad_k)
    y = chip.attention(
        _to_jax(q), _to_jax(k), _to_jax(v), None if mask is None else to_jax(mask.detach().contiguous()),  # bool stays bool
        scale=scale, causal=causal, shapes=shapes)
    out = _to_torch(y)
    return out[..., :seq_q, :].contiguous() if pad_q else out


def _padded_mask(mask, seq_q: int, seq_k: int, pad_q: int, pad_k: int):
    """An attention mask for lengths padded by (pad_q, pad_k): padded keys hidden from every query
    (a padded query sees nothing where the mask has a row per query: the safe softmax gives zeros)."""
    if mask is None:
        mask = torch.ones(1, seq_k, dtype=torch.bool)
    mask = mask.reshape((1,) * max(0, 2 - mask.dim()) + tuple(mask.shape))
    mask = mask.expand(*mask.shape[:-1], seq_k)
    hidden = False if mask.dtype == torch.bool else float("-inf")
    return F.pad(mask, (0, pad_k, 0, pad_q if mask.shape[-2] == seq_q else 0), value=hidden)


def fused_attention(q, k, v, mask=None, dropout_p: float = 0.0, enable_gqa: bool = False) -> bool:
    """Attention the engine runs as one kernel: float32 throughout, no dropout or grouped heads, a
    mask that does not widen the scores. The rule eager dispatch and the compiled capture share."""
    if dropout_p or enable_gqa or any(t.dtype != torch.float32 for t in (q, k, v)):
        return False
    try:  # grouped heads (the CPU's fused attention takes fewer key/value heads) do not broadcast
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        return False
    if mask is None:
        return True
    scores = (*batch, q.shape[-2], k.shape[-2])
    return mask.dtype in (torch.bool, torch.float32) and torch.broadcast_shapes(mask.shape, scores) == scores


def _sdpa_ops(q, k, v, mask, scale: float, causal: bool):
    """Attention as engine ops one by one, each result in the inputs' dtype (float16 / bfloat16 models)."""
    scores = _engine_matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        L, S = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    scores = _elementwise_finish(scores, scores.numel())
    p = _engine_op("softmax", scores, axis=-1)
    p = p.masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)
    return _engine_matmul(p, v)


# ---------------------------------------------------------------------------
# device memory


def memory(func, args, uargs, ukwargs):
    """Data movement inside device memory, priced by the bytes written: reads of stored
    weights (embedding tables) come from DRAM, activations move in the SRAM buffers."""
    out = func._op(*uargs, **ukwargs)
    level = "dram" if any(weight_base(a) is not None for a in args[:2]) else "sram"
    runtime.current_chip().charge_memory(nbytes(out), level)
    return out


# ---------------------------------------------------------------------------
# The table


def _fused_cell(cell):
    """A fused RNN cell's forward on the engine: its non-linearities are engine kernels, its other
    element-wise results stored (and priced) as the engine's."""

    def run(func, args, uargs, ukwargs):
        return cell(*uargs, **ukwargs, act=lambda name, x: _engine_op(name, x),
                    fin=lambda x: _elementwise_finish(x, x.numel()))

    run.__name__ = cell.__name__
    return run


# Ops PyTorch has only for CUDA-like devices (an RNN on an accelerator calls them; the CPU has no
# kernel): the host runs these instead, in a backward pass or an unsupported dtype.
HOST_ONLY_ON_ACCELERATORS = {
    aten._thnn_fused_lstm_cell.default: rnn.lstm_cell,
    aten._thnn_fused_lstm_cell_backward_impl.default: rnn.lstm_cell_backward,
    aten._thnn_fused_gru_cell.default: rnn.gru_cell,
    aten._thnn_fused_gru_cell_backward.default: rnn.gru_cell_backward,
}


# The device kernels of the ops placement.ATEN puts on the crossbars or the engine's own kernels.
KERNELS = {
    aten.mm.default: mm, aten.addmm.default: addmm, aten.linear.default: linear,
    aten.matmul.default: matmul, aten.convolution.default: convolution,
    aten.conv1d.default: conv_nd, aten.conv2d.default: conv_nd, aten.conv3d.default: conv_nd,
    aten.conv_transpose1d.default: conv_transpose_nd, aten.conv_transpose2d.input: conv_transpose_nd,
    aten.conv_transpose3d.input: conv_transpose_nd,
    torch.ops.quantized.linear_dynamic.default: linear_dynamic,
    aten.bmm.default: bmm, aten.baddbmm.default: baddbmm,
    aten.relu.default: relu, aten.gelu.default: gelu,
    aten.tanh.default: unary("tanh"), aten.sigmoid.default: unary("sigmoid"), aten.silu.default: unary("silu"),
    aten._softmax.default: softmax, aten._log_softmax.default: softmax,
    aten._safe_softmax.default: safe_softmax,
    aten.softmax.int: softmax_int, aten.log_softmax.int: softmax_int,
    aten.layer_norm.default: layer_norm_whole, aten.batch_norm.default: batch_norm_whole,
    aten.dropout.default: dropout,
    aten.native_layer_norm.default: layer_norm,
    aten._native_batch_norm_legit_no_training.default: batch_norm_inference,
    aten.native_batch_norm.default: native_batch_norm,
    aten.rms_norm.default: rms_norm, aten.group_norm.default: group_norm,
    aten.native_group_norm.default: native_group_norm, aten.instance_norm.default: instance_norm,
    aten.scaled_dot_product_attention.default: sdpa,
    aten._thnn_fused_lstm_cell.default: _fused_cell(rnn.lstm_cell),
    aten._thnn_fused_gru_cell.default: _fused_cell(rnn.gru_cell),
    aten._native_multi_head_attention.default: transformer.native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: transformer.transformer_encoder_layer,
}


def _in_place(func) -> bool:
    """An in-place variant (`add_`), not a dunder (`__and__`)."""
    base = func._schema.name.split("::")[-1]
    return base.endswith("_") and not base.endswith("__")


def _nested(func, args, uargs, ukwargs):
    raise NotImplementedError(
        f"{func}: nested tensors are not supported on sidra:0. nn.TransformerEncoder makes them for its "
        "fast path (eval, a src_key_padding_mask, no gradients): build it with enable_nested_tensor=False, "
        "or call torch.backends.mha.set_fastpath_enabled(False)")


def runner_for(func, is_view: bool):
    """The runner for an op, decided once per OpOverload from placement.ATEN; None = a free op
    (plain call)."""
    unit = placement.aten_unit(func.name())
    if is_view or unit == "free":
        return None
    if unit == "refused":
        return _nested
    if unit in ("crossbar", "engine"):
        r = _guard(KERNELS[func])
        r.where = unit
        return r
    if unit == "elementwise":
        return _guard(elementwise_inplace if _in_place(func) else elementwise)
    if unit == "memory":
        r = _guard(memory)
        r.where = "memory"
        return r
    host.where = "host"
    return host

"""Compute-engine kernels: the digital unit beside the crossbars.

Precision modes (EngineSpec.precision): `fp32` computes exactly like the host;
`fp16` / `bf16` round the engine's inputs and outputs to that format and
accumulate reductions in fp32, as a vector unit with a wide accumulator does;
`int8` feeds element-wise non-linearities through a 256-entry look-up table
(input quantised per row to INT8) and keeps fp16 elsewhere.
Activation x activation matmuls use INT8 MACs with INT32 accumulation unless
`EngineSpec.matmul` is `fp32`.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import host, vnni
from .quant import quantise_rows

# The format the engine stores results in, per precision mode (int8 mode keeps fp16 outside its LUTs).
STORAGE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float16"}
_DTYPES = {k: jnp.dtype(v) for k, v in STORAGE.items()}


@partial(jax.jit, static_argnames=("precision",))
def round_to(x, precision: str):
    """Store a result in the engine's format (identity at fp32), as float32 again. Saturating, like
    the engine's converter: a finite value beyond the format's range becomes its largest finite
    value, not +-inf (an fp32 model's finfo.min attention mask stays finite, so a fully masked row
    softmaxes as on the host instead of to NaN); inf and NaN pass through."""
    dt = _DTYPES[precision]
    x = x.astype(jnp.float32)
    if dt == jnp.float32:
        return x
    big = float(jnp.finfo(dt).max)
    return jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x).astype(dt).astype(jnp.float32)


def store(y, precision: str):
    """An engine result as the engine stores it, in its own dtype: a float passes through the
    engine's format (round_to, saturating) unless that format is float32 or the result's own;
    integers and booleans are stored as they are. The one rule of the frontends' element-wise
    results (eager PyTorch rounds its torch tensors the same way, held to this by a test)."""
    dt = jnp.result_type(y)
    if not jnp.issubdtype(dt, jnp.floating) or _DTYPES[precision] in (jnp.float32, dt):
        return y
    return round_to(y, precision).astype(dt)


def _round(x, precision: str):
    dt = _DTYPES[precision]
    return x.astype(jnp.float32) if dt == jnp.float32 else x.astype(dt).astype(jnp.float32)


def _elementwise(fn):
    """Wrap a float32 element-wise function with the engine's precision (LUT in int8 mode)."""

    @partial(jax.jit, static_argnames=("precision",))
    def op(x, precision: str = "fp32"):
        if precision == "int8":
            # LUT: the function is evaluated only at the 255 INT8 input levels of each row.
            q, s = quantise_rows(x.astype(jnp.float32), 8)
            return _round(fn(q * s), "fp16")
        def steps(x):
            return _round(fn(_round(x, precision)), precision)

        if native(fn.__name__, precision):
            return _differentiable(partial(vnni.engine_map, op=fn.__name__, storage=STORAGE[precision]), steps)(x)
        return steps(x)

    op.__name__ = fn.__name__
    op.__doc__ = fn.__doc__
    return op


@_elementwise
def relu(x):
    """max(x, 0)."""
    return jnp.maximum(x, 0.0)


@_elementwise
def gelu(x):
    """GELU, erf form (PyTorch's default)."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


@_elementwise
def gelu_tanh(x):
    """GELU, tanh approximation (`approximate='tanh'`)."""
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


@_elementwise
def tanh(x):
    """Hyperbolic tangent."""
    return jnp.tanh(x)


@_elementwise
def sigmoid(x):
    """Logistic sigmoid."""
    return jax.nn.sigmoid(x)


@_elementwise
def silu(x):
    """x * sigmoid(x)."""
    return x * jax.nn.sigmoid(x)


ELEMENTWISE = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "tanh": tanh, "sigmoid": sigmoid, "silu": silu}
NORMS = ("layer_norm", "rms_norm")
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}  # each norm's default epsilon


def _differentiable(kernel, steps):
    """`kernel` (a native library call, which JAX cannot differentiate) with the derivatives of
    `steps`, the same op as XLA's steps."""
    f = jax.custom_jvp(kernel)
    f.defjvp(lambda primals, tangents: (kernel(*primals), jax.jvp(steps, primals, tangents)[1]))
    return f


def native(op: str, precision: str) -> bool:
    """Whether engine op `op` at `precision` runs as the native library's kernel here
    (host.native_engine): the element-wise non-linearities outside int8's look-up tables, and
    the norms. The rule the jitted ops and the chip's direct calls share."""
    if op in ELEMENTWISE:
        return precision != "int8" and host.native_engine()
    return op in NORMS and host.native_engine()


def direct(op: str, x: np.ndarray, *, precision: str, weight=None, bias=None, eps: float | None = None,
           ndim: int = 1, stats: bool = False):
    """A `native` op on a host array, called straight into the kernel: no XLA program, so any shape
    runs unpadded; the bits of the jitted op (the same kernel)."""
    if op in ELEMENTWISE:
        return vnni.engine_map_direct(x, op, storage=STORAGE[precision])
    eps = EPS[op] if eps is None else eps
    lead, row = x.shape[:x.ndim - ndim], x.shape[x.ndim - ndim:]
    weight, bias = (None if a is None else np.broadcast_to(np.asarray(a, np.float32), row) for a in (weight, bias))
    y, mean, rstd = vnni.engine_norm_direct(x.reshape(-1, math.prod(row)), weight, bias, eps=float(eps),
                                            rms=op == "rms_norm", storage=STORAGE[_io(precision)])
    y = y.reshape(x.shape)
    kept = (*lead, *(1,) * ndim)
    return (y, mean.reshape(kept), rstd.reshape(kept)) if stats else y


def _io(precision: str):
    return "fp16" if precision == "int8" else precision


@partial(jax.jit, static_argnames=("axis", "precision", "safe"))
def softmax(x, axis: int = -1, precision: str = "fp32", safe: bool = False):
    """Softmax with max subtraction; exponentials and the sum in fp32. `safe`: a row that is
    -inf throughout (fully masked attention) gives zeros instead of NaN."""
    # jax.nn.softmax's arithmetic, written out so the row maximum also answers `safe`: a row is
    # -inf throughout exactly when its maximum is (one reduction pass fewer, bit-identical). The
    # maximum is taken before rounding (rounding is monotonic, so rounding it gives the rounded
    # inputs' maximum): a finite row that rounds to -inf is not masked, as on the host.
    m_in = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True, initial=-jnp.inf))
    x, m = _round(x, _io(precision)), _round(m_in, _io(precision))
    e = jnp.exp(x - m)
    y = _round(e / jnp.sum(e, axis=axis, keepdims=True), _io(precision))
    return jnp.where(m_in == -jnp.inf, 0.0, y) if safe else y


@partial(jax.jit, static_argnames=("axis", "precision"))
def log_softmax(x, axis: int = -1, precision: str = "fp32"):
    x = _round(x, _io(precision))
    return _round(jax.nn.log_softmax(x, axis=axis), _io(precision))


@partial(jax.jit, static_argnames=("ndim", "precision", "stats"))
def layer_norm(x, weight=None, bias=None, eps: float = EPS["layer_norm"], ndim: int = 1, precision: str = "fp32", stats: bool = False):
    """Layer norm over the last `ndim` axes; statistics in fp32. With `stats` also the mean and
    1/std (kept dims), which autograd saves for the backward pass."""
    p = _io(precision)

    def steps(x, weight, bias, eps):
        x = _round(x, p)
        axes = tuple(range(x.ndim - ndim, x.ndim))
        mean = jnp.mean(x, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
        rstd = jax.lax.rsqrt(var + eps)
        y = (x - mean) * rstd
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return (_round(y, p), mean, rstd) if stats else _round(y, p)

    if native("layer_norm", precision):
        return _native_norm(steps, x, weight, bias, eps, ndim, p, stats, rms=False)
    return steps(x, weight, bias, eps)


@partial(jax.jit, static_argnames=("ndim", "precision"))
def rms_norm(x, weight=None, eps: float = EPS["rms_norm"], ndim: int = 1, precision: str = "fp32"):
    """RMS norm over the last `ndim` axes."""
    p = _io(precision)

    def steps(x, weight, bias, eps):
        x = _round(x, p)
        axes = tuple(range(x.ndim - ndim, x.ndim))
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True) + eps)
        if weight is not None:
            y = y * weight
        return _round(y, p)

    if native("rms_norm", precision):
        return _native_norm(steps, x, weight, None, eps, ndim, p, False, rms=True)
    return steps(x, weight, None, eps)


def _native_norm(steps, x, weight, bias, eps, ndim: int, io: str, stats: bool, rms: bool):
    """A norm as the native kernel's custom call on x's rows (its last `ndim` axes), differentiated
    as `steps` (x, weight, bias, eps)."""
    lead, row = x.shape[:x.ndim - ndim], x.shape[x.ndim - ndim:]
    kept = (*lead, *(1,) * ndim)

    def kernel(x, weight, bias, eps):
        y, mean, rstd = vnni.engine_norm(
            x.reshape(-1, math.prod(row)), None if weight is None else jnp.broadcast_to(weight, row),
            None if bias is None else jnp.broadcast_to(bias, row), eps=eps, rms=rms, storage=STORAGE[io])
        return (y.reshape(x.shape), mean.reshape(kept), rstd.reshape(kept)) if stats else y.reshape(x.shape)

    return _differentiable(kernel, steps)(x, weight, bias, jnp.asarray(eps, jnp.float32))


@partial(jax.jit, static_argnames=("precision",))
def batch_norm(x, mean, var, weight=None, bias=None, eps: float = 1e-5, precision: str = "fp32"):
    """Inference batch norm with running statistics; channels on axis 1."""
    p = _io(precision)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = (_round(x, p) - mean.reshape(shape)) * jax.lax.rsqrt(var.reshape(shape) + eps)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return _round(y, p)


@partial(jax.jit, static_argnames=("mode",))
def matmul(a, b, mode: str = "int8"):
    """Activation x activation matmul (a: (..., M, K), b: (..., K, N)), e.g. attention.

    `int8`: rows of `a` and columns of `b` are quantised to INT8 with dynamic
    scales, multiplied exactly (INT32 accumulation, exact in float32 up to
    K = 1040) and rescaled; `fp32`: a float matmul.
    """
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if mode == "fp32":
        return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    if host.vnni_dots() and a.shape[-1] <= vnni.MAX_ENGINE_K:  # the same arithmetic as VNNI dots
        return vnni.engine_matmul(a, b)
    qa, sa = quantise_rows(a, 8)
    qb, sb = quantise_rows(b, 8, axis=-2)  # per column of b
    # INT8 codes are exact in bfloat16 and their products in the fp32 accumulator, so this is
    # the INT32 MAC result (exact up to K = 1040) at the host's fastest dot (bf16 with AMX).
    dt = host.narrow_float()
    acc = jnp.matmul(qa.astype(dt), qb.astype(dt), preferred_element_type=jnp.float32)
    return acc * sa * sb


# An eager caller compiles one attention kernel per (query, key) length, and a growing KV cache
# would compile one per generated token. Past _EXACT_LENGTHS the lengths are padded
# up to the next 2^k or 3 * 2^(k-1) (at most 1/3 padding; padded keys masked out), so a 1000-token
# generation compiles ~20 kernels instead of 1000.
_EXACT_LENGTHS = 8


def padded_length(n: int) -> int:
    """The sequence length an eager attention of length `n` runs at."""
    if n <= _EXACT_LENGTHS:
        return n
    p = 1 << (n - 1).bit_length()
    return p * 3 // 4 if n <= p * 3 // 4 else p


def native_attention(mode: str, d: int, sk: int, mask=None) -> bool:
    """Whether an attention (causal or not, with no mask or a bool or float32 one) runs as the VNNI
    kernel's one call (INT8 matmuls, head size d and sk keys within its int32 sums) on this host."""
    return (mode == "int8" and host.vnni_dots() and max(d, sk) <= vnni.MAX_ENGINE_K
            and (mask is None or mask.dtype in (jnp.bool_, jnp.float32)))


@partial(jax.jit, static_argnames=("scale", "causal", "precision", "mode", "layout"))
def attention(q, k, v, mask=None, *, scale: float, causal: bool = False, precision: str = "fp32",
              mode: str = "int8", layout: str = "bhsd"):
    """Scaled dot-product attention as the engine runs it, in one program: the q k^T matmul, scaled,
    masked (a bool mask is -inf where False, a float mask is added; `causal` hides later keys),
    stored in the engine format, softmax, zeros for rows masked throughout, the matmul with v.
    q, k, v are (..., S, D) (`layout` "bhsd") or (B, S, H, D) ("bshd", jax.nn's)."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"attention layout must be 'bhsd' or 'bshd', got {layout!r}")
    if native_attention(mode, q.shape[-1], k.shape[-3 if layout == "bshd" else -2], mask):
        # the whole attention as one VNNI call: the scores stay in the CPU's caches
        return vnni.attention(q, k, v, mask, causal, scale=scale, storage=STORAGE[precision],
                              heads_first=layout == "bhsd")
    if layout == "bshd":
        q, k, v = (jnp.swapaxes(t, -3, -2) for t in (q, k, v))  # (a mask is the scores' (B, H, S, T))
    s = matmul(q, jnp.swapaxes(k, -1, -2), mode) * scale
    if causal:
        seq_q, seq_k = s.shape[-2], s.shape[-1]
        s = jnp.where(jnp.tril(jnp.ones((seq_q, seq_k), bool)), s, -jnp.inf)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf) if mask.dtype == jnp.bool_ else s + mask
    # rows masked throughout give zeros: the safe softmax tells them by their maximum (one pass fewer)
    p = softmax(round_to(s, precision), axis=-1, precision=precision, safe=True)
    y = matmul(p, v, mode)
    return jnp.swapaxes(y, -3, -2) if layout == "bshd" else y

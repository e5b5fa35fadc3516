"""Compute-engine operations as JAX functions that sidra_jax recognises whole.

On plain JAX (outside `sidra_jax.jit`) each function computes the exact float
result (`sidra_core.engine` at fp32). Inside `sidra_jax.jit` the interpreter
sees each call as one marked `jit` equation and runs it as ONE compute-engine
op at the chip's precision, priced as that op (`sidra_core.ops.engine`), as
sidra_torch prices `aten.gelu`, `aten._softmax`, `aten.native_layer_norm`.

Why this module exists: `jax.nn.gelu` and `jax.nn.softmax` are inlined into
their primitives when traced (`erfc`, `mul`, `reduce_max`, `exp`, ...). The
interpreter still runs those on the engine, but as several element-wise ops
(each rounded to the engine precision and priced as its own op). For the same
numerics and cost as PyTorch's fused ops, use these; `dot_product_attention`
(jax.nn's layout) is the engine's one attention op, as PyTorch's
`scaled_dot_product_attention` is on sidra_torch. `jax.nn.relu`,
`jax.nn.silu`, `jnp.tanh` and `jax.nn.sigmoid` are recognised as they are.

    import sidra_jax.nn as snn
    h = snn.gelu(x @ w1 + b1)
    y = snn.layer_norm(x + h @ w2 + b2, gamma, beta, eps=1e-5)
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from sidra_core import engine

# jit name -> (engine op, static kwargs); filled as marked functions are created.
REGISTRY: dict[str, tuple[str, dict]] = {}
_CACHE: dict = {}

# Ops whose engine kernel takes one tensor (sidra_core.engine.ELEMENTWISE).
UNARY = ("relu", "gelu", "gelu_tanh", "tanh", "sigmoid", "silu")


def engine_call(op: str, args, kw: dict, precision: str, matmul: str = "fp32"):
    """Run engine op `op` on `args` (as the marked function passes them) at `precision`, its
    activation matmuls in `matmul` mode (sidra_core.spec.EngineSpec.matmul)."""
    if op == "attention":
        q, k, v, *mask = args
        return engine.attention(q, k, v, mask[0] if mask else None, scale=kw["scale"], causal=kw.get("causal", False),
                                precision=precision, mode=matmul, layout=kw.get("layout", "bshd"))
    if op in UNARY:
        return engine.ELEMENTWISE[op](args[0], precision=precision)
    if op == "softmax":
        return engine.softmax(args[0], axis=kw["axis"], precision=precision, safe=kw.get("safe", False))
    if op == "log_softmax":
        return engine.log_softmax(args[0], axis=kw["axis"], precision=precision)
    if op == "layer_norm":
        x, rest = args[0], list(args[1:])
        w = rest.pop(0) if kw["has_weight"] else None
        b = rest.pop(0) if kw["has_bias"] else None
        return engine.layer_norm(x, w, b, eps=kw["eps"], ndim=kw["ndim"], precision=precision,
                                 stats=kw.get("stats", False))
    if op == "rms_norm":
        w = args[1] if kw["has_weight"] else None
        return engine.rms_norm(args[0], w, eps=kw["eps"], ndim=kw["ndim"], precision=precision)
    if op == "batch_norm":
        x, mean, var, rest = args[0], args[1], args[2], list(args[3:])
        w = rest.pop(0) if kw["has_weight"] else None
        b = rest.pop(0) if kw["has_bias"] else None
        return engine.batch_norm(x, mean, var, w, b, eps=kw["eps"], precision=precision)
    raise ValueError(f"unknown engine op {op!r}")


def _marked(op: str, **kw):
    """The jitted function for (op, kwargs), named so the interpreter can find it in a jaxpr."""
    key = (op, tuple(sorted(kw.items())))
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    tag = hashlib.sha1(repr(key).encode()).hexdigest()[:8]
    name = f"sidra_{op}_{tag}"

    def impl(*args):
        return engine_call(op, args, kw, "fp32")

    impl.__name__ = impl.__qualname__ = name
    fn = _CACHE[key] = jax.jit(impl)
    REGISTRY[name] = (op, dict(kw))
    return fn


def device_op(kind: str, name: str, f, *arrays):
    """`f(*arrays)` (plain JAX; anything else it needs closed over) as ONE device op named `name`:
    `kind` "elementwise" runs on the engine's vector unit, its float results stored once in the
    engine's format; "memory" moves data in device memory, exactly. How torch.compile's aten ops
    reach the planner whole, priced and rounded as eager dispatch runs them."""
    if kind not in ("elementwise", "memory"):
        raise ValueError(f"device_op kind must be 'elementwise' or 'memory', got {kind!r}")
    jname = f"sidra_{kind}_{name}"
    REGISTRY.setdefault(jname, (kind, {"name": name}))

    def impl(*xs):
        return f(*xs)

    impl.__name__ = impl.__qualname__ = jname
    return jax.jit(impl)(*arrays)


def relu(x):
    """max(x, 0) (the same as jax.nn.relu, which is also recognised)."""
    return _marked("relu")(x)


def gelu(x, approximate: bool = False):
    """GELU; erf form by default (PyTorch's default), tanh form with approximate=True.

    Note: jax.nn.gelu defaults to approximate=True; this follows PyTorch.
    """
    return _marked("gelu_tanh" if approximate else "gelu")(x)


def tanh(x):
    return _marked("tanh")(x)


def sigmoid(x):
    return _marked("sigmoid")(x)


def silu(x):
    return _marked("silu")(x)


def softmax(x, axis: int = -1, safe: bool = False):
    """Softmax along `axis`; `safe`: rows that are -inf throughout give zeros (PyTorch's _safe_softmax)."""
    return _marked("softmax", axis=int(axis), safe=bool(safe))(x)


def log_softmax(x, axis: int = -1):
    return _marked("log_softmax", axis=int(axis))(x)


def dot_product_attention(query, key, value, scale: float | None = None, mask=None, causal: bool = False,
                          layout: str = "bshd"):
    """Softmax(q k^T scale [+ mask]) v, run as the engine's one attention op, as PyTorch's
    scaled_dot_product_attention is. `layout` "bshd" (batch, seq, heads, dim: jax.nn's) or "bhsd"
    (PyTorch's); the scale defaults to 1 / sqrt(dim); `mask` (bool: keep where True, or float:
    added) broadcasts to the scores (batch, heads, seq_q, seq_k); `causal` hides later keys."""
    scale = 1.0 / float(query.shape[-1]) ** 0.5 if scale is None else float(scale)
    args = (query, key, value) if mask is None else (query, key, value, mask)
    return _marked("attention", scale=scale, causal=bool(causal), layout=layout)(*args)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, ndim: int = 1, stats: bool = False):
    """Layer norm over the last `ndim` axes, with optional scale and shift; `stats`: also the mean
    and 1 / std (as aten.native_layer_norm returns them)."""
    args = [x] + [a for a in (weight, bias) if a is not None]
    return _marked("layer_norm", eps=float(eps), ndim=int(ndim), has_weight=weight is not None,
                   has_bias=bias is not None, stats=bool(stats))(*args)


def rms_norm(x, weight=None, eps: float = 1e-6, ndim: int = 1):
    args = [x] + ([weight] if weight is not None else [])
    return _marked("rms_norm", eps=float(eps), ndim=int(ndim), has_weight=weight is not None)(*args)


def batch_norm(x, mean, var, weight=None, bias=None, eps: float = 1e-5):
    """Inference batch norm with running statistics, channels on axis 1 (NCHW)."""
    args = [x, mean, var] + [a for a in (weight, bias) if a is not None]
    return _marked("batch_norm", eps=float(eps), has_weight=weight is not None, has_bias=bias is not None)(*args)


__all__ = ["relu", "gelu", "tanh", "sigmoid", "silu", "softmax", "log_softmax", "dot_product_attention",
           "layer_norm", "rms_norm", "batch_norm"]


def encoder_block_params(rng, d: int = 256, ffn: int = 1024) -> dict:
    """Random parameters of `encoder_block` of width d and MLP width ffn from a NumPy Generator:
    projections scaled 1/sqrt(fan-in), small biases, unit layer norms."""
    def lin(k, n):
        return {"w": (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32),
                "b": (0.01 * rng.standard_normal(n)).astype(np.float32)}

    def ln():
        return {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}

    return {"q": lin(d, d), "k": lin(d, d), "v": lin(d, d), "o": lin(d, d), "f1": lin(d, ffn), "f2": lin(ffn, d),
            "ln1": ln(), "ln2": ln()}


def encoder_block(p, x, heads: int = 4, eps: float = 1e-5):
    """A BERT-style encoder block in plain JAX (post-norm attention + GELU MLP), on these engine ops.

    `p` holds q, k, v, o, f1, f2 as {"w": (in, out), "b": (out,)} and ln1, ln2 as
    {"g", "b"}; x is (batch, sequence, d); `eps` is the layer norms' (BERT's is 1e-12).
    A reference model for parity tests, benchmarks and notebooks.
    """
    b, s, d = x.shape
    dh = d // heads

    def lin(t, name):
        return t @ p[name]["w"] + p[name]["b"]

    def split(t):  # (batch, seq, heads, dim): the projections' own layout, no transpose
        return t.reshape(b, s, heads, dh)

    a = dot_product_attention(split(lin(x, "q")), split(lin(x, "k")), split(lin(x, "v"))).reshape(b, s, d)
    x = layer_norm(x + lin(a, "o"), p["ln1"]["g"], p["ln1"]["b"], eps=eps)
    return layer_norm(x + lin(gelu(lin(x, "f1")), "f2"), p["ln2"]["g"], p["ln2"]["b"], eps=eps)

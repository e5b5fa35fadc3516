"""Compute-engine kernels against torch references, per precision mode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sidra_core import engine

F = torch.nn.functional

# Relative rounding of one conversion to the format (round to nearest): half an ulp.
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
TINY = {"fp16": 6e-8, "bf16": 1e-30}  # absolute error floor (fp16 subnormal spacing)


def _x(shape=(6, 257), seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _round_to(x, fmt):
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    return torch.from_numpy(np.array(x, np.float32)).to(dt).float()


TORCH_ELEMENTWISE = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
}
# Lipschitz constants (max |f'|), for the INT8 LUT bound
LIPSCHITZ = {"relu": 1.0, "gelu": 1.13, "gelu_tanh": 1.13, "tanh": 1.0, "sigmoid": 0.25, "silu": 1.1}


@pytest.mark.parametrize("name", sorted(TORCH_ELEMENTWISE))
def test_elementwise_fp32(name):
    x = _x()
    y = np.asarray(engine.ELEMENTWISE[name](jnp.asarray(x), precision="fp32"))
    ref = TORCH_ELEMENTWISE[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    assert getattr(engine, name) is engine.ELEMENTWISE[name]


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(TORCH_ELEMENTWISE))
def test_elementwise_reduced_precision(name, fmt):
    x = _x()
    y = np.asarray(engine.ELEMENTWISE[name](jnp.asarray(x), precision=fmt))
    # outputs are values of the format
    np.testing.assert_array_equal(y, _round_to(y, fmt).numpy())
    # = f(x rounded to the format), rounded once more: within half an ulp, plus the fp32 function error
    # (1 + erf(x) cancels in the far negative tail of GELU: ~5e-7 absolute, in torch's fp32 GELU too)
    ref = TORCH_ELEMENTWISE[name](_round_to(x, fmt)).numpy()
    assert np.all(np.abs(y - ref) <= UNIT[fmt] * np.abs(ref) * 1.01 + 2e-6 * np.abs(ref) + TINY[fmt] + 1e-6)
    assert not np.array_equal(y, TORCH_ELEMENTWISE[name](torch.from_numpy(x)).numpy())  # it did round
    # and close to the fp32 result
    ref32 = TORCH_ELEMENTWISE[name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, ref32, rtol=8 * UNIT[fmt], atol=8 * UNIT[fmt])


@pytest.mark.parametrize("name", sorted(TORCH_ELEMENTWISE))
def test_elementwise_int8_lut(name):
    x = _x((8, 300), seed=1)
    y = np.asarray(engine.ELEMENTWISE[name](jnp.asarray(x), precision="int8"), np.float64)
    s = np.abs(x).max(axis=-1, keepdims=True) / 127  # INT8 step of each row
    ref = TORCH_ELEMENTWISE[name](torch.from_numpy(x).double()).numpy()
    # input on the INT8 grid (|dx| <= s/2) -> |df| <= L s/2, then fp16 output rounding
    bound = LIPSCHITZ[name] * s / 2 + UNIT["fp16"] * np.abs(ref) * 1.01 + 1e-6
    assert np.all(np.abs(y - ref) <= bound)
    # a LUT: each row takes at most 255 distinct values, one per INT8 input level
    for row in y:
        assert len(np.unique(row)) <= 255
    # and it is coarser than fp16 for the non-trivial functions
    y16 = np.asarray(engine.ELEMENTWISE[name](jnp.asarray(x), precision="fp16"), np.float64)
    assert np.abs(y - ref).max() > np.abs(y16 - ref).max()


def test_elementwise_int8_lut_rows_are_independent():
    x = _x((2, 64), seed=2)
    x[1] *= 100
    y = np.asarray(engine.relu(jnp.asarray(x), precision="int8"))
    y0 = np.asarray(engine.relu(jnp.asarray(x[:1]), precision="int8"))
    np.testing.assert_array_equal(y[0], y0[0])  # the per-row scale of row 0 ignores row 1


# ---------------------------------------------------------------------------
# Normalising ops


def _ln_ref(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def _rms_ref(x, w, b):
    return F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


def _softmax_ref(x, w, b):
    return torch.softmax(x, dim=-1)


NORMS = {
    "softmax": (lambda x, w, b, p: engine.softmax(x, precision=p), _softmax_ref),
    "layer_norm": (lambda x, w, b, p: engine.layer_norm(x, w, b, precision=p), _ln_ref),
    "rms_norm": (lambda x, w, b, p: engine.rms_norm(x, w, precision=p), _rms_ref),
}


def _norm_inputs(seed=3):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 5, 96)) * 2 + 0.5).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 96).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)
    return x, w, b


@pytest.mark.parametrize("name", sorted(NORMS))
def test_norms_fp32(name):
    x, w, b = _norm_inputs()
    ours, ref = NORMS[name]
    y = np.asarray(ours(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), "fp32"))
    r = ref(*(torch.from_numpy(a) for a in (x, w, b))).numpy()
    np.testing.assert_allclose(y, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("name", sorted(NORMS))
def test_norms_reduced_precision(name, fmt):
    io = "fp16" if fmt == "int8" else fmt  # int8 mode keeps fp16 for the normalising ops
    x, w, b = _norm_inputs()
    ours, ref = NORMS[name]
    y = np.asarray(ours(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), fmt))
    np.testing.assert_array_equal(y, _round_to(y, io).numpy())
    # statistics in fp32 on the rounded input, then one output rounding
    r = ref(_round_to(x, io), torch.from_numpy(w), torch.from_numpy(b)).numpy()
    assert np.all(np.abs(y - r) <= UNIT[io] * np.abs(r) * 1.01 + 1e-5 * (1 + np.abs(r)))
    r32 = ref(*(torch.from_numpy(a) for a in (x, w, b))).numpy()
    np.testing.assert_allclose(y, r32, rtol=16 * UNIT[io], atol=16 * UNIT[io])


def test_softmax_axis_and_sum():
    x = _x((3, 7, 11), seed=4)
    for axis in (0, 1, -1):
        y = np.asarray(engine.softmax(jnp.asarray(x), axis=axis, precision="fp32"))
        np.testing.assert_allclose(y, torch.softmax(torch.from_numpy(x), dim=axis).numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(y.sum(axis=axis), 1.0, rtol=1e-6)
    big = np.array([[1000.0, 1001.0, 999.0]], np.float32)  # max subtraction: no overflow
    assert np.all(np.isfinite(np.asarray(engine.softmax(jnp.asarray(big), precision="fp16"))))


def test_safe_softmax_zeroes_fully_masked_rows_only():
    x = _x((4, 6), seed=6)
    x[1] = -np.inf  # a fully masked row
    x[2, :3] = -np.inf  # partly masked
    x[3] = np.finfo(np.float32).min  # finite (rounds to -inf in fp16): not masked, as on the host
    for p in ("fp32", "fp16"):
        plain = np.asarray(engine.softmax(jnp.asarray(x), precision=p))
        safe = np.asarray(engine.softmax(jnp.asarray(x), precision=p, safe=True))
        assert np.all(np.isnan(plain[1])) and np.all(safe[1] == 0.0)
        np.testing.assert_array_equal(safe[[0, 2, 3]], plain[[0, 2, 3]])
    ref = torch.ops.aten._safe_softmax(torch.from_numpy(x), -1).numpy()
    np.testing.assert_allclose(np.asarray(engine.softmax(jnp.asarray(x), safe=True)), ref, rtol=1e-6, atol=1e-7)


def test_layer_norm_multi_axis():
    x = _x((2, 3, 4, 5), seed=5)
    y = np.asarray(engine.layer_norm(jnp.asarray(x), ndim=2, precision="fp32"))
    ref = F.layer_norm(torch.from_numpy(x), (4, 5), eps=1e-5).numpy()
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("ndim", [2, 4])
def test_batch_norm_inference(fmt, ndim):
    rng = np.random.default_rng(6)
    c = 6
    x = (rng.standard_normal((3, c) + (5,) * (ndim - 2)) * 2).astype(np.float32)
    mean, var = rng.standard_normal(c).astype(np.float32), rng.uniform(0.5, 2, c).astype(np.float32)
    w, b = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    y = np.asarray(engine.batch_norm(*(jnp.asarray(a) for a in (x, mean, var, w, b)), precision=fmt))
    xt = torch.from_numpy(x) if fmt == "fp32" else _round_to(x, fmt)
    ref = F.batch_norm(xt, *(torch.from_numpy(a) for a in (mean, var, w, b)), training=False, eps=1e-5).numpy()
    if fmt == "fp32":
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(y, _round_to(y, fmt).numpy())
        assert np.all(np.abs(y - ref) <= UNIT[fmt] * np.abs(ref) * 1.01 + 1e-5)


# ---------------------------------------------------------------------------
# Activation x activation matmul


def _int8_matmul_bound(a, b):
    """|A B - (qa sa)(qb sb)| <= sum_k (|da||b| + |a||db| + |da||db|), |da| <= sa/2, |db| <= sb/2."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    sa = np.abs(a64).max(axis=-1, keepdims=True) / 127  # per row of a
    sb = np.abs(b64).max(axis=-2, keepdims=True) / 127  # per column of b
    k = a.shape[-1]
    return (sa / 2 * np.abs(b64).sum(-2, keepdims=True) + np.abs(a64).sum(-1, keepdims=True) * sb / 2
            + k * sa * sb / 4 + 1e-5 * (np.abs(a64) @ np.abs(b64)))


@pytest.mark.parametrize("shapes", [((16, 64), (64, 24)), ((2, 3, 10, 64), (2, 3, 64, 10)), ((4, 8, 300), (300, 5))])
def test_matmul_int8_bounded(shapes):
    rng = np.random.default_rng(7)
    a = rng.standard_normal(shapes[0]).astype(np.float32)
    b = (rng.standard_normal(shapes[1]) * rng.uniform(0.1, 3, shapes[1][-1])).astype(np.float32)
    y = np.asarray(engine.matmul(jnp.asarray(a), jnp.asarray(b), mode="int8"), np.float64)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert y.shape == ref.shape
    bound = _int8_matmul_bound(a, b)
    err = np.abs(y - ref)
    assert np.all(err <= bound)
    assert err.max() > 0.02 * bound.max()  # it is quantised
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.02


def test_matmul_int8_is_exact_on_int8_grid():
    """Inputs already on the INT8 grid (row/column max = 127 steps) come out exactly (INT32 accumulation)."""
    rng = np.random.default_rng(8)
    qa = rng.integers(-127, 128, (8, 512)).astype(np.float32)
    qb = rng.integers(-127, 128, (512, 6)).astype(np.float32)
    qa[:, 0], qb[0, :] = 127, 127
    y = np.asarray(engine.matmul(jnp.asarray(qa * 0.5), jnp.asarray(qb * 0.25), mode="int8"), np.float64)
    np.testing.assert_array_equal(y, (qa.astype(np.float64) @ qb.astype(np.float64)) * 0.125)


def test_matmul_fp32_exact():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 17, 300)).astype(np.float32)
    b = rng.standard_normal((2, 300, 13)).astype(np.float32)
    y = np.asarray(engine.matmul(jnp.asarray(a), jnp.asarray(b), mode="fp32"), np.float64)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.all(np.abs(y - ref) <= 1e-6 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))))


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "int8"])
def test_round_to_saturates_finite_overflow_and_keeps_inf_and_nan(fmt):
    # an fp32 model's finfo.min attention mask must stay finite on the engine (NaN rows otherwise)
    big = float(torch.finfo({"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float16}[fmt]).max)
    f32 = np.finfo(np.float32)
    over = (big + float(f32.max)) / 2 if fmt == "bf16" else 1.01 * big  # beyond the format, finite in fp32
    x = np.array([f32.min, -over, 1.5, over, f32.max, np.inf, -np.inf, np.nan], np.float32)
    y = np.asarray(engine.round_to(x, fmt))
    np.testing.assert_array_equal(y[[0, 1, 3, 4]], [-big, -big, big, big])
    assert y[2] == 1.5 and y[5] == np.inf and y[6] == -np.inf and np.isnan(y[7])
    np.testing.assert_array_equal(np.asarray(engine.round_to(x, "fp32")), x)


def test_softmax_over_an_empty_axis_is_empty():
    for safe in (False, True):
        assert engine.softmax(jnp.zeros((3, 0)), safe=safe).shape == (3, 0)
        assert engine.softmax(jnp.zeros((0, 4)), axis=0, precision="fp16", safe=safe).shape == (0, 4)


@pytest.mark.parametrize("masking", ["none", "bool", "float", "causal"])
def test_attention_at_fp32_is_exact_attention(masking):
    """engine.attention at fp32 precision and fp32 matmuls is softmax(q k^T * scale + mask) v; rows
    masked throughout give zeros."""
    rs = np.random.default_rng(0)
    q, k, v = (rs.standard_normal((2, 3, 5, 4)).astype(np.float32) for _ in range(3))
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * 0.5
    mask = None
    if masking == "bool":
        mask = rs.random((2, 1, 5, 5)) > 0.3
        mask[1, 0, 3] = False
        s = np.where(mask, s, -np.inf)
    elif masking == "float":
        mask = np.where(rs.random((2, 1, 1, 5)) > 0.3, 0.0, -np.inf).astype(np.float32)
        s = s + mask
    elif masking == "causal":
        s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    ref = p @ v
    y = engine.attention(q, k, v, mask, scale=0.5, causal=masking == "causal", precision="fp32", mode="fp32")
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)
    if masking == "bool":
        assert np.all(np.asarray(y)[1, :, 3] == 0)


def test_attention_names_an_unknown_layout():
    q = jnp.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match="attention layout must be 'bhsd' or 'bshd', got 'sbhd'"):
        engine.attention(q, q, q, scale=0.5, layout="sbhd")

"""sidra_torch dtypes: what the chip computes (fp32/fp16/bf16), what it only
stores (ints, bools for indices and masks), and what goes to the host
(float64, complex: exact, with a one-time warning)."""

from __future__ import annotations

import warnings

import pytest
import torch

from sidra_torch import dispatch

from conftest_torch import D, DEV, Delta, assert_close, ideal, int8, restore_chip  # noqa: F401

CHIP_FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def fresh_warnings():
    """The one-time dtype warning is module state: start every test without it."""
    saved = set(dispatch._warned_dtypes)
    dispatch._warned_dtypes.clear()
    yield
    dispatch._warned_dtypes.clear()
    dispatch._warned_dtypes.update(saved)


@pytest.mark.parametrize("dtype", CHIP_FLOATS, ids=str)
def test_linear_runs_on_the_crossbar_in_each_chip_float(ideal, dtype):
    torch.manual_seed(0)
    cpu = torch.nn.Linear(32, 16).to(dtype)
    dev = torch.nn.Linear(32, 16).to(dtype)
    dev.load_state_dict(cpu.state_dict())
    dev.to(D)
    x = torch.randn(4, 32).to(dtype)
    with Delta() as d:
        y = dev(x.to(D))
    assert d["mvms"] >= 1
    assert d["fallback_ops"] == 0
    assert y.dtype == dtype and y.device == DEV
    ref = torch.nn.functional.linear(x.float(), cpu.weight.float(), cpu.bias.float()).to(dtype)
    assert_close(y.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", CHIP_FLOATS, ids=str)
def test_engine_ops_keep_dtype(ideal, dtype):
    x = torch.randn(4, 8).to(dtype)
    s = x.to(D)
    for f in (torch.relu, torch.nn.functional.gelu, torch.tanh, torch.sigmoid, torch.nn.functional.silu,
              lambda t: torch.softmax(t, -1), lambda t: torch.nn.functional.layer_norm(t, (8,)),
              lambda t: t * 2 + 1):
        with Delta() as d:
            y = f(s)
        assert y.dtype == dtype and y.device == DEV
        assert d["engine_ops"] >= 1 and d["fallback_ops"] == 0
        assert_close(y.float(), f(x.float()).to(dtype).float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", CHIP_FLOATS, ids=str)
def test_conv_runs_on_the_crossbar_in_each_chip_float(ideal, dtype):
    torch.manual_seed(0)
    cpu = torch.nn.Conv2d(3, 4, 3, padding=1)
    dev = torch.nn.Conv2d(3, 4, 3, padding=1).to(dtype)
    dev.load_state_dict(cpu.state_dict())
    dev.to(D)
    x = torch.randn(2, 3, 6, 6)
    with Delta() as d:
        y = dev(x.to(dtype).to(D))
    assert d["mvms"] >= 1 and d["fallback_ops"] == 0
    assert y.dtype == dtype
    assert_close(y.float(), cpu(x.to(dtype).float()), rtol=4 * TOL[dtype], atol=4 * TOL[dtype])


def test_integer_indices_and_boolean_masks(ideal):
    emb = torch.nn.Embedding(10, 4)
    emb_s = torch.nn.Embedding(10, 4).to(D)
    emb_s.load_state_dict(emb.state_dict())
    for idt in (torch.int64, torch.int32):
        ids = torch.tensor([[1, 5, 9], [0, 0, 3]], dtype=idt)
        with Delta() as d:
            out = emb_s(ids.to(D))
        assert out.dtype == torch.float32 and d["memory_ops"] >= 1 and d["fallback_ops"] == 0
        assert torch.equal(out.cpu(), emb(ids))
    x = torch.randn(3, 5)
    s = x.to(D)
    mask = torch.tensor([[True, False, True, False, True]] * 3)
    ms = mask.to(D)
    assert ms.dtype == torch.bool and ms.device == DEV
    assert torch.equal(s.masked_fill(ms, -1e4).cpu(), x.masked_fill(mask, -1e4))
    assert torch.equal(s[ms].cpu(), x[mask])
    assert torch.equal((s > 0).cpu(), x > 0)
    assert torch.equal(((s > 0) & ms).cpu(), (x > 0) & mask)
    assert torch.equal(s.argmax(-1).cpu(), x.argmax(-1))
    assert s.argmax(-1).dtype == torch.int64
    i = torch.arange(5, device=D)
    assert torch.equal((i * 3 + 1).cpu(), torch.arange(5) * 3 + 1)
    assert (i * 3 + 1).dtype == torch.int64
    assert torch.equal(torch.gather(s, 1, torch.tensor([[0], [4], [2]], device=D)).cpu(),
                       torch.gather(x, 1, torch.tensor([[0], [4], [2]])))


def test_integer_arithmetic_is_exact_on_a_quantising_chip(int8):
    # the engine rounds floats to its precision, never integers
    big = torch.tensor([16_777_217, 123_456_789], dtype=torch.int64)
    s = big.to(D)
    assert torch.equal((s + 1).cpu(), big + 1)
    assert torch.equal((s * 2).cpu(), big * 2)
    assert (s + 1).dtype == torch.int64


def test_float64_falls_back_to_host_with_one_warning(ideal, fresh_warnings):
    x = torch.tensor([1.0 + 1e-12, 2.0, 3.0], dtype=torch.float64)
    s = x.to(D)
    with pytest.warns(UserWarning, match="float64"):
        with Delta() as d:
            y = s * 3
    assert y.dtype == torch.float64 and y.device == DEV
    assert d["fallback_ops"] >= 1 and d["host_bytes"] > 0 and d["energy_host_j"] > 0
    assert d["engine_ops"] == 0
    assert torch.equal(y.cpu(), x * 3)  # exact, not downcast
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second op must not warn again
        with Delta() as d2:
            z = torch.exp(s) + s
    assert d2["fallback_ops"] >= 2
    assert z.dtype == torch.float64
    assert torch.equal(z.cpu(), torch.exp(x) + x)


def test_float64_linear_runs_exactly_on_the_host(ideal, fresh_warnings):
    torch.manual_seed(0)
    cpu = torch.nn.Linear(16, 8).double()
    dev = torch.nn.Linear(16, 8).double()
    dev.load_state_dict(cpu.state_dict())
    dev.to(D)
    x = torch.randn(3, 16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="float64"):
        with Delta() as d:
            y = dev(x.to(D))
    assert d["mvms"] == 0 and d["cells_programmed"] == 0
    assert d["fallback_ops"] >= 1
    assert y.dtype == torch.float64
    torch.testing.assert_close(y.cpu(), cpu(x), rtol=1e-12, atol=1e-12)


def test_complex_falls_back_to_host_with_one_warning(ideal, fresh_warnings):
    x = torch.randn(4, dtype=torch.complex64)
    s = x.to(D)
    with pytest.warns(UserWarning, match="complex64"):
        with Delta() as d:
            y = s * 2
    assert y.dtype == torch.complex64 and y.device == DEV
    assert d["fallback_ops"] >= 1
    assert torch.equal(y.cpu(), x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = (s * s).abs()
    assert a.dtype == torch.float32
    assert_close(a, (x * x).abs())


def test_each_unsupported_dtype_warns_once(ideal, fresh_warnings):
    with pytest.warns(UserWarning, match="float64"):
        torch.ones(2, dtype=torch.float64, device=D) + 1
    with pytest.warns(UserWarning, match="complex128"):
        torch.ones(2, dtype=torch.complex128, device=D) * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.ones(2, dtype=torch.float64, device=D) + 1
        torch.ones(2, dtype=torch.complex128, device=D) * 2

"""INT8 models on sidra (issue 6, deliverables 1 and 2).

- A model quantised by `torch.ao.quantization.quantize_dynamic` runs on the
  crossbars from its own INT8 codes and scales (not re-quantised); under the
  deterministic `int8` chip its outputs equal the CPU quantised model's within
  a rounding bound derived below.
- Float models are mapped to INT8 automatically; the chip config chooses
  per-channel or per-tensor weight scales and a clipping percentile.

The rounding bound. Both sides use the same weight codes c (scale s_j of
output j), except that SIDRA saturates code -128 to -127 (the differential
pair is symmetric). With W = c s the dequantised weight:

  CPU (fbgemm, `reduce_range=True`): x is quantised per tensor to 7-bit
  unsigned codes over [min(x, 0), max(x, 0)], step d = range / 127, so each
  element is off by at most d/2 and y_cpu = x W + b + e_cpu with
  |e_cpu_j| <= d/2 sum_k |W_kj|.

  SIDRA: x is quantised per row (DAC), step r = max|x_row| / 127, each element
  off by at most r/2; each tile t along K sums x_codes . c of its 256 rows and
  its ADC rounds that to a step lsb_tj (Snapshot.lsb, code units), off by at
  most lsb_tj / 2 when nothing clips; the sum is scaled back by r s_j. So
  y_sidra = x W' + b + e_sidra with |e_sidra_j| <= r/2 sum_k |W'_kj| +
  r s_j sum_t lsb_tj / 2, where W' has -128 replaced by -127:
  |x (W - W')|_j <= s_j sum_{k: c_kj = -128} |x_k|.

|y_sidra - y_cpu| is at most the sum of the three terms (plus float32
rounding, a 1e-4 relative slack).
"""

from __future__ import annotations

import copy
import gc
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import sidra_torch
from sidra_core import crossbar

from conftest_torch import D, DEV, Delta, restore_chip  # noqa: F401

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic


def _quantise(model: nn.Module, per_channel: bool = False, force_min_code: bool = True) -> nn.Module:
    """quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8), per tensor (the default qconfig) or per channel.

    The observers give a weight whose largest |w| is negative the code -128 only
    when the float division lands on -127.5 exactly, so with `force_min_code` the
    most negative code of each Linear is set to -128 (via `set_weight_bias`, the
    module's own API) to exercise the saturation of the symmetric pair.
    """
    spec = {nn.Linear: per_channel_dynamic_qconfig} if per_channel else {nn.Linear}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
        q = quantize_dynamic(copy.deepcopy(model), spec, dtype=torch.qint8)
        if force_min_code:
            for ql in _qlinears(q):
                qw, bias = torch.ops.quantized.linear_unpack(ql._packed_params._packed_params)
                codes = qw.int_repr().clone()
                codes.view(-1)[codes.argmin()] = -128
                if qw.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                    qw = torch._make_per_tensor_quantized_tensor(codes, qw.q_scale(), 0)
                else:
                    qw = torch._make_per_channel_quantized_tensor(
                        codes, qw.q_per_channel_scales(), qw.q_per_channel_zero_points(), 0)
                ql.set_weight_bias(qw, bias)
    return q


def _qlinears(qmodel: nn.Module) -> list:
    return [m for m in qmodel.modules() if type(m).__name__ == "Linear" and hasattr(m, "_packed_params")]


def _unpack(qlinear):
    """(int codes (N, K) int64 tensor, scales (N,) float64 array, bias) of a dynamically quantised Linear."""
    qw, bias = torch.ops.quantized.linear_unpack(qlinear._packed_params._packed_params)
    if qw.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        assert qw.q_zero_point() == 0
        scale = np.full(qw.shape[0], qw.q_scale())
    else:
        assert qw.q_per_channel_axis() == 0 and bool((qw.q_per_channel_zero_points() == 0).all())
        scale = qw.q_per_channel_scales().double().numpy()
    return qw.int_repr().long(), scale, bias


def _new_residents(chip, before: set) -> list:
    return [r for r in chip.residents if id(r) not in before]


def _wide_linear(k: int, n: int, seed: int) -> nn.Linear:
    """A Linear whose largest |weight| is negative (the observers then aim it at code -128)."""
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight[n // 3, k // 2] = -1.4 * lin.weight.abs().max()
    return lin


def _inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows of very different ranges (so per-row and per-tensor activation scales differ), some negative."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-1, 0.5, rows)[:, None]
    x[::3] = x[::3].abs()  # some rows one-signed, as after a ReLU
    return x


def _bound(x: torch.Tensor, codes: torch.Tensor, scale: np.ndarray, bias, lsb: np.ndarray) -> np.ndarray:
    """The rounding bound of the module docstring, per (row, output)."""
    x = x.double().numpy()
    c_cpu = codes.double().numpy().T  # (K, N)
    c_sidra = np.maximum(c_cpu, -127)
    w_cpu, w_sidra = c_cpu * scale, c_sidra * scale
    lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)
    d = (hi - lo) / 127  # CPU: per tensor, 7-bit (reduce_range)
    r = np.abs(x).max(axis=1, keepdims=True) / 127  # SIDRA: per row, signed 8-bit DAC
    e_cpu = d / 2 * np.abs(w_cpu).sum(axis=0)[None, :]
    e_act = r / 2 * np.abs(w_sidra).sum(axis=0)[None, :]
    e_adc = r * scale[None, :] * (lsb / 2).sum(axis=0)[None, :]
    e_sat = np.abs(x) @ ((c_cpu == -128) * scale)
    mag = np.abs(x) @ np.abs(w_cpu) + (0 if bias is None else np.abs(bias.detach().double().numpy()))
    return e_cpu + e_act + e_adc + e_sat + 1e-4 * mag + 1e-6


# ---------------------------------------------------------------------------
# quantize_dynamic models on the crossbar


def test_quantize_dynamic_model_runs_on_the_crossbar(restore_chip):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    q = _quantise(model)
    x = torch.randn(32, 64)
    with sidra_torch.use_chip("int8") as chip:
        before = {id(r) for r in chip.residents}
        qd = q.to(D)
        xd = x.to(D)
        with Delta() as first:
            y = qd(xd)
        assert y.device == DEV
        # Three crossbar MVMs (the Linears), two ReLUs on the engine, nothing on the host.
        assert first["mvms"] == 3
        assert first["fallback_ops"] == 0 and first["host_transfers"] == 0
        assert first["engine_ops"] >= 2
        assert first["pulses"] > 0  # programmed on first use ...
        new = _new_residents(chip, before)
        assert [r.shape for r in new] == [(64, 128), (128, 64), (64, 10)]
        with Delta() as second:
            y2 = qd(xd)
        assert second["mvms"] == 3 and second["fallback_ops"] == 0
        assert second["pulses"] == 0 and second["cells_programmed"] == 0  # ... then weight-stationary
        assert len(_new_residents(chip, before)) == 3
        torch.testing.assert_close(y2.cpu(), y.cpu(), rtol=0, atol=0)  # int8 chip: deterministic
        # The whole model computes the CPU quantised model's function (the per-layer rounding bound is
        # tested below; an untrained model's small logits make the ADC's share of the error large).
        ref = q(x)
        assert (y.cpu() - ref).norm() / ref.norm() < 0.2


# Regression tests: the quantised Linear context (_RUNNING.qlinear) once outlived its forward.


def test_quantised_tiles_are_freed_with_the_module(restore_chip):
    q = _quantise(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)))
    with sidra_torch.use_chip("int8") as chip:
        before = {id(r) for r in chip.residents}
        q.to(D)(torch.randn(2, 16).to(D))
        assert len(_new_residents(chip, before)) == 2
        del q
        gc.collect()
        assert _new_residents(chip, before) == []


def test_functional_linear_dynamic_uses_its_own_weights(restore_chip):
    torch.manual_seed(0)
    a = _quantise(nn.Sequential(nn.Linear(16, 8)), force_min_code=False)
    b = _quantise(nn.Sequential(nn.Linear(16, 8)), force_min_code=False)
    x = torch.randn(4, 16)
    packed_b = _qlinears(b)[0]._packed_params._packed_params
    ref_b = torch.ops.quantized.linear_dynamic(x, packed_b, True)
    with sidra_torch.use_chip("int8"):
        a.to(D)(x.to(D))  # a's forward ran last
        y_b = torch.ops.quantized.linear_dynamic(x.to(D), packed_b, True).cpu()
    assert (y_b - ref_b).abs().max() < 0.05 * ref_b.abs().max()


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_quantize_dynamic_codes_reach_the_tiles_unchanged(restore_chip, per_channel):
    model = nn.Sequential(_wide_linear(300, 40, seed=1), nn.ReLU(), _wide_linear(40, 300, seed=2))
    q = _quantise(model, per_channel)
    with sidra_torch.use_chip("int8") as chip:
        before = {id(r) for r in chip.residents}
        q.to(D)(torch.randn(4, 300).to(D))
        residents = _new_residents(chip, before)
        assert len(residents) == 2
        for res, ql in zip(residents, _qlinears(q)):
            codes, scale, _ = _unpack(ql)
            n, k = codes.shape
            assert res.shape == (k, n)
            assert (codes == -128).any(), "the test weight must contain the code -128"
            expected = codes.clamp(min=-127).T.numpy()  # -128 saturates: the pair is symmetric
            st = res.state
            np.testing.assert_array_equal(st.codes[:k, :n].astype(np.int64), expected)
            assert not st.codes[k:].any() and not st.codes[:, n:].any()  # padding holds nothing
            np.testing.assert_allclose(st.scale, scale, rtol=1e-6, atol=0)
            if per_channel:
                assert np.unique(st.scale).size > 1
            else:
                assert np.unique(st.scale).size == 1
            # The int8 chip writes the targets exactly: the differential pair holds the codes.
            w = (st.g_plus - st.g_minus) / ((chip.spec.tile.g_max - chip.spec.tile.g_min) / 127)
            np.testing.assert_allclose(w[:k, :n], expected, atol=1e-3)


def _clipped(x: torch.Tensor, res, spec, lsb: np.ndarray) -> np.ndarray:
    """(rows, N) mask of the outputs with a tile conversion beyond the ADC range, computed from the
    programmed codes (independently of the kernel): the bound covers rounding, not clipping."""
    st = res.state
    k, n = st.shape
    rows = st.grid.rows
    xx = x.double().numpy()
    r = np.abs(xx).max(axis=1, keepdims=True) / 127
    xq = np.clip(np.round(xx / np.where(r > 0, r, 1)), -127, 127)
    c = st.codes[:k, :n].astype(np.float64)
    qmax = 2 ** (spec.adc.bits - 1) - 1
    mask = np.zeros((xx.shape[0], n), bool)
    for t in range(st.grid.grid_k):
        p = xq[:, t * rows:(t + 1) * rows] @ c[t * rows:(t + 1) * rows]
        mask |= np.abs(p) > (qmax + 0.5) * lsb[t][None, :]
    return mask


@pytest.mark.parametrize("k,n,per_channel", [(64, 32, False), (300, 40, False), (300, 40, True), (520, 300, False)],
                         ids=["1tile", "2tiles_k", "2tiles_k_per_channel", "3x2tiles"])
def test_quantize_dynamic_outputs_match_cpu_within_int8_rounding(restore_chip, k, n, per_channel):
    q = _quantise(nn.Sequential(_wide_linear(k, n, seed=k + n)), per_channel)
    ql = _qlinears(q)[0]
    codes, scale, bias = _unpack(ql)
    assert (codes == -128).any()
    x = _inputs(48, k, seed=n)
    ref = q(x).double().numpy()
    with sidra_torch.use_chip("int8") as chip, torch.no_grad():
        before = {id(r) for r in chip.residents}
        y = q.to(D)(x.to(D)).cpu().double().numpy()
        (res,) = _new_residents(chip, before)
        snap = chip.snapshot(res)
        lsb = np.asarray(snap.lsb, np.float64)
        assert lsb.shape == (res.state.grid.grid_k, n)
        clipped = _clipped(x, res, chip.spec, lsb)
        # The independent clipping mask agrees with the kernel's own diagnostic.
        assert (clipped.mean() > 0) == (crossbar.clipped_fraction(snap, x.numpy(), chip.spec) > 0)
    # The ADC range leaves most conversions unclipped for these inputs.
    assert clipped.mean() < 0.05, f"{clipped.mean():.1%} of the outputs clip in the ADC"
    bound = _bound(x, codes, scale, bias, lsb)
    err = np.abs(y - ref)
    ok = ~clipped
    excess = np.where(ok, err - bound, -np.inf)
    worst = np.unravel_index(np.argmax(excess), err.shape)
    assert np.all(err[ok] <= bound[ok]), f"|sidra - cpu| = {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    # The bound is of the size of the real differences (within 10x), so the test has teeth.
    assert (err[ok] / bound[ok]).max() > 0.1


def test_quantize_dynamic_outputs_within_bound_without_clipping(restore_chip):
    """The same bound on every output when the ADC range is wide enough that nothing clips."""
    k, n = 300, 40
    q = _quantise(nn.Sequential(_wide_linear(k, n, seed=11)))
    codes, scale, bias = _unpack(_qlinears(q)[0])
    x = _inputs(48, k, seed=12)
    ref = q(x).double().numpy()
    with sidra_torch.use_chip("int8", adc__full_scale=0.5) as chip, torch.no_grad():
        before = {id(r) for r in chip.residents}
        y = q.to(D)(x.to(D)).cpu().double().numpy()
        (res,) = _new_residents(chip, before)
        snap = chip.snapshot(res)
        assert crossbar.clipped_fraction(snap, x.numpy(), chip.spec) == 0.0
        lsb = np.asarray(snap.lsb, np.float64)
    bound = _bound(x, codes, scale, bias, lsb)
    assert np.all(np.abs(y - ref) <= bound)


def test_cpu_term_of_the_bound_holds_on_cpu():
    """The CPU half of the derivation, checked alone: fbgemm quantises x per tensor within d/2."""
    q = _quantise(nn.Sequential(_wide_linear(300, 40, seed=5)))
    codes, scale, bias = _unpack(_qlinears(q)[0])
    x = _inputs(24, 300, seed=6)
    exact = x.double() @ (codes.double().T * torch.from_numpy(scale)) + bias.double()
    d = (max(x.max().item(), 0) - min(x.min().item(), 0)) / 127
    e_cpu = d / 2 * (codes.double().abs().T * torch.from_numpy(scale)).sum(0)
    err = (q(x).double() - exact).abs()
    assert torch.all(err <= e_cpu + 1e-4 * exact.abs() + 1e-6)
    assert err.max() > 0.05 * e_cpu.max()  # and it is of that order, not far below


# ---------------------------------------------------------------------------
# the automatic INT8 mapping of float models, set in the chip config


def _program_float(weight: torch.Tensor, **chip_kw):
    """Program a Linear with this weight on an int8 chip with overrides; (resident, chip spec, output)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    x = torch.randn(16, weight.shape[1], generator=torch.Generator().manual_seed(3))
    with sidra_torch.use_chip("int8", **chip_kw) as chip, torch.no_grad():
        before = {id(r) for r in chip.residents}
        ld = copy.deepcopy(lin).to(D)
        y = ld(x.to(D)).cpu()
        (res,) = _new_residents(chip, before)
        return res, chip.spec, y, lin(x).detach(), ld


def _channel_weight(n: int = 24, k: int = 300) -> torch.Tensor:
    """Output channels of very different magnitudes, plus one outlier."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1.3, 0.3, n)[:, None]
    w[5, 17] = 30.0
    return w


def test_float_model_default_mapping_is_per_channel_max(restore_chip):
    w = _channel_weight()
    res, spec, *_ = _program_float(w)
    assert spec.quant.granularity == "per_channel" and spec.quant.clip_percentile == 100.0
    wt = w.T.numpy()
    expected = np.abs(wt).max(axis=0) / 127
    np.testing.assert_allclose(res.state.scale, expected, rtol=1e-6)
    k, n = wt.shape
    np.testing.assert_array_equal(res.state.codes[:k, :n], np.clip(np.rint(wt / expected), -127, 127))
    assert np.abs(res.state.codes[:k, :n]).max(axis=0).tolist() == [127] * n  # every channel uses the full range


def test_float_model_per_tensor_scales(restore_chip):
    w = _channel_weight()
    res_c, _, y_c, ref, _ = _program_float(w)
    res_t, spec, y_t, _, _ = _program_float(w, quant__granularity="per_tensor")
    assert spec.quant.granularity == "per_tensor"
    wt = w.T.numpy()
    np.testing.assert_allclose(res_t.state.scale, np.full(wt.shape[1], np.abs(wt).max() / 127), rtol=1e-6)
    k, n = wt.shape
    np.testing.assert_array_equal(res_t.state.codes[:k, :n], np.clip(np.rint(wt / res_t.state.scale), -127, 127))
    # One scale for all channels: the small channels lose resolution.
    assert np.all(res_t.state.scale >= res_c.state.scale - 1e-9)
    small = np.argsort(np.abs(wt).max(axis=0))[:6]
    err_c = ((y_c - ref).abs().mean(0) / ref.abs().mean(0)).numpy()
    err_t = ((y_t - ref).abs().mean(0) / ref.abs().mean(0)).numpy()
    assert np.all(err_t[small] > 2 * err_c[small])


@pytest.mark.parametrize("granularity", ["per_channel", "per_tensor"])
def test_float_model_clip_percentile(restore_chip, granularity):
    w = _channel_weight()
    res_max, *_ = _program_float(w, quant__granularity=granularity)
    res, spec, *_ = _program_float(w, quant__granularity=granularity, quant__clip_percentile=99.9)
    assert spec.quant.clip_percentile == 99.9
    wt = w.T.numpy()
    a = np.abs(wt)
    if granularity == "per_channel":
        expected = np.percentile(a, 99.9, axis=0) / 127
    else:
        expected = np.full(wt.shape[1], np.percentile(a, 99.9) / 127)
    np.testing.assert_allclose(res.state.scale, expected, rtol=1e-5)
    assert np.all(res.state.scale < res_max.state.scale)  # the largest |w| no longer sets the scale
    k, n = wt.shape
    codes = res.state.codes[:k, :n]
    np.testing.assert_array_equal(codes, np.clip(np.rint(wt / res.state.scale), -127, 127))
    # The values beyond the percentile saturate at +-127 (clipped), the rest keep finer steps.
    beyond = a > 127.5 * res.state.scale[None, :]
    assert beyond.any()
    assert np.all(np.abs(codes[beyond]) == 127)
    if granularity == "per_tensor":
        # The outlier no longer sets the scale of every channel: several times finer steps.
        assert res.state.scale[0] < 0.3 * res_max.state.scale[0]

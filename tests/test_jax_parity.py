"""PyTorch vs JAX on the same SIDRA chip: the same weights, chip preset and seed give the same outputs,
device time, energy and counters (sidra_torch eager under inference_mode against sidra_jax.jit).

Each test runs a model twice on a fresh sidra_torch chip and twice on a fresh sidra_core.Chip of the same
spec and seed. The first call programs the crossbars (lazily, in first-use order on both sides), so it
also checks that programming draws the same seeds, tiles and pulses; the second call is steady state.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as F

import sidra_core
import sidra_jax as sj
import sidra_jax.nn as snn
import sidra_torch
from conftest_torch import restore_chip  # noqa: F401  (puts back the chip and seed)

PRESETS = ("ideal", "int8", "y1")
_seeds = itertools.count(9100)


# ---------------------------------------------------------------------------
# The models, twice: PyTorch modules and JAX functions of the same parameters.


class MLP(tnn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = tnn.Linear(20, 300), tnn.Linear(300, 64), tnn.Linear(64, 10)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(F.relu(self.l1(x)))))


def mlp(p, x):
    h = jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"])
    h = jnp.tanh(h @ p["l2"]["w"] + p["l2"]["b"])
    return h @ p["l3"]["w"] + p["l3"]["b"]


class CNN(tnn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = tnn.Conv2d(1, 8, 3, padding=1)
        self.c2 = tnn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = tnn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        return self.fc(x.flatten(1))


def cnn(p, x):
    def conv(x, layer, stride):
        y = jax.lax.conv_general_dilated(x, layer["w"], (stride, stride), ((1, 1), (1, 1)),
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + layer["b"][None, :, None, None]

    x = jax.nn.relu(conv(x, p["c1"], 1))
    x = jax.nn.relu(conv(x, p["c2"], 2))
    return x.reshape(x.shape[0], -1) @ p["fc"]["w"] + p["fc"]["b"]


class LayerNorm(tnn.LayerNorm):
    """nn.LayerNorm through aten.native_layer_norm: under inference_mode sidra_torch sends the composite
    aten.layer_norm to the host (see the report), native_layer_norm to the engine."""

    def forward(self, x):
        return torch.native_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)[0]


class Encoder(tnn.Module):
    """A BERT-style post-LN encoder block."""

    def __init__(self, d=32, heads=4, ffn=64):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (tnn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = LayerNorm(d), LayerNorm(d)
        self.f1, self.f2 = tnn.Linear(d, ffn), tnn.Linear(ffn, d)

    def forward(self, x):
        b, s, d = x.shape
        h, dh = self.heads, d // self.heads

        def split(t):
            return t.view(b, s, h, dh).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        x = self.ln1(x + self.o(a.transpose(1, 2).reshape(b, s, d)))
        return self.ln2(x + self.f2(F.gelu(self.f1(x))))


encoder = snn.encoder_block


def jax_params(module: tnn.Module) -> dict:
    """The JAX parameter pytree of a module: Linear weights as K x N (W^T), conv kernels OIHW."""
    out = {}
    for name, m in module.named_children():
        if isinstance(m, tnn.Linear):
            out[name] = {"w": m.weight.detach().numpy().T.copy(), "b": m.bias.detach().numpy().copy()}
        elif isinstance(m, tnn.Conv2d):
            out[name] = {"w": m.weight.detach().numpy().copy(), "b": m.bias.detach().numpy().copy()}
        elif isinstance(m, tnn.LayerNorm):
            out[name] = {"g": m.weight.detach().numpy().copy(), "b": m.bias.detach().numpy().copy()}
    return out


MODELS = {
    "mlp": (MLP, mlp, (16, 20)),
    "cnn": (CNN, cnn, (4, 1, 8, 8)),
    "encoder": (Encoder, encoder, (2, 8, 32)),
}


def _delta(c0, c1) -> dict:
    return {"latency": c1.cost.latency_s - c0.cost.latency_s, "energy": c1.energy_j - c0.energy_j,
            **{k: getattr(c1, k) - getattr(c0, k) for k in ("mvms", "tile_reads", "engine_ops", "memory_ops",
                                                              "pulses", "cells_programmed", "host_transfers",
                                                              "fallback_ops")}}


def run_torch(module, x, spec, seed, calls=2):
    sidra_torch.manual_seed(seed)
    out = []
    with sidra_torch.use_chip(spec) as chip:
        module.to("sidra")
        xs = torch.from_numpy(x).to("sidra")
        for _ in range(calls):
            c0 = chip.clock.counters
            with torch.inference_mode():
                y = module(xs)
            c1 = chip.clock.counters
            out.append((y.cpu().numpy(), _delta(c0, c1)))
    return out, chip


def run_jax(fn, params, x, spec, seed, calls=2):
    chip = sidra_core.Chip(spec=spec, seed=seed)
    prog = sj.program(params, chip)
    f = sj.jit(fn, transfers=False)
    out = []
    for _ in range(calls):
        c0 = chip.clock.counters
        y = np.asarray(f(prog, x))
        c1 = chip.clock.counters
        out.append((y, _delta(c0, c1)))
    chip.params = prog  # keep the weights (and so their tiles) alive for the caller's checks
    return out, chip


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_parity_outputs_time_energy(model, preset, restore_chip):
    make, fn, xshape = MODELS[model]
    torch.manual_seed(0)
    module = make().eval()
    params = jax_params(module)
    x = np.random.default_rng(1).standard_normal(xshape).astype(np.float32)
    seed = next(_seeds)
    # A fresh chip on both sides: a name no other test uses (the physics ignores the name).
    spec = sidra_core.preset(preset).replace(name=f"{preset}-parity-{seed}")
    t_runs, tchip = run_torch(module, x, spec, seed)
    j_runs, jchip = run_jax(fn, params, x, spec, seed)
    assert tchip.seed == jchip.seed == seed
    for i, ((yt, ct), (yj, cj)) in enumerate(zip(t_runs, j_runs)):
        assert yt.shape == yj.shape
        # ideal: float rounding only; int8 and y1: the same kernels on the same inputs and noise draws
        tol = 1e-5 if preset == "ideal" else 1e-6
        np.testing.assert_allclose(yj, yt, rtol=tol, atol=tol * float(np.abs(yt).max()),
                                   err_msg=f"{model} on {preset}, call {i}")
        for k in ct:
            if k in ("latency", "energy"):
                assert cj[k] == pytest.approx(ct[k], rel=1e-9, abs=1e-18), (model, preset, i, k)
            else:
                assert cj[k] == ct[k], (model, preset, i, k)
        assert cj["mvms"] == len([p for p in jax.tree.leaves(params) if p.ndim >= 2])
    # The first call programmed the crossbars (same pulses on both sides), the second did not.
    assert t_runs[0][1]["cells_programmed"] > 0 and t_runs[1][1]["cells_programmed"] == 0
    assert t_runs[0][1]["latency"] > t_runs[1][1]["latency"]
    # Same tiles on both chips, in the same order.
    assert [r.tile_ids for r in tchip.residents] == [r.tile_ids for r in jchip.residents]
    if preset == "y1":
        # Fresh read noise per call, on both sides alike: the two calls differ.
        assert not np.array_equal(j_runs[0][0], j_runs[1][0])


def test_parity_y1_differs_from_int8_and_float(restore_chip):
    """The parity above is not vacuous: y1 and int8 outputs differ from float and from each other."""
    torch.manual_seed(0)
    module = Encoder().eval()
    params = jax_params(module)
    x = np.random.default_rng(2).standard_normal((2, 8, 32)).astype(np.float32)
    ref = np.asarray(encoder(jax.tree.map(jnp.asarray, params), x))
    outs = {}
    for preset in PRESETS:
        seed = next(_seeds)
        runs, _ = run_jax(encoder, params, x, sidra_core.preset(preset), seed, calls=1)
        outs[preset] = runs[0][0]
    np.testing.assert_allclose(outs["ideal"], ref, rtol=1e-5, atol=1e-5)
    assert np.abs(outs["int8"] - ref).max() > 1e-3
    assert np.abs(outs["y1"] - outs["int8"]).max() > 1e-3


def test_parity_on_the_very_same_chip(restore_chip):
    """A JAX function run on sidra_torch.current_chip(): the steady-state forward costs the same."""
    torch.manual_seed(0)
    module = MLP().eval()
    params = jax_params(module)
    x = np.random.default_rng(3).standard_normal((16, 20)).astype(np.float32)
    seed = next(_seeds)
    sidra_torch.manual_seed(seed)
    with sidra_torch.use_chip(sidra_core.preset("y1").replace(name=f"same-{seed}")) as chip:
        module.to("sidra")
        xs = torch.from_numpy(x).to("sidra")
        with torch.inference_mode():
            module(xs)  # program
            c0 = chip.clock.counters
            y = module(xs)
            c1 = chip.clock.counters  # the forward alone (reading y back costs the host link)
            yt = y.cpu().numpy()
        assert sidra_torch.current_chip() is chip
        prog = sj.program(params, chip)
        f = sj.jit(mlp, transfers=False)
        f(prog, x)  # program the JAX copies
        c2 = chip.clock.counters
        yj = np.asarray(f(prog, x))
        c3 = chip.clock.counters
    dt, dj = _delta(c0, c1), _delta(c2, c3)
    assert dj["latency"] == pytest.approx(dt["latency"], rel=1e-9)
    assert dj["energy"] == pytest.approx(dt["energy"], rel=1e-9)
    assert dj["mvms"] == dt["mvms"] == 3
    # Separate programmings (other seeds, other tiles): close, not equal.
    assert len(chip.residents) == 6
    assert not np.array_equal(yj, yt)
    assert np.corrcoef(yj.ravel(), yt.ravel())[0, 1] > 0.95

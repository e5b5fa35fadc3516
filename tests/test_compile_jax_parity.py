"""torch.compile and sidra_jax are one code path: a PyTorch model compiled for the chip and the same
model as a JAX function (sidra_torch.compiler.to_jax) run by sidra_jax.jit, with the same weights
on chips of the same spec and seed, give the same bits, device time, energy and counters, on the
first call (which programs the crossbars) and in steady state."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn as tnn
import transformers

import sidra_core
import sidra_jax as sj
import sidra_torch
from sidra_torch.compiler import to_jax

from conftest_torch import D, fresh_dynamo, load_minilm, restore_chip  # noqa: F401

transformers.logging.set_verbosity_error()

PRESETS = ("ideal", "int8", "y1")
COUNTERS = ("mvms", "tile_reads", "engine_ops", "memory_ops", "pulses", "cells_programmed", "host_transfers",
            "fallback_ops")
_seeds = itertools.count(9700)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _minilm():
    model, tok = load_minilm()
    enc = tok(["The analog chip multiplies in one step.", "Weights are conductances."], padding=True,
              return_tensors="pt")
    return model, (enc["input_ids"], enc["attention_mask"])


def _gpt2_block():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_positions=32)
    cfg._attn_implementation = "sdpa"  # (unset, transformers logs a warning: a graph break)
    return transformers.models.gpt2.modeling_gpt2.GPT2Block(cfg, layer_idx=0).eval(), (
        torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)),)


def _cnn():
    torch.manual_seed(0)
    model = tnn.Sequential(tnn.Conv2d(1, 8, 3, padding=1), tnn.BatchNorm2d(8), tnn.ReLU(),
                           tnn.Conv2d(8, 16, 3, stride=2, padding=1), tnn.ReLU(), tnn.Flatten(),
                           tnn.Linear(16 * 4 * 4, 10)).eval()
    with torch.no_grad():  # running statistics that are not the identity
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)),)


MODELS = {"minilm": _minilm, "gpt2_block": _gpt2_block, "cnn": _cnn}


def _first(out):
    return (out if isinstance(out, torch.Tensor) else out[0]).cpu().numpy()


def _delta(c0, c1) -> dict:
    return {"latency": c1.cost.latency_s - c0.cost.latency_s, "energy": c1.energy_j - c0.energy_j,
            **{k: getattr(c1, k) - getattr(c0, k) for k in COUNTERS}}


def run_compiled(model, inputs, spec, seed, calls=2):
    sidra_torch.manual_seed(seed)
    out = []
    with sidra_torch.use_chip(spec) as chip:
        dev = copy.deepcopy(model).to(D)
        xs = [x.to(D) for x in inputs]
        compiled = torch.compile(dev, backend="sidra")
        with torch.no_grad():
            for _ in range(calls):
                c0 = chip.clock.counters
                y = compiled(*xs)
                c1 = chip.clock.counters
                out.append((_first(y), _delta(c0, c1)))
    return out


def run_jax(fn, params, inputs, spec, seed, calls=2):
    chip = sidra_core.Chip(spec=spec, seed=seed)
    prog = sj.program(params, chip)
    f = sj.jit(fn, transfers=False, graph=True)
    xs = [x.numpy().astype(np.int32) if x.dtype == torch.int64 else x.numpy() for x in inputs]
    out = []
    for _ in range(calls):
        c0 = chip.clock.counters
        y = f(prog, *xs)
        c1 = chip.clock.counters
        out.append((np.asarray(y[0]), _delta(c0, c1)))
    return out


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_torch_compile_equals_sidra_jax(name, preset, restore_chip):
    model, inputs = MODELS[name]()
    fn, params = to_jax(model, *inputs)
    seed = next(_seeds)
    spec = sidra_core.preset(preset).replace(name=f"{preset}-compile-jax-{seed}")
    t_runs = run_compiled(model, inputs, spec, seed)
    j_runs = run_jax(fn, params, inputs, spec, seed)
    for i, ((yt, ct), (yj, cj)) in enumerate(zip(t_runs, j_runs)):
        assert yt.dtype == yj.dtype and np.array_equal(yt, yj), (name, preset, i, float(np.abs(yt - yj).max()))
        for k in ct:
            if k in ("latency", "energy"):
                assert cj[k] == pytest.approx(ct[k], rel=1e-9, abs=1e-18), (name, preset, i, k)
            else:
                assert cj[k] == ct[k], (name, preset, i, k)
    assert t_runs[0][1]["mvms"] > 0 and t_runs[0][1]["cells_programmed"] > 0 == t_runs[1][1]["cells_programmed"]
    if preset == "y1":  # fresh read noise per call on both sides: not the same output twice
        assert not np.array_equal(t_runs[0][0], t_runs[1][0])


def test_to_jax_names_the_ops_it_cannot_lower():
    model = tnn.Sequential(tnn.Linear(4, 4), tnn.Hardswish())  # an op without a lowering
    with pytest.raises(NotImplementedError, match="hardswish"):
        to_jax(model.eval(), torch.randn(2, 4))

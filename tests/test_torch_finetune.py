"""On-chip fine-tuning and drift (issue 6, deliverables 3 and 4).

Fine-tuning as the SIDRA documentation describes it: freeze all but the last
layer, `loss.backward()` (gradients on the host), a stock `torch.optim`
optimizer `step()`; the next forward rewrites only the cells of the last
layer whose targets changed, incrementally by ISPP write-verify from their
present conductance, and counts pulses, programming time, energy and per-cell
writes (endurance). Full-model training works too and warns about endurance.

Drift: a programmed model read an hour and a year after programming, with and
without global drift compensation.

Each test uses its own physical chip (`use_chip(preset, seed=...)`): chips
persist per (spec, seed) in the process, and the full-training warning is
issued once per chip.
"""

from __future__ import annotations

import copy
import gc
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sidra_core
import sidra_torch
from sidra_torch.weights import residents_of

from conftest_torch import D, Delta, restore_chip  # noqa: F401

K_IN, HIDDEN, CLASSES = 32, 64, 10
HOUR, YEAR = 3600.0, 365 * 86400.0


def _task(seed: int = 0, n: int = 256):
    """A synthetic 10-class task: labels from a random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(K_IN, CLASSES, generator=g)
    x = torch.randn(n, K_IN, generator=g)
    return x, (x @ teacher).argmax(1)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(K_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


_PRETRAINED = {}


def _pretrained() -> nn.Sequential:
    """The MLP trained on the task on the CPU (float32), cached for the module."""
    if "m" not in _PRETRAINED:
        torch.manual_seed(0)
        model = _mlp()
        x, y = _task()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(80):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        _PRETRAINED["m"] = model.eval()
    return _PRETRAINED["m"]


def _swapped_task():
    """The fine-tuning task: classes 0 and 1 swapped, so the last layer has to change."""
    x, y = _task()
    perm = torch.arange(CLASSES)
    perm[0], perm[1] = 1, 0
    return x, perm[y]


def _freeze_all_but_last(m: nn.Sequential) -> nn.Module:
    for p in m.parameters():
        p.requires_grad_(False)
    last = m[-1]
    for p in last.parameters():
        p.requires_grad_(True)
    return last


def _layers(m: nn.Sequential) -> list[nn.Linear]:
    return [mod for mod in m if isinstance(mod, nn.Linear)]


def _state(res) -> dict:
    st = res.state
    return {k: getattr(st, k).copy() for k in ("writes_plus", "writes_minus", "g_plus", "g_minus",
                                                "t_prog_plus", "t_prog_minus", "codes")}


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05),
    "adam": lambda params: torch.optim.Adam(params, lr=3e-3),
}


# ---------------------------------------------------------------------------
# last-layer fine-tuning


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_last_layer_finetuning_reprograms_only_the_last_layer_incrementally(restore_chip, opt_name):
    x, y = _swapped_task()
    with sidra_torch.use_chip("y1", seed=610 + len(opt_name)) as chip:
        sidra_torch.manual_seed(0)
        m = copy.deepcopy(_pretrained()).to(D)
        last = _freeze_all_but_last(m)
        opt = OPTIMIZERS[opt_name](last.parameters())
        xd, yd = x.to(D), y.to(D)
        with torch.no_grad():
            m(xd)  # program every layer
        residents = [residents_of(layer.weight) for layer in _layers(m)]
        assert all(len(r) == 1 for r in residents)
        residents = [r[0] for r in residents]
        head = residents[-1]
        k, n = head.shape
        layer_cells = 2 * k * n  # both cells of each differential pair
        first = [_state(r) for r in residents]
        frozen_states = [r.state for r in residents[:-1]]
        initial_cells = head.state.programming.cells_written
        losses, per_step = [], []
        with Delta() as total, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(6):
                before = _state(head)
                with Delta() as d:
                    opt.zero_grad()
                    loss = F.cross_entropy(m(xd), yd)  # this forward rewrites what the last step changed
                    loss.backward()
                    opt.step()
                losses.append(loss.item())
                if step == 0:
                    assert d["cells_programmed"] == 0 and d["pulses"] == 0  # nothing changed yet
                    continue
                per_step.append(d["cells_programmed"])
                # Incremental: a pair whose code did not change is not touched ...
                changed = head.state.codes != before["codes"]
                dw = (head.state.writes_plus - before["writes_plus"]) + (head.state.writes_minus - before["writes_minus"])
                assert np.all(dw[~changed] == 0)
                assert np.all(head.state.g_plus[~changed] == before["g_plus"][~changed])
                # ... at most one cell per changed pair is rewritten (plus its partner on a sign flip).
                assert 0 < d["cells_programmed"] <= 2 * int(changed.sum())
                assert d["cells_programmed"] == head.state.programming.cells_written
                assert d["pulses"] == head.state.programming.pulses >= d["cells_programmed"]
        # The loss goes down on the noisy chip.
        assert losses[-1] < 0.95 * losses[0], losses
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
        # Last-layer fine-tuning is what Y1 is built for: no endurance warning.
        assert not [w for w in caught if issubclass(w.category, sidra_core.EnduranceWarning)]
        # Frozen layers are not reprogrammed at all (not even a no-op rewrite) ...
        assert all(r.state is st for r, st in zip(residents[:-1], frozen_states))
        # ... so their tiles are untouched: same cells, same conductances, same write counts.
        for r, s in zip(residents[:-1], first[:-1]):
            assert residents_of(_layers(m)[residents.index(r)].weight) == [r]
            for key in ("writes_plus", "writes_minus", "g_plus", "g_minus", "t_prog_plus", "t_prog_minus"):
                np.testing.assert_array_equal(getattr(r.state, key), s[key], err_msg=key)
        # The last layer's cells were rewritten: endurance counts grow.
        s = first[-1]
        grown = (head.state.writes_plus + head.state.writes_minus) - (s["writes_plus"] + s["writes_minus"])
        assert grown.min() >= 0 and grown.sum() > 0
        assert (grown > 0).sum() >= max(per_step)  # many cells, not one cell many times
        # Pulses, programming time and energy are counted.
        assert total["pulses"] > total["cells_programmed"] > 0
        assert total["energy_programming_j"] > 0
        prog = sidra_core.cost.programming(total["pulses"], chip.spec)
        assert total["busy_s"] >= prog.latency_s > 0
        assert total["energy_programming_j"] == pytest.approx(prog.energy_j, rel=1e-6)
        # Each step rewrites a fraction of the layer, less than programming it afresh. Adam's
        # first update moves every weight by ~lr (over a code for most), later steps far fewer.
        assert per_step[0] < 0.5 * layer_cells, (per_step, layer_cells)
        assert max(per_step[1:]) < 0.25 * layer_cells, (per_step, layer_cells)
        assert max(per_step) < initial_cells
        assert total["fallback_ops"] > 0  # the backward runs on the host


def test_reprogrammed_cells_carry_write_verify_error(restore_chip):
    """A rewritten cell lands within the ISPP verify window (plus relaxation), not exactly on target."""
    x, y = _swapped_task()
    with sidra_torch.use_chip("y1", seed=620) as chip:
        sidra_torch.manual_seed(0)
        m = copy.deepcopy(_pretrained()).to(D)
        last = _freeze_all_but_last(m)
        opt = torch.optim.SGD(last.parameters(), lr=0.05)
        xd, yd = x.to(D), y.to(D)
        head = None
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(m(xd), yd).backward()
            opt.step()
            head = head or residents_of(last.weight)[0]
        before = _state(head)
        with torch.no_grad():
            m(xd)  # reprogram
        st = head.state
        t = chip.spec.tile
        dg = (t.g_max - t.g_min) / 127
        written = (st.writes_plus != before["writes_plus"]) & (st.stuck_plus == 0)
        assert written.sum() > 10
        target = t.g_min + np.maximum(st.codes.astype(np.float32), 0) * dg
        err = (st.g_plus - target)[written] / t.g_max
        assert np.abs(err).max() > 1e-4  # write-verify leaves an error ...
        assert np.abs(err).mean() < 0.02  # ... of the order of the verify window (1-2 % of G_max)


def test_full_model_training_reprograms_every_layer_and_warns(restore_chip):
    x, y = _swapped_task()
    with sidra_torch.use_chip("y1", seed=630):
        sidra_torch.manual_seed(0)
        m = copy.deepcopy(_pretrained()).to(D)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        xd, yd = x.to(D), y.to(D)
        with torch.no_grad():
            m(xd)
        residents = [residents_of(layer.weight)[0] for layer in _layers(m)]
        first = [_state(r) for r in residents]
        losses = []
        with pytest.warns(sidra_core.EnduranceWarning, match="more than one layer"):
            for _ in range(5):
                opt.zero_grad()
                loss = F.cross_entropy(m(xd), yd)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        assert losses[-1] < losses[0]
        for r, s in zip(residents, first):
            grown = (r.state.writes_plus + r.state.writes_minus) - (s["writes_plus"] + s["writes_minus"])
            assert grown.sum() > 0, r.name  # every layer was rewritten


def test_endurance_limit_warns_and_is_reported(restore_chip):
    """Cells written past the endurance limit are counted in the programming report, with a warning."""
    x, y = _swapped_task()
    with sidra_torch.use_chip("y1", seed=640, ispp__endurance=60.0) as chip:
        sidra_torch.manual_seed(0)
        m = copy.deepcopy(_pretrained()).to(D)
        last = _freeze_all_but_last(m)
        opt = torch.optim.Adam(last.parameters(), lr=1e-2)
        xd, yd = x.to(D), y.to(D)
        with pytest.warns(sidra_core.EnduranceWarning, match="more than their endurance"):
            for _ in range(8):
                opt.zero_grad()
                F.cross_entropy(m(xd), yd).backward()
                opt.step()
            with torch.no_grad():
                m(xd)
        head = residents_of(last.weight)[0]
        worn = np.maximum(head.state.writes_plus, head.state.writes_minus) > chip.spec.ispp.endurance
        assert worn.any()
        assert head.state.programming.endurance_exceeded == int(
            (head.state.writes_plus > 60).sum() + (head.state.writes_minus > 60).sum())
        assert head.state.programming.max_writes_cell > 60


def test_last_layer_finetuning_of_two_models_in_turn_does_not_warn(restore_chip):
    x, y = _swapped_task()
    with sidra_torch.use_chip("y1", seed=650):
        sidra_torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                m = copy.deepcopy(_pretrained()).to(D)
                last = _freeze_all_but_last(m)
                opt = torch.optim.SGD(last.parameters(), lr=0.05)
                xd, yd = x.to(D), y.to(D)
                for _ in range(3):
                    opt.zero_grad()
                    F.cross_entropy(m(xd), yd).backward()
                    opt.step()
                with torch.no_grad():
                    m(xd)
                del m, last, opt
                gc.collect()
        assert not [w for w in caught if issubclass(w.category, sidra_core.EnduranceWarning)]


# ---------------------------------------------------------------------------
# drift


def _drift_readings(seed: int):
    """Relative output error and agreement with the float model at 1 hour and 1 year, without and with
    compensation, for an MLP on the y1 chip.

    The MLP is freshly initialised, not the trained one: the trained model's large logits clip in the
    ADC at the current full-scale setting (see the issue-6 report), which would hide the drift."""
    torch.manual_seed(seed)
    model = _mlp().eval()
    x = torch.randn(2000, K_IN, generator=torch.Generator().manual_seed(100 + seed))
    with torch.no_grad():
        ref = model(x)
    labels = ref.argmax(1)
    out = {}
    with sidra_torch.use_chip("y1", seed=700 + seed) as chip:
        sidra_torch.manual_seed(seed)
        m = copy.deepcopy(model).to(D)
        xd = x.to(D)

        def read():
            with torch.no_grad():
                o = m(xd).cpu()
            return ((o - ref).norm() / ref.norm()).item(), (o.argmax(1) == labels).float().mean().item() * 100

        with torch.no_grad():
            m(xd[:1])  # program
        t_prog = sidra_torch.device_time()
        for label, age in (("1h", HOUR), ("1y", YEAR)):
            sidra_torch.advance(t_prog + age - sidra_torch.device_time())
            out[label] = read()
            with sidra_torch.drift_compensation(True):
                assert chip.spec.noise.drift_compensation
                out[label + "+comp"] = read()
            assert not chip.spec.noise.drift_compensation  # the block restores the setting
        out["1y again"] = read()
    return out


@pytest.mark.parametrize("seed", [0, 2])
def test_drift_after_a_year_and_compensation(restore_chip, seed):
    r = _drift_readings(seed)
    err = {k: v[0] for k, v in r.items()}
    agree = {k: v[1] for k, v in r.items()}
    # A year of drift: outputs further from the float model, fewer of its decisions kept.
    assert err["1y"] > 1.3 * err["1h"], err
    assert agree["1y"] < agree["1h"] - 2.0, agree
    # Global drift compensation recovers part of it (not all: the cells drift apart, not just down).
    assert err["1y+comp"] < err["1y"] - 0.25 * (err["1y"] - err["1h"]), err
    assert agree["1y+comp"] > agree["1y"] + 1.0, agree
    assert err["1y+comp"] > err["1h+comp"]
    # Reads are reproducible apart from the fresh read noise of each read.
    assert abs(err["1y again"] - err["1y"]) < 0.1 * err["1y"]


def test_drift_is_reproducible_with_fixed_seeds(restore_chip):
    assert _drift_readings(0) == _drift_readings(0)


def test_drift_compensation_undoes_a_uniform_drift(restore_chip):
    """Every written cell drifting alike (nu = 0.05, no spread) is what a global gain can undo."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)).eval()
    x = torch.randn(500, K_IN, generator=torch.Generator().manual_seed(1)).to(D)
    with sidra_torch.use_chip("int8", seed=801, noise__drift_nu_mean=0.05, adc__full_scale=0.25), torch.no_grad():
        m = copy.deepcopy(model).to(D)
        fresh = m(x).cpu()
        sidra_torch.advance(YEAR)
        drifted = m(x).cpu()
        with sidra_torch.drift_compensation(True):
            compensated = m(x).cpu()
    err = lambda y: ((y - fresh).norm() / fresh.norm()).item()  # noqa: E731
    assert err(drifted) > 0.3  # a year of nu = 0.05 halves the conductances
    assert err(compensated) < 0.25 * err(drifted), (err(drifted), err(compensated))

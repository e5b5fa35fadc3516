"""A plan's repeated blocks (sidra_jax.repeats): a model's layers compile once and run as often as
they repeat, with the same bits, device time, energy, counters and gradients as one program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sidra_core
import sidra_jax
from sidra_jax import execute, repeats

COUNTERS = ("mvms", "tile_reads", "engine_ops", "memory_ops", "pulses", "cells_programmed")


def _params(layers, d=64, seed=0):
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((d, d)).astype(np.float32) / 8 for i in range(layers)} | {
        f"b{i}": rng.standard_normal(d).astype(np.float32) / 10 for i in range(layers)}


def _model(layers, eps=lambda i: 1e-5, consts=None):
    def f(p, x, mask):
        for i in range(layers):
            h = jax.nn.relu(x @ p[f"w{i}"] + p[f"b{i}"]) * mask  # the mask: read by every layer
            if consts is not None:
                h = h + consts[i]
            x = sidra_jax.nn.layer_norm(x + h, eps=eps(i))
        return x.sum(-1)
    return f


def _run(f, params, args, preset, chained: bool, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(execute, "split", repeats.blocks if chained else (lambda plan: None))
        chip = sidra_core.Chip.create(preset, seed=3)
        w = sidra_jax.program(params, chip)
        g = sidra_jax.jit(f)
        outs, deltas = [], []
        for _ in range(2):  # the first call programs the crossbars
            c0 = chip.clock.counters
            outs.append(np.asarray(g(w, *args)))
            c1 = chip.clock.counters
            deltas.append((c1.cost.latency_s - c0.cost.latency_s, c1.energy_j - c0.energy_j,
                           *(getattr(c1, k) - getattr(c0, k) for k in COUNTERS)))
        grads = jax.grad(lambda w: g(w, *args).sum())(w)
        plan = next(iter(g._plans.values()))
        return outs, deltas, [np.asarray(v) for v in jax.tree.leaves(grads)], plan


def _planned(layers):
    """(the plan of a `layers`-layer model after one call, its chip)."""
    chip = sidra_core.Chip.create("int8", seed=0)
    w = sidra_jax.program(_params(layers), chip)
    g = sidra_jax.jit(_model(layers))
    g(w, *_args())
    return next(iter(g._plans.values())), chip


def _chained_is_one_program(f, p, args, monkeypatch):
    """Run f chained and as one program (int8): the same outputs and charges. Returns the chained plan."""
    outs, deltas, _, plan = _run(f, p, args, "int8", True, monkeypatch)
    ref_outs, ref_deltas, _, _ = _run(f, p, args, "int8", False, monkeypatch)
    assert all(np.array_equal(a, b) for a, b in zip(outs, ref_outs)) and deltas == ref_deltas
    return plan


def _args(d=64):
    rng = np.random.default_rng(1)
    return rng.standard_normal((16, d)).astype(np.float32), (rng.random((16, d)) > 0.2).astype(np.float32)


@pytest.mark.parametrize("preset", ["int8", "y1"])
def test_repeated_layers_share_programs_and_give_one_programs_bits(preset, monkeypatch):
    f, p, args = _model(6), _params(6), _args()
    outs, deltas, grads, plan = _run(f, p, args, preset, True, monkeypatch)
    assert isinstance(plan.executor, execute._Chained)
    assert plan.executor.programs < len(plan.executor.steps) and len(plan.executor.steps) >= 6
    ref_outs, ref_deltas, ref_grads, ref_plan = _run(f, p, args, preset, False, monkeypatch)
    assert not isinstance(ref_plan.executor, execute._Chained)
    for a, b in zip(outs, ref_outs):
        assert np.array_equal(a, b)
    assert deltas == ref_deltas
    for a, b in zip(grads, ref_grads):
        assert np.array_equal(a, b)
    if preset == "y1":  # fresh read noise per call: not the same output twice
        assert not np.array_equal(outs[0], outs[1])


def _eps(block) -> list:
    return [i.meta["kw"]["eps"] for i in block.instrs if i.meta.get("op") == "layer_norm"]


def test_layers_that_differ_do_not_share_a_program(monkeypatch):
    """Another layer-norm eps every other layer: blocks share a program only with blocks of the same
    eps, and the results are still one program's. A different constant added in each layer is data
    (an argument of the block), so those layers share as plain ones do."""
    p, args = _params(6), _args()
    plain = _run(_model(6), p, args, "int8", True, monkeypatch)[3].executor.programs
    ex = _chained_is_one_program(_model(6, eps=lambda i: 1e-5 if i % 2 else 1e-3), p, args, monkeypatch).executor
    assert ex.programs > plain
    for fn, b in ex.steps:
        for fn2, b2 in ex.steps:
            if fn is fn2:
                assert _eps(b) == _eps(b2)
    consts = [jnp.full((64,), 0.01 * i, jnp.float32) for i in range(6)]
    assert _chained_is_one_program(_model(6, consts=consts), p, args, monkeypatch).executor.programs == plain


def test_blocks_are_split_where_xlas_dots_read_the_crossbars(monkeypatch):
    """Where the VNNI kernel reads (an MVM is one custom call) the plan stays one program."""
    plan, chip = _planned(6)
    for vnni in (True, False):
        monkeypatch.setattr(execute.host, "vnni_dots", lambda: vnni)
        assert (execute.split(plan) is None) == vnni
        assert isinstance(execute.executor(plan, chip.spec), execute._Chained) != vnni


def test_a_plan_without_repeats_is_one_program():
    plan, _ = _planned(1)
    assert repeats.blocks(plan) is None and not isinstance(plan.executor, execute._Chained)


def test_cuts_keep_every_value_a_later_block_reads():
    plan, _ = _planned(6)
    bl = repeats.blocks(plan)
    defined = set(plan.in_refs) | set(plan.const_refs)
    for b in bl:
        assert set(b.args) <= defined and sum(i.wref is not None for i in b.instrs) >= 1
        defined |= set(b.outs)
    assert [i for b in bl for i in b.instrs] == plan.instrs

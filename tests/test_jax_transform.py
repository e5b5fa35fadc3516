"""sidra_jax.jit: placement, costs (sidra_core.cost of the shapes), straight-through gradients, Flax,
the profiler, reprogramming, drift, fallbacks and errors."""

from __future__ import annotations

import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sidra_core
import sidra_jax as sj
import sidra_jax.nn as snn
from sidra_core import cost
from sidra_core.cost import ZERO, COMPONENTS

from test_jax_parity import cnn, encoder, jax_params, mlp, CNN, Encoder, MLP  # noqa: E402  (the shared models)

RNG = np.random.default_rng(0)


def _params(make):
    import torch

    torch.manual_seed(0)
    return jax_params(make().eval())


def _x(*shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _sum(costs):
    total = ZERO
    for c in costs:
        total = total + c
    return total


def _assert_cost(actual, expected):
    assert actual.latency_s == pytest.approx(expected.latency_s, rel=1e-12)
    for c in COMPONENTS:
        assert getattr(actual, c) == pytest.approx(getattr(expected, c), rel=1e-12, abs=1e-24), c


# ---------------------------------------------------------------------------
# costs = sidra_core.cost of the jaxpr's shapes


def test_mlp_cost_is_sidra_core_cost_of_the_shapes():
    chip = sidra_core.Chip.create("y1", seed=1)
    spec = chip.spec
    prog = sj.program(_params(MLP), chip)
    x = _x(16, 20)
    f = sj.jit(mlp)  # transfers=True: x in, y out over the host link
    expected = _sum([cost.host_transfer(16 * 20 * 4, spec),
                     cost.mvm(16, 20, 300, spec), cost.engine("relu", 16 * 300, spec),
                     cost.mvm(16, 300, 64, spec), cost.engine("tanh", 16 * 64, spec),
                     cost.mvm(16, 64, 10, spec), cost.host_transfer(16 * 10 * 4, spec)])
    expected = expected.with_background(spec.cost.background_w)  # y1 draws background power while busy
    _assert_cost(f.cost(prog, x), expected)
    f(prog, x)  # first call: programming on top
    c0 = chip.clock.counters
    f(prog, x)
    c1 = chip.clock.counters
    _assert_cost(c1.cost + c0.cost.scaled(-1), expected)
    assert c1.mvms - c0.mvms == 3
    assert c1.tile_reads - c0.tile_reads == 16 * (2 + 2 + 1)  # 300 columns (rows) span two 256-wide tiles
    assert c1.engine_ops - c0.engine_ops == 2
    assert c1.host_transfers - c0.host_transfers == 2
    assert c1.pulses == c0.pulses


def test_cnn_and_attention_costs():
    spec = sidra_core.preset("int8")
    chip = sidra_core.Chip(spec=spec)
    prog = sj.program(_params(CNN), chip)
    x = _x(4, 1, 8, 8)
    expected = _sum([cost.conv(4, 64, 9, 8, spec), cost.engine("relu", 4 * 8 * 64, spec),
                     cost.conv(4, 16, 72, 16, spec), cost.engine("relu", 4 * 16 * 16, spec),
                     cost.mvm(4, 256, 10, spec)])
    _assert_cost(sj.jit(cnn, transfers=False).cost(prog, x), expected)

    prog = sj.program(_params(Encoder), chip)
    b, s, d, h, f = 2, 8, 32, 4, 64
    n = b * s * d
    expected = _sum([cost.mvm(b * s, d, d, spec)] * 3 + [
        cost.engine_matmul(b * h, s, d // h, s, spec), cost.engine("elementwise", b * h * s * s, spec),
        cost.engine("softmax", b * h * s * s, spec), cost.engine_matmul(b * h, s, s, d // h, spec),
        cost.mvm(b * s, d, d, spec), cost.engine("elementwise", n, spec), cost.engine("layer_norm", n, spec),
        cost.mvm(b * s, d, f, spec), cost.engine("gelu", b * s * f, spec), cost.mvm(b * s, f, d, spec),
        cost.engine("elementwise", n, spec), cost.engine("layer_norm", n, spec)])
    rep = sj.jit(encoder, transfers=False).report(prog, _x(b, s, d))
    _assert_cost(rep.total, expected)
    assert rep.counts == {"mvms": 6, "tile_reads": 6 * b * s, "engine_ops": 9}
    assert len(rep.weights) == 6 and rep.plan.fused_bias == 6
    table = rep.table()
    for name in ("sidra::linear", "sidra::attention", "sidra::layer_norm", "sidra::gelu"):
        assert name in table


def test_host_fallback_and_memory_ops_are_priced_like_sidra_torch():
    spec = sidra_core.preset("int8")
    chip = sidra_core.Chip(spec=spec)
    x = _x(2, 4, 8, 8)

    def pool_cat(x):
        y = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        return jnp.concatenate([y, y], axis=1)

    f = sj.jit(pool_cat, chip, transfers=False)
    c0 = chip.clock.counters
    out = f(x)
    c1 = chip.clock.counters
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pool_cat(x)))
    in_b, out_b = x.nbytes, x.nbytes // 4
    _assert_cost(c1.cost + c0.cost.scaled(-1),
                 cost.host_transfer(in_b + out_b, spec, 2) + cost.memory(2 * out_b, spec, "sram"))
    assert (c1.fallback_ops - c0.fallback_ops, c1.host_transfers - c0.host_transfers,
            c1.memory_ops - c0.memory_ops) == (1, 2, 1)


def test_unprogrammed_weights_are_activations():
    """Weights are marked by programming them, not guessed: plain arrays go to the engine's matmul."""
    spec = sidra_core.preset("ideal")
    chip = sidra_core.Chip(spec=spec)
    p = jax.tree.map(jnp.asarray, _params(MLP))
    x = _x(16, 20)
    f = sj.jit(mlp, chip, transfers=False)
    rep = f.report(p, x)
    assert rep.counts.get("mvms", 0) == 0 and not rep.weights
    assert any(r.name == "sidra::matmul" for r in rep.records)
    np.testing.assert_allclose(np.asarray(f(p, x)), np.asarray(mlp(p, x)), rtol=1e-5, atol=1e-6)
    assert chip.residents == []


# ---------------------------------------------------------------------------
# numerics and placement details


def test_ideal_chip_equals_plain_jax_for_views_groups_and_padding():
    chip = sidra_core.Chip.create("ideal")
    w = RNG.standard_normal((12, 20)).astype(np.float32)  # used as (x @ W.T) and (W @ x.T)
    k_hwio = RNG.standard_normal((4, 4, 2, 6)).astype(np.float32)  # even kernel, SAME: asymmetric padding
    k_grp = RNG.standard_normal((6, 1, 3, 3)).astype(np.float32)  # depthwise: groups = 6, OIHW
    b = RNG.standard_normal(20).astype(np.float32)
    params = {"w": w, "k": k_hwio, "g": k_grp, "b": b}
    x = _x(5, 20)
    img = _x(2, 7, 7, 2)

    def fn(p, x, img):
        y1 = x @ p["w"].T  # K=20 x N=12
        y2 = p["w"] @ x.T  # weight on the left
        y3 = jax.lax.conv_general_dilated(img, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y4 = jax.lax.conv_general_dilated(y3.transpose(0, 3, 1, 2), p["g"], (2, 2), ((1, 1), (1, 1)),
                                          dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=6)
        y5 = (x @ p["w"].T) @ p["w"] + p["b"]  # the same weight in two orientations, bias fused
        return y1, y2, y3, y4, y5

    prog = sj.program(params, chip)
    f = sj.jit(fn, transfers=False)
    got = f(prog, x, img)
    ref = fn(jax.tree.map(jnp.asarray, params), x, img)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)
    rep = f.report(prog, x, img)
    assert rep.counts["mvms"] == 6
    names = sorted(n for n, _, _ in rep.weights)
    # W^T (K=20, N=12) for x @ W.T and W @ x.T (one crossbar copy), W as is (12 x 20) for y5's second matmul
    assert sorted((k, n) for _, k, n in rep.weights) == sorted([(20, 12), (12, 20), (32, 6), (54, 6)])
    assert names.count("['w']") == 2 and len(chip.residents) == 4
    assert rep.plan.fused_bias == 1


def test_bias_used_elsewhere_is_not_fused_and_stays_correct():
    chip = sidra_core.Chip.create("int8")
    p = sj.program({"w": RNG.standard_normal((8, 8)).astype(np.float32), "b": np.ones(8, np.float32)}, chip)
    f = sj.jit(lambda p, x: (lambda y: (y + p["b"], y * 2.0))(x @ p["w"]), transfers=False)
    a, b2 = f(p, _x(3, 8))
    assert f.plan(p, _x(3, 8)).fused_bias == 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b2) / 2 + 1, rtol=1e-2, atol=1e-2)


def test_engine_precision_rounds_elementwise_results():
    chip = sidra_core.Chip.create("int8")  # fp16 engine
    x = jnp.asarray([1.0 + 2 ** -12, 3.0], jnp.float32)
    y = sj.jit(lambda x: x * 1.0 + 0.0, chip, transfers=False)(x)
    assert float(y[0]) == 1.0  # rounded to fp16
    chip32 = sidra_core.Chip.create("ideal")
    assert float(sj.jit(lambda x: x * 1.0 + 0.0, chip32, transfers=False)(x)[0]) == 1.0 + 2 ** -12


def test_nn_ops_on_plain_jax_are_the_exact_functions():
    x = jnp.asarray(_x(3, 7))
    g, b = jnp.asarray(_x(7, seed=2)), jnp.asarray(_x(7, seed=3))
    np.testing.assert_allclose(snn.gelu(x), jax.nn.gelu(x, approximate=False), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(snn.gelu(x, approximate=True), jax.nn.gelu(x, approximate=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(snn.softmax(x, axis=0), jax.nn.softmax(x, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(snn.log_softmax(x), jax.nn.log_softmax(x), rtol=1e-5, atol=1e-5)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    np.testing.assert_allclose(snn.layer_norm(x, g, b, eps=1e-5), (x - mean) / jnp.sqrt(var + 1e-5) * g + b,
                               rtol=1e-4, atol=1e-5)
    for fn, ref in ((snn.relu, jax.nn.relu), (snn.tanh, jnp.tanh), (snn.sigmoid, jax.nn.sigmoid),
                    (snn.silu, jax.nn.silu)):
        np.testing.assert_allclose(fn(x), ref(x), rtol=1e-5, atol=1e-6)
    assert jax.grad(lambda x: snn.layer_norm(x, g, b).sum())(x).shape == x.shape
    q, k, v = (jnp.asarray(_x(2, 5, 3, 8, seed=s)) for s in (4, 5, 6))
    np.testing.assert_allclose(snn.dot_product_attention(q, k, v), jax.nn.dot_product_attention(q, k, v),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(snn.dot_product_attention(q, k, v, scale=0.2),
                               jax.nn.dot_product_attention(q, k, v, scale=0.2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["int8", "y1"])
def test_dot_product_attention_is_one_engine_attention_priced_as_sidra_torchs(preset):
    """snn.dot_product_attention on the chip: engine.attention at the chip's precision and matmul mode
    (the same call sidra_torch makes for scaled_dot_product_attention), its four ops' cost."""
    chip = sidra_core.Chip.create(preset, seed=0)
    spec = chip.spec
    q, k, v = (jnp.asarray(_x(2, 9, 4, 16, seed=s)) for s in (1, 2, 3))
    f = sj.jit(lambda q, k, v: snn.dot_product_attention(q, k, v), chip, transfers=False)
    want = sidra_core.engine.attention(q, k, v, scale=0.25, precision=spec.engine.precision, mode=spec.engine.matmul,
                                       layout="bshd")
    np.testing.assert_array_equal(np.asarray(f(q, k, v)), np.asarray(want))
    _assert_cost(f.cost(q, k, v), _sum(cost.attention(2 * 4, 9, 16, 9, 16, spec)).with_background(spec.cost.background_w))
    rep = f.report(q, k, v)
    assert rep.counts == {"engine_ops": 4} and "sidra::attention" in rep.table()


def test_unmarked_jax_nn_gelu_still_runs_on_the_engine():
    chip = sidra_core.Chip.create("ideal")
    x = jnp.asarray(_x(4, 6))
    f = sj.jit(lambda x: jax.nn.softmax(jax.nn.gelu(x), axis=-1), chip, transfers=False)
    np.testing.assert_allclose(np.asarray(f(x)), jax.nn.softmax(jax.nn.gelu(x), axis=-1), rtol=1e-5, atol=1e-6)
    rep = f.report(x)
    assert rep.counts["engine_ops"] > 2 and all(r.where in ("engine", "host") for r in rep.records)


# ---------------------------------------------------------------------------
# gradients: straight-through (the digital exact derivative at the device's forward values)


@pytest.mark.parametrize("model", ["mlp", "cnn", "encoder"])
def test_grad_on_ideal_chip_equals_plain_jax_grad(model):
    make, fn, shape = {"mlp": (MLP, mlp, (8, 20)), "cnn": (CNN, cnn, (2, 1, 8, 8)),
                       "encoder": (Encoder, encoder, (2, 8, 32))}[model]
    params = _params(make)
    x = _x(*shape)
    chip = sidra_core.Chip.create("ideal")
    prog = sj.program(params, chip)
    f = sj.jit(fn, transfers=False)
    c = jnp.asarray(_x(*np.shape(fn(jax.tree.map(jnp.asarray, params), x)), seed=5))
    gp, gx = jax.grad(lambda p, x: jnp.sum(f(p, x) * c), argnums=(0, 1))(prog, x)
    rp, rx = jax.grad(lambda p, x: jnp.sum(fn(p, x) * c), argnums=(0, 1))(jax.tree.map(jnp.asarray, params), x)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-4, atol=1e-5)
    for a, r in zip(jax.tree.leaves(sj.unprogram(gp)), jax.tree.leaves(rp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_grad_of_a_noisy_crossbar_is_the_exact_matmul_grad():
    chip = sidra_core.Chip.create("y1", seed=4)
    w, b = _x(40, 12, seed=6), _x(12, seed=7)
    x, c = _x(5, 40, seed=8), _x(5, 12, seed=9)
    prog = sj.program({"w": w, "b": b}, chip)
    f = sj.jit(lambda p, x: x @ p["w"] + p["b"], transfers=False)
    y = np.asarray(f(prog, x))
    assert np.abs(y - (x @ w + b)).max() > 1e-4  # the forward is the device's
    gp, gx = jax.grad(lambda p, x: jnp.sum(f(p, x) * c), argnums=(0, 1))(prog, x)
    np.testing.assert_allclose(np.asarray(gp["w"].value), x.T @ c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gp["b"].value), c.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx), c @ w.T, rtol=1e-5, atol=1e-5)


def test_grad_through_two_noisy_layers_is_straight_through():
    """d/dW2 = relu_dev(a1)^T c, d/da1 = (c W2^T) * (a1 > 0), d/dW1 = x^T d/da1: exact rules at the
    device's forward values a1 (noisy MVM) and relu_dev(a1) (rounded to the engine's fp16)."""
    chip = sidra_core.Chip.create("y1", seed=5)
    w1, w2 = _x(30, 20, seed=10), _x(20, 6, seed=11)
    x, c = _x(7, 30, seed=12), _x(7, 6, seed=13)
    prog = sj.program({"w1": w1, "w2": w2}, chip)

    def net(p, x):
        a1 = x @ p["w1"]
        return a1 @ jnp.zeros((20, 6)) + jax.nn.relu(a1) @ p["w2"], a1

    f = sj.jit(net, transfers=False)

    def loss(p, x):
        y, a1 = f(p, x)
        return jnp.sum(y * c), a1

    (gp, gx), a1 = jax.grad(loss, argnums=(0, 1), has_aux=True)(prog, x)
    a1 = np.asarray(a1)
    h = np.asarray(jnp.asarray(np.maximum(a1, 0)).astype(jnp.float16).astype(jnp.float32))
    da1 = (c @ w2.T) * (a1 > 0)
    np.testing.assert_allclose(np.asarray(gp["w2"].value), h.T @ c, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gp["w1"].value), x.T @ da1, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gx), da1 @ w1.T, rtol=1e-4, atol=1e-4)


def test_hardware_aware_training_reprograms_changed_cells():
    chip = sidra_core.Chip.create("y1", seed=6)
    rs = np.random.default_rng(3)
    x = rs.standard_normal((64, 8)).astype(np.float32)
    w0 = rs.standard_normal((8, 4)).astype(np.float32)
    # Reprogramming keeps the per-column INT8 scale of the first programming (sidra_core.crossbar.reprogram):
    # a target inside the initial range stays representable.
    true_w = 0.6 * w0 + 0.2 * np.clip(rs.standard_normal((8, 4)), -1, 1).astype(np.float32)
    y = x @ true_w
    prog = sj.program({"w": w0}, chip)
    f = sj.jit(lambda p, x: x @ p["w"], transfers=False)

    def loss(p):
        return jnp.mean((f(p, x) - y) ** 2)

    first = float(loss(prog))
    tiles = [r.tile_ids for _, r in sj.residents(prog)]
    slot = prog["w"].slot
    for _ in range(30):
        g = jax.grad(loss)(prog)
        prog = jax.tree.map(lambda p, g: p - 0.2 * g, prog, g)
    last = float(loss(prog))  # programs the last update
    assert last < 0.2 * first
    assert slot.version == 30 and prog["w"].slot is slot
    assert [r.tile_ids for _, r in sj.residents(prog)] == tiles  # rewritten in place, not reallocated
    p0 = chip.clock.counters.pulses
    f(prog, x)
    assert chip.clock.counters.pulses == p0  # nothing changed since
    # A copy of the same values is not a change: no pulses.
    same = jax.tree.map(lambda p: jnp.array(p, copy=True), prog)
    f(same, x)
    assert chip.clock.counters.pulses == p0 and slot.version == 30
    # A real change is reprogrammed at the next call.
    f(jax.tree.map(lambda p: p + 0.5, prog), x)
    assert chip.clock.counters.pulses > p0 and slot.version == 31


# ---------------------------------------------------------------------------
# noise, seeds, drift


def test_fresh_noise_each_call_and_reproducible_per_seed():
    params = _params(MLP)
    x = _x(8, 20)
    runs = []
    for _ in range(2):
        chip = sidra_core.Chip.create("y1", seed=77)
        prog = sj.program(params, chip)
        f = sj.jit(mlp, transfers=False)
        runs.append([np.asarray(f(prog, x)) for _ in range(3)])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    np.testing.assert_array_equal(runs[0][2], runs[1][2])
    assert not np.array_equal(runs[0][1], runs[0][2])
    chip = sidra_core.Chip.create("y1", seed=78)
    other = np.asarray(sj.jit(mlp, transfers=False)(sj.program(params, chip), x))
    assert not np.array_equal(other, runs[0][0])


def test_read_noise_has_the_physics_variance():
    """The outputs of a weight read on a noisy chip spread as the physics says (sum of x^2 times the
    cells' read variances), over fresh reads: a sigma wired wrong into the bridge fails."""
    from noise_stats import NOISY_INT8, assert_read_variance, read_variance

    spec = sidra_core.preset("int8", **NOISY_INT8)
    w, x = _x(300, 200, seed=3), _x(8, 300, seed=4)
    chip = sidra_core.Chip.create(spec, seed=5)
    prog = sj.program({"w": w}, chip)
    f = sj.jit(lambda p, x: x @ p["w"], transfers=False)
    reads = np.stack([np.asarray(f(prog, x), np.float64) for _ in range(60)])
    assert_read_variance(reads, read_variance(w, x, spec))


def test_drift_after_advancing_the_clock():
    params = _params(MLP)
    x = _x(32, 20)
    chip = sidra_core.Chip.create("pcm", seed=3, noise__read_sigma=0.0)  # strong drift, no read noise
    prog = sj.program(params, chip)
    f = sj.jit(mlp, transfers=False)
    y0 = np.asarray(f(prog, x))
    np.testing.assert_array_equal(np.asarray(f(prog, x)), y0)
    chip.advance(365 * 86400.0)
    y1 = np.asarray(f(prog, x))
    assert np.abs(y1).mean() < 0.9 * np.abs(y0).mean()  # conductances decay: outputs shrink


# ---------------------------------------------------------------------------
# Flax


def test_flax_linen_dense_and_conv_model():
    from flax import linen as flax_nn

    class Net(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            x = flax_nn.relu(flax_nn.Conv(8, (3, 3))(x))
            x = flax_nn.relu(flax_nn.Conv(16, (3, 3), strides=2)(x))
            x = flax_nn.LayerNorm()(flax_nn.Dense(32)(x.reshape(x.shape[0], -1)))
            return flax_nn.Dense(10)(flax_nn.gelu(x))

    net = Net()
    x = jnp.asarray(_x(4, 8, 8, 1))
    variables = net.init(jax.random.PRNGKey(0), x)
    ref = np.asarray(net.apply(variables, x))
    outs = {}
    for preset in ("ideal", "y1"):
        chip = sidra_core.Chip.create(preset, seed=2)
        prog = sj.program(variables, chip)
        f = sj.jit(net.apply)
        outs[preset] = np.asarray(f(prog, x))
        rep = f.report(prog, x)
        assert sorted(k for _, k, _ in rep.weights) == [9, 32, 72, 256]
        assert rep.counts["mvms"] == 4 and rep.plan.fused_bias == 4
        assert len(chip.residents) == 4
    np.testing.assert_allclose(outs["ideal"], ref, rtol=1e-4, atol=1e-5)
    assert not np.allclose(outs["y1"], ref, atol=1e-3)
    assert np.corrcoef(outs["y1"].ravel(), ref.ravel())[0, 1] > 0.9


@pytest.mark.parametrize("strides,padding", [((2, 2), "SAME"), ((2, 1), "VALID"), ((3, 3), ((1, 2), (0, 1)))])
def test_transposed_conv_runs_on_the_crossbar(strides, padding):
    # JAX's transposed conv is conv_general_dilated with an input dilation: the dilated input's zeros
    # are zero DAC inputs of the same crossbar MVM
    rs = np.random.default_rng(0)
    params = {"k": (0.2 * rs.standard_normal((3, 3, 4, 6))).astype(np.float32)}
    x = jnp.asarray(_x(2, 5, 5, 4))

    def f(p, x):
        return jax.lax.conv_transpose(x, p["k"], strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    chip = sidra_core.Chip.create("ideal", seed=0)
    prog = sj.program(params, chip)
    g = sj.jit(f)
    np.testing.assert_allclose(np.asarray(g(prog, x)), np.asarray(f(params, x)), rtol=1e-5, atol=1e-5)
    rep = g.report(prog, x)
    assert rep.counts["mvms"] == 1 and len(chip.residents) == 1


def test_flax_attention_projections_run_on_the_crossbar():
    # MultiHeadDotProductAttention projects with DenseGeneral: 3-d kernels (features, heads, head dim)
    # and (heads, head dim, features), each held as one crossbar matrix
    from flax import linen as flax_nn
    net = flax_nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, out_features=6)
    x = jnp.asarray(_x(2, 5, 4))
    variables = net.init(jax.random.PRNGKey(0), x)
    chip = sidra_core.Chip.create("ideal", seed=0)
    prog = sj.program(variables, chip)
    f = sj.jit(net.apply)
    np.testing.assert_allclose(np.asarray(f(prog, x)), np.asarray(net.apply(variables, x)), rtol=1e-5, atol=1e-6)
    rep = f.report(prog, x)
    assert rep.counts["mvms"] == 4 and sorted((k, n) for _, k, n in rep.weights) == [(4, 8)] * 3 + [(8, 6)]
    # straight-through gradients: on the ideal chip, plain JAX's
    loss = lambda p, x: jnp.sum(f(p, x) ** 2)  # noqa: E731
    ref = jax.grad(lambda v, x: jnp.sum(net.apply(v, x) ** 2))(variables, x)
    got = jax.grad(loss)(prog, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_flax_nnx_linear_and_conv():
    from flax import nnx as nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.lin = nnx.Linear(4 * 16, 3, rngs=rngs)

        def __call__(self, x):
            return self.lin(nnx.relu(self.conv(x)).reshape(x.shape[0], -1))

    net = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(net)
    x = jnp.asarray(_x(2, 4, 4, 1))
    chip = sidra_core.Chip.create("ideal")
    f = sj.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    prog = sj.program(state, chip)
    y = f(prog, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(net(x)), rtol=1e-4, atol=1e-5)
    assert len(chip.residents) == 2


# ---------------------------------------------------------------------------
# profiler and report


def test_profiler_table_matches_the_clock_and_sidra_torch_layout():
    chip = sidra_core.Chip.create("int8")
    prog = sj.program(_params(Encoder), chip)
    x = _x(2, 8, 32)
    f = sj.jit(encoder)
    f(prog, x)
    c0 = chip.clock.counters
    with sj.profile() as prof:
        f(prog, x)
        f(prog, x)
    c1 = chip.clock.counters
    ka = prof.key_averages()
    _assert_cost(ka.total, c1.cost + c0.cost.scaled(-1))
    rows = {s.name: s for s in ka}
    assert rows["sidra::linear"].calls == 12 and rows["sidra::linear"].where == "crossbar"
    assert rows["sidra::attention"].calls == 2 and rows["sidra::attention"].where == "engine"
    assert rows["sidra::host_to_device"].where == "host"
    assert rows[f"sidra_jax::{encoder.__name__}"].calls == 2  # one range per call of the function
    assert ka.host_s > 0
    table = ka.table(sort_by="energy_total", row_limit=5)
    header = [ln for ln in table.splitlines() if "Name" in ln][0]
    for col in ("Name", "Where", "# Calls", "Device total", "Device avg", "Energy", "Host bytes", "Host sim time"):
        assert col in header
    assert "Energy by component:" in table and "Device time total:" in table
    with pytest.raises(ValueError):
        ka.table(sort_by="nonsense")


def test_profiler_records_programming_on_the_first_call():
    chip = sidra_core.Chip.create("y1", seed=9)
    prog = sj.program(_params(MLP), chip)
    f = sj.jit(mlp)
    c0 = chip.clock.counters
    with sj.profile() as prof:
        f(prog, _x(4, 20))
    c1 = chip.clock.counters
    total = prof.key_averages().total
    assert total.programming > 0 and c1.pulses > c0.pulses
    _assert_cost(total, c1.cost + c0.cost.scaled(-1))
    steady = f.cost(prog, _x(4, 20))
    assert total.latency_s > steady.latency_s


# ---------------------------------------------------------------------------
# weights on the chip: eager programming, freeing, capacity, errors


def test_eager_programming_and_free():
    chip = sidra_core.Chip.create("int8")
    prog = sj.program(_params(MLP), chip, eager=True)
    assert len(chip.residents) == 3
    used = chip.tiles_in_use
    p0 = chip.clock.counters.pulses
    sj.jit(mlp, transfers=False)(prog, _x(2, 20))
    assert len(chip.residents) == 3 and chip.clock.counters.pulses == p0  # used as programmed
    sj.free(prog)
    assert chip.residents == [] and chip.tiles_in_use == 0 < used
    del prog
    gc.collect()
    prog = sj.program(_params(MLP), chip)
    sj.jit(mlp, transfers=False)(prog, _x(2, 20))
    assert len(chip.residents) == 3
    del prog
    gc.collect()
    assert chip.residents == []  # dropping the weights frees their tiles


def test_capacity_error_before_programming_anything():
    chip = sidra_core.Chip.create("int8", tile__tiles_per_chip=2, tile__allow_multi_chip=False)
    prog = sj.program(_params(MLP), chip)
    with pytest.raises(sidra_core.ChipCapacityError):
        sj.jit(mlp, transfers=False)(prog, _x(2, 20))
    assert chip.residents == [] and chip.clock.counters.pulses == 0


def test_errors_and_static_arguments():
    with pytest.raises(ValueError, match="no chip"):
        sj.jit(lambda x: x + 1)(jnp.ones(3))
    chip_a, chip_b = sidra_core.Chip.create("ideal"), sidra_core.Chip.create("ideal")
    pa = sj.program({"w": np.ones((2, 2), np.float32)}, chip_a)
    with pytest.raises(ValueError, match="another chip"):
        sj.jit(lambda p, x: x @ p["w"], chip_b)(pa, jnp.ones((1, 2)))
    f = sj.jit(lambda p, x, n: x @ p["w"] * n, static_argnums=2, transfers=False)
    assert float(f(pa, jnp.ones((1, 2)), 3)[0, 0]) == 6.0
    assert float(f(pa, jnp.ones((1, 2)), 4)[0, 0]) == 8.0
    assert f.traces == 2
    f(pa, jnp.ones((1, 2)), 4)
    assert f.traces == 2  # cached per signature


def test_outer_jit_warns_that_seeds_are_frozen():
    import sidra_jax.transform as tr

    chip = sidra_core.Chip.create("ideal")
    p = sj.program({"w": np.ones((2, 2), np.float32)}, chip)
    f = sj.jit(lambda p, x: x @ p["w"], transfers=False)
    f(p, jnp.ones((1, 2)))
    tr._warned_traced = False
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y = jax.jit(lambda p, x: f(p, x))(p, jnp.ones((1, 2)))
    assert any("outer jax.jit" in str(r.message) for r in rec)
    np.testing.assert_allclose(np.asarray(y), [[2.0, 2.0]])


def test_encoder_block_uses_its_layer_norm_eps():
    """With the projections zeroed the block is layer_norm(layer_norm(x)); `eps` reaches both."""
    d, f = 8, 16
    zero = lambda k, n: {"w": np.zeros((k, n), np.float32), "b": np.zeros(n, np.float32)}  # noqa: E731
    one = {"g": np.ones(d, np.float32), "b": np.zeros(d, np.float32)}
    p = {"q": zero(d, d), "k": zero(d, d), "v": zero(d, d), "o": zero(d, d), "f1": zero(d, f), "f2": zero(f, d),
         "ln1": one, "ln2": one}
    x = np.random.default_rng(0).standard_normal((2, 3, d)).astype(np.float32)

    def ln(t, eps):
        return (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + eps)

    got = np.asarray(snn.encoder_block(jax.tree.map(jnp.asarray, p), jnp.asarray(x), heads=2, eps=0.5))
    np.testing.assert_allclose(got, ln(ln(x, 0.5), 0.5), atol=1e-5)

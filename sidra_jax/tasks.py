"""Tasks a sweep evaluates on a population of chips (`sidra_jax.sweep`).

A task runs on a `sidra_core.Population` at a time since programming and gives one row of metrics
per chip. `digits("mlp")` and `digits("cnn")`: scikit-learn's bundled 8x8 digits, a small model
trained in float32 on the host (fixed seeds, a few seconds, once per process), its test-split
accuracy on every chip in one population program. `per_chip(name, fn)` makes a task of a user's
function `fn(chip, t) -> dict`, run chip after chip.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sidra_core import Chip, Population

from .transform import jit
from .weights import program


@dataclass(frozen=True)
class Task:
    """A named evaluation: `run(population, t)` -> one dict of metrics per chip, after the chips'
    weights have aged `t` seconds since they were programmed."""

    name: str
    run: Callable[[Population, float], list]


def per_chip(name: str, fn: Callable[[Chip, float], dict]) -> Task:
    """A task of `fn(chip, t) -> dict of metrics`, called for each chip (a user's own evaluation)."""
    return Task(name, lambda pop, t: [dict(fn(chip, t)) for chip in pop])


@functools.cache
def digits_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test): the digits as float32 in [0, 1], a 70 / 30 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.images / 16.0).astype(np.float32), d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.7 * len(y))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def mlp(p, x):
    h = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def cnn(p, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x[..., None], p["c1"], (1, 1), "SAME", dimension_numbers=dn))
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn))
    return h.reshape(h.shape[0], -1) @ p["w"] + p["b"]


MODELS = {"mlp": mlp, "cnn": cnn}


def _init(model: str, key) -> dict:
    k = jax.random.split(key, 4)
    if model == "mlp":
        return {"w1": jax.random.normal(k[0], (64, 64)) * 0.125, "b1": jnp.zeros(64),
                "w2": jax.random.normal(k[1], (64, 10)) * 0.125, "b2": jnp.zeros(10)}
    return {"c1": jax.random.normal(k[0], (3, 3, 1, 8)) / 3.0, "c2": jax.random.normal(k[1], (3, 3, 8, 16)) / 8.5,
            "w": jax.random.normal(k[2], (256, 10)) / 16.0, "b": jnp.zeros(10)}


@functools.cache
def trained(model: str, steps: int = 100, seed: int = 0) -> dict:
    """Float32 parameters of `model` trained on the digits' training split (full-batch Adam)."""
    x, y, _, _ = digits_data()
    fn = MODELS[model]
    params = _init(model, jax.random.PRNGKey(seed))

    def loss(p):
        logits = fn(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    @jax.jit
    def step(p, m, v, i):
        g = jax.grad(loss)(p)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        lr = 1e-2 * jnp.sqrt(1 - 0.999 ** i) / (1 - 0.9 ** i)
        return jax.tree.map(lambda a, b, c: a - lr * b / (jnp.sqrt(c) + 1e-8), p, m, v), m, v

    zeros = jax.tree.map(jnp.zeros_like, params)
    m, v = zeros, zeros
    for i in range(1, steps + 1):
        params, m, v = step(params, m, v, i)
    return jax.tree.map(lambda a: np.asarray(a, np.float32), params)


def float_accuracy(model: str) -> float:
    """The trained model's float32 accuracy on the test split (on the host)."""
    _, _, x, y = digits_data()
    return float(np.mean(np.argmax(np.asarray(MODELS[model](trained(model), x)), axis=1) == y))


@functools.cache
def _function(model: str):
    """One sidra_jax function per model, so points of a sweep share its plans and compiled programs."""
    return jit(MODELS[model])


def digits(model: str) -> Task:
    """Test-split accuracy of the digits `model` ("mlp" or "cnn") on every chip of a population."""
    if model not in MODELS:
        raise ValueError(f"digits task model must be one of {sorted(MODELS)}, got {model!r}")

    def run(pop: Population, t: float) -> list:
        _, _, x, y = digits_data()
        f = _function(model)
        prog = program(trained(model), pop[0])
        logits = f.population(pop, prog, x)  # programs every chip (a fresh one) and reads it
        if t > 0:
            for chip in pop:
                chip.advance(t)
            logits = f.population(pop, prog, x)
        hits = np.argmax(np.asarray(logits), axis=-1) == y[None, :]
        return [{"accuracy": float(a)} for a in hits.mean(axis=1)]

    return Task(f"digits-{model}", run)

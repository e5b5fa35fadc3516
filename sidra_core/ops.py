"""The device ops' prices, each defined once: its cost (latency, energy by component), the counters
it bumps, the unit it runs on and how it streams in a pipelined graph.

`Chip` charges these as it runs an op (eager PyTorch reaches the chip through it), and the two
graph planners (torch.compile's passes, sidra_jax's plan) price a graph's ops with the same
functions: no frontend prices an op itself. Memoised: an eager op pays a dictionary lookup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from . import cost, graph_cost
from .cost import Cost
from .graph_cost import Stage
from .mapping import tile_grid
from .spec import ChipSpec


@dataclass(frozen=True)
class Price:
    """One device op as the chip is charged for it.

    `fixed_s` is the part of its latency that does not stream with its rows (an engine launch, the
    crossbar's accumulation tail) and `barrier` marks an op that needs all its input rows before it
    starts: a compiled graph pipelines rows across ops with them (sidra_core.graph_cost).
    """

    where: str  # "crossbar", "engine", "memory" or "host"
    cost: Cost
    counts: Mapping[str, int]
    fixed_s: float = 0.0
    rows: int = 1
    barrier: bool = False

    @property
    def stage(self) -> Stage:
        return Stage(self.cost, self.fixed_s, self.rows, self.barrier)


def _counts(**counts: int) -> Mapping[str, int]:
    return MappingProxyType({k: int(v) for k, v in counts.items() if v})


@functools.lru_cache(maxsize=4096)
def mvm(rows: int, k: int, n: int, spec: ChipSpec) -> Price:
    """`rows` input vectors through a K x N crossbar weight (a linear layer, or a convolution's
    output positions), every tile of the weight read once per row."""
    g = tile_grid(k, n, spec)
    return Price("crossbar", cost.mvm(rows, k, n, spec), _counts(mvms=1, tile_reads=rows * g.tiles),
                 fixed_s=(g.grid_k - 1) * spec.cost.accum_s_per_tile, rows=rows)


@functools.lru_cache(maxsize=4096)
def engine(op: str, numel: int, spec: ChipSpec, rows: int = 1) -> Price:
    """An element-wise or normalising op (`cost.OPS_PER_ELEMENT`'s names) over `numel` elements
    in `rows` rows on the compute engine."""
    return Price("engine", cost.engine(op, numel, spec), _counts(engine_ops=1), fixed_s=spec.engine.launch_s,
                 rows=rows)


def elementwise(numel: int, spec: ChipSpec, rows: int = 1) -> Price:
    """Element-wise arithmetic or a reduction over `numel` elements on the engine's vector unit."""
    return engine("elementwise", numel, spec, rows)


@functools.lru_cache(maxsize=4096)
def engine_matmul(batch: int, m: int, k: int, n: int, spec: ChipSpec, bias: bool = False) -> Price:
    """An activation x activation matmul (batch x (M x K) @ (K x N)) on the engine's INT8 MACs;
    `bias`: an addmm, its element-wise add in the same op."""
    c = cost.engine_matmul(batch, m, k, n, spec)
    if bias:
        c = c + cost.engine("elementwise", batch * m * n, spec)
    return Price("engine", c, _counts(engine_ops=1), fixed_s=spec.engine.launch_s, rows=batch * m, barrier=True)


@functools.lru_cache(maxsize=4096)
def attention(batch: int, seq_q: int, dim: int, seq_k: int, dim_v: int, spec: ChipSpec) -> Price:
    """Scaled dot-product attention on the engine (`batch` heads of `seq_q` queries of `dim` over
    `seq_k` keys, values of `dim_v`), charged as its four ops: the q k^T matmul, the masked scores'
    element-wise pass, the softmax, the matmul with v."""
    parts = cost.attention(batch, seq_q, dim, seq_k, dim_v, spec)
    return Price("engine", sum(parts[1:], parts[0]), _counts(engine_ops=len(parts)), fixed_s=spec.engine.launch_s,
                 rows=batch * seq_q, barrier=True)


def attention_of(q_shape, k_shape, v_shape, spec: ChipSpec) -> Price:
    """`attention` of q (..., L, E), k (..., S, E), v (..., S, Ev)."""
    return attention(*cost.attention_dims(q_shape, k_shape, v_shape), spec)


@functools.lru_cache(maxsize=4096)
def memory(nbytes: int, spec: ChipSpec, level: str = "dram") -> Price:
    """Data movement in device memory: `dram` for stored tensors (embedding tables), `sram` for
    activations (copies, concatenations)."""
    return Price("memory", cost.memory(nbytes, spec, level), _counts(memory_ops=1))


@functools.lru_cache(maxsize=4096)
def host_transfer(nbytes: int, spec: ChipSpec, transfers: int = 1, fallback: bool = False) -> Price:
    """`nbytes` over the host link in `transfers` transfers; `fallback`: an op that ran on the host
    (its operands out and its result back)."""
    return Price("host", cost.host_transfer(nbytes, spec, transfers),
                 _counts(host_transfers=transfers, host_bytes=nbytes, fallback_ops=int(fallback)))


def host_fallback(nbytes: int, spec: ChipSpec) -> Price:
    """An op the chip cannot run, on the host CPU: its `nbytes` of operands and results cross the
    host link both ways."""
    return host_transfer(nbytes, spec, 2, True)


def fused(parts: list[Price]) -> Price:
    """A crossbar MVM (the first part) fused with its epilogue ops (bias, activation, residual add):
    one device op, priced by sidra_core.graph_cost.fused, counted as the MVM."""
    head, epi = parts[0], parts[1:]
    c = graph_cost.fused([p.cost for p in parts], saved_io_j=sum(p.cost.memory for p in epi))
    return Price(head.where, c, head.counts, fixed_s=head.fixed_s, rows=head.rows)


def programming(pulses: int, cells: int, spec: ChipSpec) -> Price:
    """ISPP write-verify of `cells` cells with `pulses` pulses in all."""
    return Price("crossbar", cost.programming(pulses, spec), _counts(pulses=pulses, cells_programmed=cells))

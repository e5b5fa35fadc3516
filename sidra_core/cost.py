"""Cost model: latency and energy of every device operation, from shapes and the spec.

Pure Python over shapes (no tracing), so the eager bridge, the compiled
bridge and the JAX bridge price the same operation identically, and a model
can be priced without running it (a dry run). Being pure, the per-op
functions are memoised: an eager op pays a dictionary lookup, not the formula.

The `background` component is not an operation's own: the chip's background power
(CostSpec.background_w) over an op's latency, which the device clock adds when it charges the op
(`with_background`), so profilers attribute it to the ops that kept the chip busy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import numpy as np

from .mapping import tile_grid
from .spec import ChipSpec

COMPONENTS = ("dac", "array", "adc", "accum", "engine", "memory", "host", "chip_link", "programming", "background")


@dataclass(frozen=True)
class Cost:
    """Latency (s) and energy (J) by component of one operation or a sequence of them.

    Attributes:
        latency_s: Device time (s).
        dac: Energy of the input DAC conversions (J).
        array: Energy of the crossbar cell reads (J).
        adc: Energy of the column ADC conversions (J).
        accum: Energy of the digital partial-sum accumulation (J).
        engine: Energy of the compute engine's ops (J).
        memory: Energy of device memory and SRAM traffic (J).
        host: Energy of the host link (J).
        chip_link: Energy of the inter-chip link (J).
        programming: Energy of write-verify pulses (J).
        background: The chip's background power over this op's latency (J).
    """

    latency_s: float = 0.0
    dac: float = 0.0
    array: float = 0.0
    adc: float = 0.0
    accum: float = 0.0
    engine: float = 0.0
    memory: float = 0.0
    host: float = 0.0
    chip_link: float = 0.0
    programming: float = 0.0
    background: float = 0.0

    def __post_init__(self):
        # Energies as a tuple, in COMPONENTS order: what a clock adds up on every op.
        object.__setattr__(self, "energies", tuple(getattr(self, c) for c in COMPONENTS))

    @property
    def energy_j(self) -> float:
        return sum(self.energies)

    def energy_by_component(self) -> dict[str, float]:
        return {c: getattr(self, c) for c in COMPONENTS}

    def __add__(self, other: "Cost") -> "Cost":
        """Run one after the other: latencies and energies add."""
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Cost)))

    def alongside(self, other: "Cost") -> "Cost":
        """Run in parallel on distinct hardware: the latency is the longer one."""
        summed = self + other
        return Cost(max(self.latency_s, other.latency_s), *(getattr(summed, c) for c in COMPONENTS))

    def scaled(self, k: float) -> "Cost":
        return Cost(*(getattr(self, f.name) * k for f in fields(Cost)))

    def with_background(self, watts: float) -> "Cost":
        """This op with the chip's background power drawn over its latency."""
        if not watts:
            return self
        return replace(self, background=self.background + watts * self.latency_s)


ZERO = Cost()
_PJ = 1e-12


def _check_dims(**dims):
    for name, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
                or int(v) != v or v < 0:
            raise ValueError(f"cost model: {name} = {v!r} must be a non-negative integer")


@functools.lru_cache(maxsize=4096)
def mvm(rows: int, k: int, n: int, spec: ChipSpec) -> Cost:
    """`rows` input vectors through a K x N weight on its tiles.

    All tiles of the weight work in parallel on one input vector; vectors
    stream through one after another (the accumulation of the previous
    vector overlaps the next read). Energy counts every tile's DACs, cells,
    ADC conversions and the digital sum of the partial results.
    """
    _check_dims(rows=rows, k=k, n=n)
    if rows == 0:
        return ZERO
    g = tile_grid(k, n, spec)
    c, t = spec.cost, spec.tile
    reads = rows * g.tiles
    bytes_io = rows * (k + 4 * n)  # INT8 inputs in, INT32/fp32 results out of the SRAM buffers
    return Cost(
        latency_s=rows * c.tile_mvm_s + (g.grid_k - 1) * c.accum_s_per_tile,
        dac=reads * t.rows * c.dac_pj * _PJ,
        array=reads * t.rows * t.cols * c.array_pj_per_mac * _PJ,
        adc=reads * t.cols * c.adc_pj * _PJ,
        accum=rows * g.grid_k * g.n_padded * c.accum_pj * _PJ,
        memory=bytes_io * spec.memory.sram_pj_per_byte * _PJ,
    )


def conv(n_images: int, positions: int, k: int, c_out: int, spec: ChipSpec) -> Cost:
    """A convolution is `n_images x positions` MVM rows on its (C_in prod(kernel)) x C_out matrix."""
    _check_dims(n_images=n_images, positions=positions)
    return mvm(n_images * positions, k, c_out, spec)


# Engine work per output element for the element-wise and normalising ops.
OPS_PER_ELEMENT = {
    "relu": 1, "tanh": 6, "sigmoid": 6, "silu": 7, "gelu": 8, "gelu_tanh": 8,
    "softmax": 5, "log_softmax": 6, "layer_norm": 8, "rms_norm": 6, "batch_norm": 4,
    "add": 1, "mul": 1, "elementwise": 1,
}


@functools.lru_cache(maxsize=4096)
def engine(op: str, numel: int, spec: ChipSpec) -> Cost:
    """An element-wise or normalising op on the compute engine."""
    if op not in OPS_PER_ELEMENT:
        raise ValueError(f"cost model: unknown engine op {op!r}; known: {sorted(OPS_PER_ELEMENT)}")
    _check_dims(numel=numel)
    ops = numel * OPS_PER_ELEMENT[op]
    return _engine_ops(ops, 4 * numel, spec)


@functools.lru_cache(maxsize=4096)
def engine_matmul(batch: int, m: int, k: int, n: int, spec: ChipSpec) -> Cost:
    """Activation x activation matmul on the engine (INT8 MACs, 2 ops each)."""
    _check_dims(batch=batch, m=m, k=k, n=n)
    return _engine_ops(2 * batch * m * k * n, batch * (m * k + k * n + 4 * m * n), spec)


def attention_dims(q_shape, k_shape, v_shape) -> tuple[int, int, int, int, int]:
    """(batch, seq_q, dim, seq_k, dim_v) of attention over q (..., L, E), k (..., S, E), v (..., S, Ev)."""
    batch = math.prod(np.broadcast_shapes(tuple(q_shape[:-2]), tuple(k_shape[:-2])))
    return batch, int(q_shape[-2]), int(q_shape[-1]), int(k_shape[-2]), int(v_shape[-1])


def attention(batch: int, seq_q: int, dim: int, seq_k: int, dim_v: int, spec: ChipSpec) -> tuple[Cost, ...]:
    """Scaled dot-product attention on the engine, as its ops one by one: the q k^T matmul, the
    masked scores' element-wise pass, the softmax, the matmul with v."""
    scores = batch * seq_q * seq_k
    return (engine_matmul(batch, seq_q, dim, seq_k, spec), engine("elementwise", scores, spec),
            engine("softmax", scores, spec), engine_matmul(batch, seq_q, seq_k, dim_v, spec))


def _engine_ops(ops: int, io_bytes: int, spec: ChipSpec) -> Cost:
    e = spec.engine
    return Cost(
        latency_s=(e.launch_s + ops / e.ops_per_s) if ops else 0.0,
        engine=ops * e.pj_per_op * _PJ,
        memory=io_bytes * spec.memory.sram_pj_per_byte * _PJ,
    )


@functools.lru_cache(maxsize=4096)
def memory(nbytes: int, spec: ChipSpec, level: str = "dram") -> Cost:
    """Memory traffic: `dram` (device memory: embedding tables, stored tensors) or `sram`
    (the on-chip activation buffers: copies, concatenations, new activations)."""
    _check_dims(nbytes=nbytes)
    m = spec.memory
    if level == "dram":
        return Cost(latency_s=nbytes / m.dram_bw, memory=nbytes * m.dram_pj_per_byte * _PJ)
    if level == "sram":
        return Cost(latency_s=nbytes / m.sram_bw, memory=nbytes * m.sram_pj_per_byte * _PJ)
    raise ValueError(f"cost model: memory level {level!r} is not 'dram' or 'sram'")


@functools.lru_cache(maxsize=4096)
def host_transfer(nbytes: int, spec: ChipSpec, transfers: int = 1) -> Cost:
    """Data over the host link (PCIe-like): a latency per transfer plus bytes / bandwidth."""
    _check_dims(nbytes=nbytes, transfers=transfers)
    if transfers == 0:
        return ZERO
    m = spec.memory
    return Cost(latency_s=transfers * m.host_latency_s + nbytes / m.host_bw, host=nbytes * m.host_pj_per_byte * _PJ)


def chip_link(nbytes: int, spec: ChipSpec) -> Cost:
    """Partial results crossing between chips of a multi-chip system."""
    _check_dims(nbytes=nbytes)
    m = spec.memory
    return Cost(latency_s=nbytes / m.chip_link_bw, chip_link=nbytes * m.chip_link_pj_per_byte * _PJ)


def programming(pulses: int, spec: ChipSpec) -> Cost:
    """Write-verify pulses: `tiles_programmed_in_parallel` tiles, each writing
    `rows_programmed_in_parallel` word lines at a time."""
    _check_dims(pulses=pulses)
    c = spec.cost
    lanes = c.tiles_programmed_in_parallel * c.rows_programmed_in_parallel
    return Cost(latency_s=math.ceil(pulses / lanes) * c.pulse_s, programming=pulses * c.pulse_pj * _PJ)

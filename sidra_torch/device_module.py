"""`torch.sidra`: the torch.cuda mirror for the SIDRA device, plus the chip's own controls.

Installed as `torch.sidra` by `import sidra_torch`. Everything a CUDA user
reaches for works the same way (device count, synchronize, seeds, memory
stats, `Event(enable_timing=True)`), except that times are the *simulated*
device clock. The chip's own: choose the chip (`set_chip`, `use_chip`), read
and reset its counters, advance its clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from . import runtime
from .runtime import (Event, advance, counters, current_chip, device_time, max_memory_allocated, memory_allocated,
                      memory_summary, reset_counters, reset_peak_memory_stats, set_chip, use_chip)

OutOfMemoryError = torch.OutOfMemoryError

__all__ = [
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "synchronize",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state",
    "get_device_name", "get_device_properties", "get_device_capability", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "mem_get_info", "reset_peak_memory_stats", "memory_summary", "empty_cache",
    "Event", "device", "OutOfMemoryError", "set_chip", "use_chip", "current_chip", "counters",
    "reset_counters", "advance", "device_time", "is_bf16_supported", "get_amp_supported_dtype",
]


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """One torch device: a SIDRA system (several chips are mapped by sidra_core, not exposed as devices)."""
    return 1


def current_device() -> int:
    return 0


def _index(device) -> int | None:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


def set_device(device) -> None:
    idx = _index(device)
    if idx != 0:
        raise RuntimeError(f"sidra: invalid device ordinal {idx}; torch.sidra.device_count() is 1")


class device:
    """Context manager selecting a device, like torch.cuda.device (only index 0 exists)."""

    def __init__(self, device):
        set_device(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def synchronize(device=None) -> None:
    """The simulator runs eagerly: every op has finished when it returns."""
    set_device(device)


# -- seeds: the chip's noise streams (read noise, ISPP). Factory draws such as
# torch.randn(device="sidra:0") use the host generator, seeded by torch.manual_seed.


def manual_seed(seed: int) -> None:
    runtime.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    runtime.manual_seed(seed)


def seed() -> None:
    runtime.manual_seed(random.getrandbits(63))


seed_all = seed


def initial_seed() -> int:
    return runtime.initial_seed()


def get_rng_state(device="sidra") -> torch.Tensor:
    chip = current_chip()
    return torch.tensor([chip.seed, chip._op_counter], dtype=torch.int64)


def set_rng_state(new_state: torch.Tensor, device="sidra") -> None:
    seed_, counter = (int(v) for v in new_state.tolist())
    chip = current_chip()
    chip.manual_seed(seed_)
    chip._op_counter = counter


# -- properties and memory


@dataclass(frozen=True)
class SidraDeviceProperties:
    """What torch.sidra.get_device_properties() returns (cf. torch.cuda's _CudaDeviceProperties)."""

    name: str
    preset: str
    chips: int
    tiles: int
    tiles_per_chip: int
    tile_shape: tuple[int, int]
    weight_capacity: int  # INT8 weights the crossbars hold
    total_memory: int  # device memory (bytes)
    adc_bits: int
    dac_bits: int
    engine_precision: str


def get_device_properties(device=None) -> SidraDeviceProperties:
    set_device(device)
    spec = current_chip().spec
    chip = current_chip()
    t = spec.tile
    return SidraDeviceProperties(
        name=get_device_name(), preset=spec.name, chips=chip.tiles_total // t.tiles_per_chip,
        tiles=chip.tiles_total, tiles_per_chip=t.tiles_per_chip, tile_shape=(t.rows, t.cols),
        weight_capacity=chip.tiles_total * t.rows * t.cols, total_memory=spec.memory.dram_bytes,
        adc_bits=spec.adc.bits, dac_bits=spec.dac.bits, engine_precision=spec.engine.precision,
    )


def get_device_name(device=None) -> str:
    return f"SIDRA Y1 analog in-memory-computing chip (simulated, {current_chip().spec.name} preset)"


def get_device_capability(device=None) -> tuple[int, int]:
    return (1, 0)


def memory_reserved(device=None) -> int:
    return memory_allocated()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of device memory, as torch.cuda.mem_get_info."""
    total = current_chip().spec.memory.dram_bytes
    return total - memory_allocated(device), total


def empty_cache() -> None:
    """Nothing is cached beyond live tensors."""


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype():
    return [torch.float16, torch.bfloat16]

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
    """Whether the device can be used, as torch.cuda.is_available: always (it is simulated).

    Returns:
        True.
    """
    return True


def is_initialized() -> bool:
    """Whether the device is initialised, as torch.cuda.is_initialized: always, once imported.

    Returns:
        True.
    """
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    """One torch device: a SIDRA system (several chips are mapped by sidra_core, not exposed as devices).

    Returns:
        1.
    """
    return 1


def current_device() -> int:
    """The current device's index, as torch.cuda.current_device.

    Returns:
        0, the only device.
    """
    return 0


def _index(device) -> int | None:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


def set_device(device) -> None:
    """Select the device, as torch.cuda.set_device: only index 0 exists, so this checks it.

    Args:
        device: A device index, name or torch.device (only sidra:0 exists); None: the current one.

    Returns:
        None.

    Raises:
        RuntimeError: An index other than 0.
    """
    idx = _index(device)
    if idx != 0:
        raise RuntimeError(f"sidra: invalid device ordinal {idx}; torch.sidra.device_count() is 1")


class device:
    """Context manager selecting a device, like torch.cuda.device (only index 0 exists).

    Args:
        device: A device index, name or torch.device; None: the current one.

    Raises:
        RuntimeError: An index other than 0.
    """

    def __init__(self, device):
        set_device(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def synchronize(device=None) -> None:
    """The simulator runs eagerly: every op has finished when it returns.

    Args:
        device: A device index, name or torch.device (only sidra:0 exists); None: the current one.

    Returns:
        None.

    Raises:
        RuntimeError: An index other than 0.
    """
    set_device(device)


# -- seeds: the chip's noise streams (read noise, ISPP). Factory draws such as
# torch.randn(device="sidra:0") use the host generator, seeded by torch.manual_seed.


def manual_seed(seed: int) -> None:
    """Seed the chips' noise streams (read noise, ISPP), as torch.cuda.manual_seed.

    Args:
        seed: The seed.

    Returns:
        None.
    """
    runtime.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    """As `manual_seed` (one device), like torch.cuda.manual_seed_all.

    Args:
        seed: The seed.

    Returns:
        None.
    """
    runtime.manual_seed(seed)


def seed() -> None:
    """Seed the chips' noise streams with a random seed, as torch.cuda.seed (`seed_all` too).

    Returns:
        None.
    """
    runtime.manual_seed(random.getrandbits(63))


seed_all = seed


def initial_seed() -> int:
    """The seed last set, as torch.cuda.initial_seed.

    Returns:
        The seed (0 unless one was set).
    """
    return runtime.initial_seed()


def get_rng_state(device="sidra") -> torch.Tensor:
    """The current chip's noise-stream state, as torch.cuda.get_rng_state.

    Args:
        device: Ignored (one device).

    Returns:
        An int64 tensor [seed, operation counter], which `set_rng_state` takes back.
    """
    chip = current_chip()
    return torch.tensor([chip.seed, chip._op_counter], dtype=torch.int64)


def set_rng_state(new_state: torch.Tensor, device="sidra") -> None:
    """Restore the current chip's noise-stream state, as torch.cuda.set_rng_state.

    Args:
        new_state: A state from `get_rng_state`: [seed, operation counter].
        device: Ignored (one device).

    Returns:
        None.
    """
    seed_, counter = (int(v) for v in new_state.tolist())
    chip = current_chip()
    chip.manual_seed(seed_)
    chip._op_counter = counter


# -- properties and memory


@dataclass(frozen=True)
class SidraDeviceProperties:
    """What torch.sidra.get_device_properties() returns (cf. torch.cuda's _CudaDeviceProperties).

    Attributes:
        name: The device's name (`get_device_name`).
        preset: The current chip's spec name.
        chips: Chips in the system.
        tiles: Crossbar tiles in the system.
        tiles_per_chip: Crossbar tiles on one chip.
        tile_shape: (rows, cols) of a tile.
        weight_capacity: INT8 weights the crossbars hold.
        total_memory: Device memory (bytes).
        adc_bits: ADC resolution.
        dac_bits: DAC resolution.
        engine_precision: The compute engine's arithmetic (fp32, fp16, bf16 or int8).
    """

    name: str
    preset: str
    chips: int
    tiles: int
    tiles_per_chip: int
    tile_shape: tuple[int, int]
    weight_capacity: int
    total_memory: int
    adc_bits: int
    dac_bits: int
    engine_precision: str


def get_device_properties(device=None) -> SidraDeviceProperties:
    """The current chip's properties, as torch.cuda.get_device_properties.

    Args:
        device: A device index, name or torch.device (only sidra:0 exists); None: the current one.

    Returns:
        Its SidraDeviceProperties.

    Raises:
        RuntimeError: An index other than 0.
    """
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
    """The device's name, with the current chip's preset, as torch.cuda.get_device_name.

    Args:
        device: Ignored (one device).

    Returns:
        The name.
    """
    return f"SIDRA Y1 analog in-memory-computing chip (simulated, {current_chip().spec.name} preset)"


def get_device_capability(device=None) -> tuple[int, int]:
    """The device's (major, minor) capability, as torch.cuda.get_device_capability.

    Args:
        device: Ignored (one device).

    Returns:
        (1, 0).
    """
    return (1, 0)


def memory_reserved(device=None) -> int:
    """Bytes of device memory reserved, as torch.cuda.memory_reserved: nothing is cached, so the
    bytes allocated.

    Args:
        device: Ignored (one device).

    Returns:
        The bytes allocated now.
    """
    return memory_allocated()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of device memory, as torch.cuda.mem_get_info.

    Args:
        device: Ignored (one device).

    Returns:
        (free bytes, total bytes) of the current chip's device memory.
    """
    total = current_chip().spec.memory.dram_bytes
    return total - memory_allocated(device), total


def empty_cache() -> None:
    """Nothing is cached beyond live tensors, so torch.cuda.empty_cache's twin does nothing.

    Returns:
        None.
    """


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Whether bfloat16 tensors work on the device, as torch.cuda.is_bf16_supported.

    Args:
        including_emulation: Accepted for torch.cuda's signature.

    Returns:
        True.
    """
    return True


def get_amp_supported_dtype():
    """The dtypes autocast may use on the device (torch's device-module hook).

    Returns:
        [torch.float16, torch.bfloat16].
    """
    return [torch.float16, torch.bfloat16]

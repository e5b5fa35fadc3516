"""sidra_core: the SIDRA analog in-memory-computing chip as pure JAX/NumPy functions.

Physics and cost live here and only here; `sidra_torch` and `sidra_jax`
translate framework operations into calls of these kernels.
"""

from . import cost, engine, rng
from .clock import Counters, DeviceClock
from .conv import conv, conv_args, weight_matrix as conv_weight_matrix
from .cost import Cost
from .crossbar import ProgrammedWeight, ProgrammingReport, Snapshot, drifted, linear, mvm, mvm_kwargs, program, reprogram, snapshot
from .device import Chip, EnduranceWarning, Resident
from .ispp import ISPPResult, program_cells
from .mapping import ChipCapacityError, ChipMapping, TileGrid, capacity_error, chips_needed, map_weights, system_tiles, tile_grid
from .quant import QuantisedWeight, from_int8, quantise_rows, quantise_weight
from .spec import (PRESETS, ADCSpec, ChipSpec, CostSpec, DACSpec, EngineSpec, ISPPSpec, MemorySpec, NoiseSpec,
                   QuantSpec, TileSpec, preset, resolve)

__all__ = [n for n in dir() if not n.startswith("_")]

"""sidra_core: the SIDRA analog in-memory-computing chip as pure JAX/NumPy functions.

Physics and cost live here and only here; `sidra_torch` and `sidra_jax`
translate framework operations into calls of these kernels.
"""

import jax as _jax
import jaxlib as _jaxlib

from . import versions as _versions

_versions.check("jax", _jax.__version__)
_versions.check("jaxlib", _jaxlib.__version__)

from . import cost, engine, ops, rng  # noqa: E402
from .clock import Counters, DeviceClock  # noqa: E402
from .conv import conv, conv_args, weight_matrix as conv_weight_matrix  # noqa: E402
from .cost import Cost  # noqa: E402
from .crossbar import ProgrammedWeight, ProgrammingReport, Snapshot, drifted, linear, mvm, mvm_kwargs, program, reprogram, snapshot  # noqa: E402
from .device import Chip, EnduranceWarning, HostMemoryError, Resident  # noqa: E402
from .ispp import ISPPResult, program_cells  # noqa: E402
from .population import Population  # noqa: E402
from .mapping import ChipCapacityError, ChipMapping, TileGrid, capacity_error, chips_needed, map_weights, system_tiles, tile_grid  # noqa: E402
from .quant import QuantisedWeight, from_int8, quantise_rows, quantise_weight  # noqa: E402
from .spec import (PRESETS, ADCSpec, ChipSpec, CostSpec, DACSpec, EngineSpec, ISPPSpec,  # noqa: E402
                   MemorySpec, NoiseSpec, QuantSpec, TileSpec, preset, resolve)

__all__ = [n for n in dir() if not n.startswith("_")]

"""sidra_torch: "sidra" as a real PyTorch device.

    import sidra_torch
    model.to("sidra:0")          # weights are programmed into crossbars on first use
    y = model(x.to("sidra:0"))   # the chip's outputs, with its latency and energy on torch.sidra

Importing registers the device (idempotent). `torch.sidra` mirrors `torch.cuda`.
"""

from __future__ import annotations

import torch

from sidra_core import versions as _versions

_versions.check("torch", torch.__version__)

from . import profiler  # noqa: E402
from ._registration import register  # noqa: E402
from .population import PopulationRun, population  # noqa: E402
from .runtime import (Event, advance, counters, current_chip, device_time, drift_compensation,  # noqa: E402
                      manual_seed, reset_counters, set_chip, use_chip)
from .tensor import SidraTensor, unwrap, wrap  # noqa: E402

register()
DEVICE = torch.device("sidra", 0)

__all__ = ["DEVICE", "Event", "PopulationRun", "profiler", "SidraTensor", "advance", "counters", "current_chip",
           "device_time", "drift_compensation", "manual_seed", "population", "register", "reset_counters", "set_chip",
           "unwrap", "use_chip", "wrap"]

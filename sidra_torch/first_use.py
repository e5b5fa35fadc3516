"""What the device installs in the user's process when its first tensor is made, not on import.

torch offers these only process-wide; each one acts on the device's own tensors and modules and
leaves everything else as torch does it (the README lists them with their reasons):

- forward hooks on every `nn.Module` (weights.install): name a module's device weights and check
  that a model fits the chip before its first forward programs anything, and hold the context of
  a dynamically quantised Linear (its packed weights reach dispatch as new objects each call);
- `torch.utils.swap_tensors` (_registration.swap_tensors): `Module.to("sidra:0")` of a CPU module
  whose forward graph is still alive, which torch's own refuses;
- torch.profiler's result parsing (profiler.install): the device's ops as device events.

Loading a checkpoint saved from the device wraps `torch._utils._rebuild_tensor` at its first
device storage (serialization.py); torch.compile(backend="sidra") filters torch's warning about
the module hooks when the backend is first looked up (compiler/__init__.py).
"""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_DONE = False


def install() -> None:
    """Idempotent: the process-wide pieces above, once."""
    global _DONE
    with _LOCK:
        if _DONE:
            return
        from . import _registration, profiler, weights

        weights.install()
        torch.utils.swap_tensors = _registration.swap_tensors
        profiler.install()
        _DONE = True


def installed() -> bool:
    """Whether the device has been used in this process (and so installed its pieces)."""
    return _DONE

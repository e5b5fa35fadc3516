"""Zero-copy torch CPU tensor -> jax.Array, the hot path of every device op's inputs.

`jax.dlpack.from_dlpack` asks the CPU device for an external-ready-events
stream on every call; XLA:CPU answers UNIMPLEMENTED and JAX catches the
error: ~25 of its ~30 us per array here. jaxlib's own import of the DLPack
capsule without that question takes ~6 us. It is a private entry point, so
it is used only with the signature it was checked with, its first result is
compared with the public path's, and any failure falls back to the public
path for good.
"""

from __future__ import annotations

import jax

try:  # jaxlib's C++ DLPack import and the version of its signature (capsule, device, stream, copy, type)
    from jax._src.lib import _jax, jaxlib_extension_version

    _IMPORT = _jax.dlpack_managed_tensor_to_buffer if jaxlib_extension_version >= 467 else None
except (ImportError, AttributeError):  # another jaxlib layout: the public path only
    _IMPORT = None

_KDLCPU = 1  # DLDeviceType of a CPU tensor
_state: dict = {"checked": False}


def _public(t) -> jax.Array:
    return jax.dlpack.from_dlpack(t)


def _fast(t) -> jax.Array:
    return _IMPORT(t.__dlpack__(), _state["device"], None, None, _KDLCPU)


def _check(t) -> None:
    """Use the fast import only if it gives what the public one gives (the same memory, shape, dtype)."""
    global _IMPORT
    _state["checked"] = True
    if _IMPORT is None:
        return
    try:
        _state["device"] = jax.local_devices(backend="cpu")[0]
        a, b = _fast(t), _public(t)
        ok = (a.shape, a.dtype, a.unsafe_buffer_pointer()) == (b.shape, b.dtype, b.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 - any surprise from a private API means: do not use it
        ok = False
    if not ok:
        _IMPORT = None


def to_jax(t) -> jax.Array:
    """A jax.Array sharing the memory of `t` (a contiguous CPU torch tensor)."""
    if not _state["checked"]:
        _check(t)
    return _fast(t) if _IMPORT is not None else _public(t)

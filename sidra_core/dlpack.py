"""Zero-copy torch CPU tensor or NumPy array -> jax.Array, the hot path of every device op's inputs
(and of the row buckets' padded copies: faster there than jax.device_put).

`jax.dlpack.from_dlpack` asks the CPU device for an external-ready-events
stream on every call; XLA:CPU answers UNIMPLEMENTED and JAX catches the
error, which is most of the call's time. jaxlib's own import of the DLPack
capsule skips that question. It is a private entry point, so
it is used only with the signature it was checked with, its first result is
compared with the public path's, and any failure falls back to the public
path for good.
"""

from __future__ import annotations

import mmap

import jax
import numpy as np

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


def _pointer(t) -> int:
    return t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data


def _check(t) -> bool:
    """Use the fast import only if it gives what the public one gives (the same memory, shape,
    dtype). Decided on the first array the public path imports without a copy (XLA copies an
    unaligned buffer); returns whether it is decided."""
    global _IMPORT
    if _IMPORT is None:
        _state["checked"] = True
        return True
    try:
        _state["device"] = jax.local_devices(backend="cpu")[0]
        b = _public(t)
        if b.unsafe_buffer_pointer() != _pointer(t):
            return False
        a = _fast(t)
        ok = (a.shape, a.dtype, a.unsafe_buffer_pointer()) == (b.shape, b.dtype, b.unsafe_buffer_pointer())
    except Exception:  # noqa: BLE001 - any surprise from a private API means: do not use it
        ok = False
    if not ok:
        _IMPORT = None
    _state["checked"] = True
    return True


def to_jax(t) -> jax.Array:
    """A jax.Array sharing the memory of `t` (a contiguous CPU torch tensor or writeable NumPy array;
    XLA copies one that is not aligned for it)."""
    if not _state["checked"] and not _check(t):
        return _public(t)
    return _fast(t) if _IMPORT is not None else _public(t)


ALIGNMENT = 64  # XLA:CPU shares a host buffer aligned to this through DLPack; it copies any other


def _size(shape, dtype) -> tuple[np.dtype, int]:
    dtype = np.dtype(dtype)
    return dtype, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised NumPy array at an ALIGNMENT-byte boundary, which `to_jax` shares."""
    dtype, nbytes = _size(shape, dtype)
    buf = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -buf.ctypes.data % ALIGNMENT
    return buf[start:start + nbytes].view(dtype).reshape(shape)


# NumPy asks the kernel for transparent huge pages for its arrays from this size on (madvise)
_HUGE_PAGES_FROM = 1 << 22


def mapped(shape, dtype) -> np.ndarray:
    """An uninitialised ALIGNMENT-aligned array (`empty`) for the arrays a weight's programming
    writes once and keeps; from 4 MiB in memory pages of its own (an anonymous map, unmapped with the
    array). NumPy asks for transparent huge pages for such arrays, and where the kernel compacts
    memory to find them on the first touch (THP defrag "madvise", a common default), faulting in a
    model's programmed state stalls; these are plain pages."""
    dtype, nbytes = _size(shape, dtype)
    if nbytes < _HUGE_PAGES_FROM:
        return empty(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def aligned(a: np.ndarray) -> np.ndarray:
    """`a`, or a copy of it at an ALIGNMENT-byte boundary where it is not at one: for arrays that
    every read hands to XLA (a weight's cells), so that `to_jax` shares them instead of copying."""
    if a.ctypes.data % ALIGNMENT == 0 and a.flags.c_contiguous and a.flags.writeable:
        return a
    out = mapped(a.shape, a.dtype)
    out[...] = a
    return out

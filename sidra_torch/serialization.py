"""torch.save / torch.load support for sidra tensors.

Save: SidraTensor.__reduce_ex__ emits the *standard* `_rebuild_tensor_v2`
(so `weights_only=True` loading works, and views/tied tensors share one storage
record) for the inner CPU tensor, whose storage record is tagged "sidra:0".

Load: a `register_package` deserializer (priority 1, before torch's own
privateuse1 one, which would try `UntypedStorage.to("sidra:0")` and segfault:
there is no sidra allocator) keeps the bytes on CPU and marks the storage
object; a tiny patch of `torch._utils._rebuild_tensor` wraps tensors built on
marked storages into SidraTensors (no copy, aliasing preserved). The patch is made when the
first device storage is loaded (the storages of a checkpoint load before its tensors are built),
not on import.

Effect (same as CUDA):
  torch.load(f)                       sidra-saved -> sidra, cpu-saved -> cpu
  torch.load(f, map_location="cpu")   everything -> cpu
  torch.load(f, map_location="sidra:0")  everything -> sidra
"""
from __future__ import annotations

import torch
import torch.serialization as _ser
import torch._utils as _utils

from . import tensor as _t

_MARK = "_sidra_location"
_orig_rebuild_tensor = _utils._rebuild_tensor
_done = False


def reduce_sidra_tensor(self, proto):
    inner = self._inner
    st = inner.untyped_storage()
    # Tag the storage (python object is preserved per StorageImpl) -> the
    # tagger below reports "sidra:0" for it.
    setattr(st, _MARK, str(self.device))
    typed = torch.storage.TypedStorage(wrap_storage=st, dtype=inner.dtype, _internal=True)
    from collections import OrderedDict

    args = (
        typed,
        inner.storage_offset(),
        tuple(inner.size()),
        inner.stride(),
        self.requires_grad,
        OrderedDict(),
    )
    if getattr(self, "_is_param", False):
        # keep Parameter-ness like nn.Parameter.__reduce_ex__
        return (
            torch._utils._rebuild_parameter,
            (_rebuild_marker_tensor(args), self.requires_grad, OrderedDict()),
        )
    return (torch._utils._rebuild_tensor_v2, args)


class _rebuild_marker_tensor:
    """Helper so that a Parameter pickles as _rebuild_parameter(tensor, ...)"""

    def __init__(self, args):
        self.args = args

    def __reduce_ex__(self, proto):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _tag(storage):
    if isinstance(storage, torch.storage.TypedStorage):
        storage = storage._untyped_storage
    loc = getattr(storage, _MARK, None)
    return loc


def _deserialize(storage, location):
    if location.startswith(_t.DEVICE_TYPE):
        if isinstance(storage, torch.storage.TypedStorage):
            us = storage._untyped_storage
        else:
            us = storage
        setattr(us, _MARK, location)
        _utils._rebuild_tensor = _rebuild_tensor  # from the first device storage on (idempotent)
        return storage
    return None


def _rebuild_tensor(storage, storage_offset, size, stride):
    t = _orig_rebuild_tensor(storage, storage_offset, size, stride)
    us = storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage
    if getattr(us, _MARK, None) is not None:
        return _t._wrap(t)
    return t


def register():
    global _done
    if _done:
        return
    _ser.register_package(1, _tag, _deserialize)
    _done = True

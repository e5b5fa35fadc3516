"""SidraTensor: wrapper subclass around an inner CPU tensor ("device memory").

Design A: the outer tensor is a `_make_wrapper_subclass` with device=sidra:0 and
no data (data_ptr()==0); `self._inner` is a plain CPU tensor that holds the
values.  Every aten op that reaches the Python dispatch key (i.e. *after*
autograd / CompositeImplicitAutograd decomposition) lands in
`SidraTensor.__torch_dispatch__`, which unwraps, runs the op on CPU and wraps
the result.  View / in-place / out= semantics are inherited from the inner CPU
tensors (a view's inner is a CPU view of the base's inner, an in-place op
mutates the inner and returns the *same* wrapper object).
"""
from __future__ import annotations

import sys as _sys
import time as _time
import weakref as _weakref

import torch
import torch.compiler as _torch_compiler
import torch.autograd.profiler as _autograd_profiler
from torch._C import _disabled_torch_function_impl

from . import first_use as _first_use
from . import runtime as _runtime

aten = torch.ops.aten

DEVICE_TYPE = "sidra"
DEVICE = None  # torch.device("sidra", 0); set by registration.register() (needs the rename first)
CPU = torch.device("cpu")

_make_wrapper = torch.Tensor._make_wrapper_subclass
_is_inference_mode = torch.is_inference_mode_enabled
_Tensor = torch.Tensor


def _no_inference_mode():
    return torch.inference_mode(False)


class SidraTensor(torch.Tensor):
    """A tensor living on sidra:0.  `_inner` holds the CPU "device memory".

    Args:
        inner: The CPU tensor that backs it (aliased, not copied).
        requires_grad: Whether autograd records operations on it.
    """

    # The wrapper never needs __torch_function__: disable it (big speed win, and
    # results of torch functions stay SidraTensor because dispatch wraps them).
    __torch_function__ = _disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool = False):
        return _wrap(inner, requires_grad)

    def __init__(self, *args, **kwargs):  # __new__ does everything
        pass

    # ------------------------------------------------------------------ repr
    def __repr__(self, *, tensor_contents=None):
        # Printing reads the tensor to the host once (like CUDA) and formats it there:
        # the formatter's own ops run as plain host ops, not as priced device ops.
        _runtime.current_chip().charge_host(self._inner.numel() * self._inner.element_size())
        with _runtime.quiet():
            return self._repr(tensor_contents)

    def _repr(self, tensor_contents):
        # torch._tensor_str works through dispatch (reshape/masked_select/...
        # + tolist) but prefixes subclasses with their class name; make it
        # print exactly like a CUDA tensor: "tensor([...], device='sidra:0')".
        is_param = getattr(self, "_is_param", False)
        if is_param:
            with torch.no_grad():
                s = torch._tensor_str._str(self.detach(), tensor_contents=tensor_contents)
            if self.requires_grad:
                s = s[:-1] + ", requires_grad=True)"
        else:
            s = torch._tensor_str._str(self, tensor_contents=tensor_contents)
        pre = type(self).__name__ + "("
        if s.startswith(pre):
            shift = len(pre) - len("tensor(")
            lines = s.split("\n")
            lines[0] = "tensor(" + lines[0][len(pre):]
            lines[1:] = [ln[shift:] if ln[:shift].isspace() else ln for ln in lines[1:]]
            s = "\n".join(lines)
        if is_param:
            s = "Parameter containing:\n" + s
        return s

    def __format__(self, format_spec):
        # Tensor.__format__ only formats 0-dim tensors when type(self) is Tensor
        if self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def numpy(self, *, force=False):
        # same error type/message as CUDA tensors
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    # Storage / data_ptr: the wrapper's own storage is a data-less placeholder
    # (data_ptr()==0; touching it raises "Attempted to access the data pointer
    # on an invalid python storage").  Third-party code that identifies shared
    # memory through them (safetensors / HF save_pretrained, tied-weight
    # detection) must see the *device memory*, i.e. the inner CPU storage, so
    # that tied / aliased sidra tensors report the same pointer.  PyTorch's own
    # Python internals (torch.compile's meta_utils memoises storages: handing
    # it the inner storage for the outer tensor breaks fakification) keep
    # seeing the real wrapper storage.
    def untyped_storage(self):
        # (A fake made while dynamo traces answers with its fake inner storage: dynamo resizes
        # an empty tensor's storage to 0 bytes, which a PrivateUse1 storage cannot do.)
        if _sys._getframe(1).f_globals.get("__name__", "").startswith("torch.") and type(self._inner) is _Tensor:
            return _Tensor.untyped_storage(self)
        return self._inner.untyped_storage()

    def data_ptr(self):
        if _sys._getframe(1).f_globals.get("__name__", "").startswith("torch."):
            return _Tensor.data_ptr(self)
        return self._inner.data_ptr()

    # `.data = x`: C++ set_data() shallow-copies the TensorImpl metadata
    # (sizes/strides/data-less storage) but knows nothing about `_inner`, so
    # without this override `p.data = new` silently keeps the old values.
    @property
    def data(self):
        return _data_get(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, SidraTensor):
            raise RuntimeError(
                f"sidra: cannot assign a {new.device} tensor to .data of a sidra tensor "
                "(the wrapper cannot become a CPU tensor); use .copy_() or .to()"
            )
        _data_set(self, new)
        self._inner = new._inner

    def tolist(self):
        # Tensor.tolist() refuses tensor subclasses; device->host read
        return self._inner.tolist()

    # ------------------------------------------------ torch.compile protocol
    def __tensor_flatten__(self):
        return ["_inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return _wrap(inner_tensors["_inner"])

    # ---------------------------------------------------------- copy/pickle
    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) "
                "support the deepcopy protocol at the moment."
            )
        with torch.no_grad():
            new = _wrap(self._inner.clone())
        # keep Parameter-ness / weight tags / user attributes, but not _inner
        for k, v in self.__dict__.items():
            if k != "_inner":
                new.__dict__[k] = _deepcopy(v, memo)
        if self.requires_grad:
            new.requires_grad_(True)
        if self.grad is not None:
            new.grad = self.grad.__deepcopy__(memo)
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, proto):
        # see sidra/serialization.py: we pickle the inner CPU tensor through the
        # standard _rebuild_tensor_v2 path (weights_only-safe), but its storage
        # is tagged "sidra:0" so map_location decides where it lands.
        from . import serialization

        return serialization.reduce_sidra_tensor(self, proto)

    # ------------------------------------------------------------ dispatch
    # __torch_dispatch__ is installed at the bottom of this module:
    # SidraTensor.__torch_dispatch__ = classmethod(_torch_dispatch)
    # (the module-level function *is* the classmethod: no extra frame per op)


_data_get = torch._C.TensorBase.data.__get__
_data_set = torch._C.TensorBase.data.__set__


def _sync_meta(w, inner):
    """Make wrapper `w`'s sizes/strides/offset follow its (mutated) inner.

    Needed after in-place metadata ops (t_, unsqueeze_, transpose_, ...),
    resize_, set_, and out= ops that resize their output.  Uses the C++
    set_data() (shallow_copy_from) with a fresh wrapper of the right geometry:
    `w` keeps its identity, autograd meta and version counter."""
    if (w.shape == inner.shape and w.stride() == inner.stride()
            and w.storage_offset() == inner.storage_offset()):
        return
    _data_set(w, _wrap(inner))


def _deepcopy(v, memo):
    import copy

    return copy.deepcopy(v, memo)


def _wrap(inner: torch.Tensor, requires_grad: bool = False) -> SidraTensor:
    # hot path (one per op output): minimal kwargs (layout is always strided)
    if not _first_use.installed():  # the device's first tensor in this process
        _first_use.install()
    off = inner.storage_offset()
    if off:
        r = _make_wrapper(SidraTensor, inner.size(), strides=inner.stride(), storage_offset=off,
                          dtype=inner.dtype, device=DEVICE, requires_grad=requires_grad)
    else:
        r = _make_wrapper(SidraTensor, inner.size(), strides=inner.stride(),
                          dtype=inner.dtype, device=DEVICE, requires_grad=requires_grad)
    r._inner = inner
    return r


def wrap(inner: torch.Tensor) -> SidraTensor:
    """Public: make a sidra tensor that *aliases* the given CPU tensor.

    Args:
        inner: A CPU tensor.

    Returns:
        The SidraTensor backed by `inner`.

    Raises:
        ValueError: `inner` is not on the CPU.
    """
    if inner.device.type != "cpu":
        raise ValueError("inner tensor must be a CPU tensor")
    return _wrap(inner)


def unwrap(t: SidraTensor) -> torch.Tensor:
    """Public: the CPU tensor that backs a sidra tensor (aliases it).

    Args:
        t: A sidra tensor.

    Returns:
        Its CPU tensor.
    """
    return t._inner


# --------------------------------------------------------------------------
# device checks
# --------------------------------------------------------------------------
def _as_device(d) -> torch.device:
    """torch.device(d), rejecting sidra indices other than 0 (one device)."""
    d = d if type(d) is torch.device else torch.device(d)
    if d.type == DEVICE_TYPE and d.index not in (None, 0):
        raise RuntimeError(
            f"sidra: invalid device ordinal {d.index} (torch.sidra.device_count() == 1)"
        )
    return d


def _device_error(other):
    return RuntimeError(
        "Expected all tensors to be on the same device, but found at least two "
        f"devices, {DEVICE} and {other}!"
    )


# ops that legitimately mix sidra and cpu tensors (like CUDA): copies and
# indexing with CPU index tensors.
_MIXED_DEVICE_OK = {
    aten.copy_.default,
    aten.copy.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.index.Tensor,
    aten.index_put_.default,
    aten.index_put.default,
    aten._index_put_impl_.default,
    aten._unsafe_index.Tensor,
    aten._unsafe_index_put.default,
}


# --------------------------------------------------------------------------
# per-op analysis cache
# --------------------------------------------------------------------------
class _OpInfo:
    __slots__ = ("kind", "mut_args", "check", "has_device", "name", "view", "op", "special", "meta_mut", "runner",
                 "special_runner")

    FUNCTIONAL, MUTATING, VIEW = 0, 1, 2


def _analyze(func) -> _OpInfo:
    info = _OpInfo()
    info.op = func._op  # the C++ callable; skips OpOverload.__call__'s frame
    info.special = _SPECIAL.get(func)
    if info.special is not None:  # transfers and copies, as a runner the profiler can time
        special = info.special
        info.special_runner = lambda f, args, _u, kwargs: special(f, args, kwargs)
        info.special_runner.where = "memory"
    schema = func._schema
    info.name = schema.name
    info.check = func not in _MIXED_DEVICE_OK
    info.has_device = any(a.name == "device" for a in schema.arguments)
    info.view = bool(func.is_view)
    # in-place ops that change metadata only (t_, transpose_, as_strided_, ...)
    info.meta_mut = torch.Tag.inplace_view in func.tags or schema.name in ("aten::set_", "aten::resize_")
    # mutated (returned) arguments: return i aliases a written argument
    mut = []
    for r in schema.returns:
        ai = r.alias_info
        if ai is not None and ai.is_write:
            for idx, a in enumerate(schema.arguments):
                aa = a.alias_info
                if aa is not None and aa.is_write and aa.before_set == ai.before_set:
                    mut.append((idx, a.name, a.kwarg_only))
                    break
            else:
                mut.append(None)
        else:
            mut.append(None)
    if any(m is not None for m in mut):
        info.kind = _OpInfo.MUTATING
        info.mut_args = tuple(mut)
    elif info.view:
        info.kind = _OpInfo.VIEW
        info.mut_args = None
    else:
        info.kind = _OpInfo.FUNCTIONAL
        info.mut_args = None
    from .dispatch import runner_for

    # where the op runs on the chip (crossbar, engine, memory, host) and its pricing; None = free
    info.runner = runner_for(func, info.view or info.meta_mut)
    # cache on the OpOverload object itself: attribute lookup is cheaper
    # than a dict keyed by OpOverload (its __hash__ is Python code)
    func._sidra_info = info
    return info


# --------------------------------------------------------------------------
# unwrap / wrap helpers (hand-written instead of pytree: cheaper on every op)
# --------------------------------------------------------------------------
def _unwrap_tensor(a, check):
    """The device memory of a sidra tensor; a host tensor passes only as a 0-dim scalar (like CUDA)."""
    if isinstance(a, SidraTensor):
        return a._inner
    if a.device.type == DEVICE_TYPE:
        # Only while dynamo traces: its fake mode makes factories' results plain fakes on sidra.
        return a.to(CPU)
    if check and a.dim() != 0 and a.device.type != "meta":
        raise _device_error(a.device)
    return a


def _unwrap_seq(seq, check):
    return [a._inner if type(a) is SidraTensor else _unwrap_tensor(a, check) if isinstance(a, _Tensor) else a
            for a in seq]


def _unwrap_args(args, check):
    out = []
    for a in args:
        t = type(a)
        if t is SidraTensor:
            out.append(a._inner)
        elif t is list or t is tuple:
            out.append(_unwrap_seq(a, check) if a and _has_tensor(a) else a)
        elif isinstance(a, _Tensor):
            out.append(_unwrap_tensor(a, check))
        else:
            out.append(a)
    return out


def _unwrap_kwargs(kwargs, check) -> dict:
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, _Tensor):
            v = _unwrap_tensor(v, check)
        elif (type(v) is list or type(v) is tuple) and _has_tensor(v):
            v = _unwrap_seq(v, check)
        out[k] = v
    return out


def _has_tensor(seq):
    for a in seq:
        if isinstance(a, _Tensor):
            return True
    return False


_TRACKED: set = set()  # data pointers of device-memory storages being counted


def _untrack(ptr: int, nbytes: int) -> None:
    _TRACKED.discard(ptr)
    _runtime.track_free(nbytes)


def track_new(out) -> None:
    """Count new device storages against the chip's memory (raises OutOfMemoryError past capacity).

    Not under `runtime.quiet()` (host temporaries) nor while dynamo traces (fakes).
    """
    if _runtime.unpriced():
        return
    if isinstance(out, _Tensor):
        if out.layout is not torch.strided:
            return
        st = out.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in _TRACKED:
            nbytes = st.nbytes()
            _runtime.track_alloc(nbytes)
            _TRACKED.add(ptr)
            _weakref.finalize(st, _untrack, ptr, nbytes)
    elif type(out) is tuple or type(out) is list:
        for o in out:
            track_new(o)


def _wrap_out(r):
    t = type(r)
    if t is _Tensor:
        return _wrap(r)
    if t is tuple or t is list:
        return t(_wrap(x) if isinstance(x, _Tensor) else x for x in r)
    if isinstance(r, _Tensor):  # e.g. FakeTensor inner under torch.compile
        return _wrap(r)
    return r


# Set by weights.py: links a view of a weight to its base (callable(func, args, out)),
# and counts in-place writes into weights, through any view or `.data` (callable(tensor)).
_view_tag = None
_written = None
# Set while a profiler records: observer(func, runner, args, uargs, ukwargs) runs the
# device op and measures it (runner.where says crossbar / engine / memory / host).
observer = None
_enter_range = torch.ops.profiler._record_function_enter_new
_exit_range = torch.ops.profiler._record_function_exit._RecordFunction


def op_name(func) -> str:
    return "sidra::" + func._schema.name.split("::")[-1]


# Device ops run while PyTorch's profiler records: (name, host start in perf_counter ns, device
# seconds), which `profiler.device_events` hands to that profiler as its SIDRA activity's events.
torch_profiled: list = []


def _ranged(func, runner, args, uargs, ukwargs):
    """A device op under PyTorch's own profiler: a `sidra::<op>` range around it, its device time kept."""
    name = op_name(func)
    clock = _runtime.current_chip().clock
    start_s, t0 = clock.now, _time.perf_counter_ns()
    rec = _enter_range(name, None)
    try:
        return runner(func, args, uargs, ukwargs)
    finally:
        _exit_range(rec)
        torch_profiled.append((name, t0, clock.now - start_s))


# --------------------------------------------------------------------------
# special ops
# --------------------------------------------------------------------------
def _to_copy(func, args, kwargs):
    x = args[0]
    device = kwargs.get("device")
    inner = x._inner if type(x) is SidraTensor or isinstance(x, SidraTensor) else x
    kw = dict(kwargs)
    if device is not None:
        device = _as_device(device)
        kw["device"] = CPU
        if device.type != DEVICE_TYPE:
            kw["device"] = device
            # leaving the device: return a real CPU tensor (always a copy) over the host link
            out = func(inner, *args[1:], **kw)
            _charge(out, "host")
            return out
    out = func(inner, *args[1:], **kw)
    track_new(out)
    _charge(out, "sram" if isinstance(x, SidraTensor) else "host")
    return _wrap(out)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    d = dst._inner if isinstance(dst, SidraTensor) else dst
    s = src._inner if isinstance(src, SidraTensor) else src
    d.copy_(s, *args[2:], **kwargs)
    charge_copy(dst, src, d)
    if _written is not None and isinstance(dst, SidraTensor):
        _written(dst)
    return dst


def charge_copy(dst, src, d) -> None:
    """A copy inside device memory, or across the host link when one side is on the host."""
    if isinstance(dst, SidraTensor) and isinstance(src, SidraTensor):
        _charge(d, "sram")
    elif isinstance(src, _Tensor) and src.dim() == 0 and not isinstance(src, SidraTensor):
        _charge(d, "sram")  # a host scalar broadcast into device memory
    else:
        _charge(d, "host")


def _charge(t: torch.Tensor, where: str) -> None:
    """Price writing `t` in device SRAM or moving it over the host link (see runtime.unpriced)."""
    if _runtime.unpriced():
        return
    nbytes = t.numel() * t.element_size()
    chip = _runtime.current_chip()
    if where == "host":
        chip.charge_host(nbytes)
    else:
        chip.charge_memory(nbytes, where)


def _is_pinned(func, args, kwargs):
    return False


def _to(func, args, kwargs):
    """aten.to.* only reaches __torch_dispatch__ when autograd is excluded
    (torch.inference_mode): it is CompositeImplicitAutograd and otherwise
    decomposes into _to_copy.  Must honour its device argument."""
    x = args[0]
    inner = x._inner
    args = list(args)
    if func is aten.to.device:
        device = _as_device(args[1])
        args[1] = CPU if device.type == DEVICE_TYPE else device
    elif func is aten.to.other:
        other = args[1]
        device = other.device
        args[1] = other._inner if isinstance(other, SidraTensor) else other
    else:
        device = kwargs.get("device")
        if device is not None:
            device = _as_device(device)
            kwargs = dict(kwargs)
            kwargs["device"] = CPU if device.type == DEVICE_TYPE else device
    out = func(inner, *args[1:], **kwargs)
    if device is None or device.type == DEVICE_TYPE:
        if out is inner:
            return x  # no-op .to() returns self, like every backend
        track_new(out)
        _charge(out, "sram")
        return _wrap(out)
    # leaving the device over the host link: never hand out the device memory itself
    _charge(out, "host")
    return out.clone() if out is inner else out


def _compatible_shallow_copy(func, args, kwargs):
    """Module.to's check whether `.data =` can swap in place: both sidra, or neither."""
    return isinstance(args[0], SidraTensor) == isinstance(args[1], SidraTensor)


_SPECIAL = {
    aten._has_compatible_shallow_copy_type.default: _compatible_shallow_copy,
    aten.to.device: _to,
    aten.to.other: _to,
    aten.to.dtype_layout: _to,
    aten.to.dtype: _to,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.is_pinned.default: _is_pinned,
}


def _fix_device_kw(kwargs):
    """Returns (kwargs', wrap?) for ops with a `device=` argument."""
    d = kwargs.get("device")
    if d is None:
        return kwargs, True
    d = _as_device(d)
    kw = dict(kwargs)
    if d.type == DEVICE_TYPE:
        kw["device"] = CPU
        return kw, True
    return kw, False


# --------------------------------------------------------------------------
# the dispatcher
# --------------------------------------------------------------------------
@_runtime.on_one_torch_thread
def _torch_dispatch(cls, func, types, args=(), kwargs=None):
    try:
        info = func._sidra_info
    except AttributeError:
        info = _analyze(func)
    if info.special is not None:
        if observer is not None:
            return observer(func, info.special_runner, args, args, kwargs or {})
        return info.special(func, args, kwargs or {})
    uargs = _unwrap_args(args, info.check)
    do_wrap = True
    ukwargs = {}
    if kwargs:
        if info.has_device:
            kwargs, do_wrap = _fix_device_kw(kwargs)
        ukwargs = _unwrap_kwargs(kwargs, info.check)
    runner = info.runner if not (_runtime.QUIET.on or _torch_compiler._is_compiling_flag) else None
    if runner is not None:
        if observer is not None:
            out = observer(func, runner, args, uargs, ukwargs)
        elif _autograd_profiler._is_profiler_enabled:
            out = _ranged(func, runner, args, uargs, ukwargs)
        else:
            out = runner(func, args, uargs, ukwargs)
    elif ukwargs:
        out = info.op(*uargs, **ukwargs)
    else:
        out = info.op(*uargs)

    kind = info.kind
    if kind == _OpInfo.FUNCTIONAL:
        if not do_wrap:
            return out
        track_new(out)
        return _wrap_out(out)
    if kind == _OpInfo.VIEW:
        if out is uargs[0]:
            # ops annotated as (possible) aliases that returned their input
            # unchanged (contiguous/reshape/to/expand_as... when they reach
            # dispatch under inference_mode): return the input wrapper itself
            return args[0]
        if _is_inference_mode() and not args[0].is_inference():
            # a view of a normal tensor taken under inference_mode must be a
            # normal tensor (autograd shares the base's version counter with
            # it; an inference-tensor wrapper -> "Cannot set version_counter
            # for inference tensor")
            with _no_inference_mode():
                res = _wrap_out(out)
        else:
            res = _wrap_out(out)
        if _view_tag is not None:
            _view_tag(func, args, res)
        return res
    # MUTATING: return the wrapper objects that alias the mutated inputs
    mut = info.mut_args
    if len(mut) == 1:
        idx, name, kwonly = mut[0]
        res = kwargs[name] if kwonly else args[idx] if idx < len(args) else kwargs[name]
        if res.shape != out.shape or info.meta_mut:
            _sync_meta(res, out)  # t_/unsqueeze_/set_/resize by out= ...
        if _written is not None:
            _written(res)
        return res
    outs = []
    for m, o in zip(mut, out if isinstance(out, (tuple, list)) else (out,)):
        if m is None:
            outs.append(_wrap(o) if isinstance(o, _Tensor) else o)
        else:
            idx, name, kwonly = m
            res = kwargs[name] if kwonly else args[idx] if idx < len(args) else kwargs[name]
            if isinstance(o, _Tensor) and res.shape != o.shape:
                _sync_meta(res, o)
            if _written is not None:
                _written(res)
            outs.append(res)
    return tuple(outs)


SidraTensor.__torch_dispatch__ = classmethod(_torch_dispatch)

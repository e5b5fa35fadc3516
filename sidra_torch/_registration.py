"""Registers PrivateUse1 as the `sidra` device (pure Python, idempotent).

What `register()` does:
  1. torch.utils.backend_registration._setup_privateuseone_for_python_backend(
        "sidra", backend_module=torch.sidra, hook=..., device_guard=...)
     -> renames PrivateUse1, generates Tensor.sidra()/is_sidra, Module.sidra(),
        registers torch.sidra and the Python PrivateUse1 hooks + device guard
        (torch._C._acc) that autograd's engine needs.
  2. factory kernels on the PrivateUse1 key (the only way to catch
     torch.randn(..., device="sidra:0") & co, which have no tensor argument):
       * a boxed fallback for everything that has no kernel (empty.memory_format,
         empty_strided, ...)
       * explicit per-op kernels for the CompositeExplicitAutograd factories
         (arange/full/zeros/ones/rand*/eye/linspace/...) because their composite
         kernel would do empty()+in-place/out= ops and the out= ones resize.
  3. a fallthrough on AutocastPrivateUse1 (else every op errors under
     torch.autocast("sidra")), optionally lower-precision autocast kernels.
  4. serialization hooks (serialization.py).
What the device installs process-wide once it is used: sidra_torch.first_use.
"""
from __future__ import annotations

import copyreg
import threading
import weakref

import torch
import torch.utils.backend_registration as _br

from . import device_module
from . import runtime as _runtime
from . import tensor as _t
from .dispatch import nbytes

_LOCK = threading.Lock()
_REGISTERED = False
_LIBS: list = []  # keep torch.library.Library objects alive


# --------------------------------------------------------------------------
# C++ hooks (torch._C._acc)
# --------------------------------------------------------------------------
class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    # the Python device guard only reports its type; the C++ side behaves as a
    # single-device guard (current device is always index 0).
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


# --------------------------------------------------------------------------
# factories
# --------------------------------------------------------------------------
def _cpu_kwargs(kwargs):
    kw = dict(kwargs)
    if kw.get("device") is not None:
        _t._as_device(kw["device"])  # only sidra:0 exists
        kw["device"] = _t.CPU
    kw.pop("pin_memory", None)
    return kw


def _new_on_device(out):
    """A factory result: count it against device memory, price writing it, wrap it."""
    _t.track_new(out)
    if not _runtime.unpriced():
        _runtime.current_chip().charge_memory(nbytes(out), "sram")
    return _t._wrap_out(out)


def _factory(op, args, _uargs, kwargs):
    return _new_on_device(op(*args, **_cpu_kwargs(kwargs)))


_factory.where = "memory"


def _run_observed(op, runner, args, kwargs):
    """Kernels on the PrivateUse1 key bypass __torch_dispatch__: let the profiler see them too."""
    if _t.observer is not None:
        return _t.observer(op, runner, args, args, kwargs)
    return runner(op, args, args, kwargs)


def _factory_fallback(op, *args, **kwargs):
    """Boxed fallback on PrivateUse1: any op that reaches the sidra backend key
    without a Python-key tensor (i.e. factories: empty.memory_format,
    empty_strided, ...).  Run it on CPU and wrap."""
    if any(isinstance(a, torch.Tensor) for a in args):
        # a plain (non-wrapper) PrivateUse1 tensor would land here; we never
        # create those, so this is a bug
        raise NotImplementedError(f"sidra fallback: unexpected tensor args for {op}")
    return _run_observed(op, _factory, args, kwargs)


def _make_factory_kernel(op_overload):
    def kernel(*args, **kwargs):
        return _run_observed(op_overload, _factory, args, kwargs)

    return kernel


# CompositeExplicitAutograd factories (have a kernel that would be used for
# PrivateUse1).  Registering a PrivateUse1 kernel overrides it: one CPU call +
# one wrap instead of empty()+fill_/normal_/arange.out(resize!).
_FACTORY_OPS = [
    "arange", "arange.start", "arange.start_step",
    "full", "full.names",
    "zeros", "zeros.names", "ones", "ones.names",
    "rand", "rand.generator", "randn", "randn.generator",
    "randint", "randint.generator", "randint.low", "randint.low_generator",
    "randperm", "randperm.generator",
    "eye", "eye.m",
    "linspace", "logspace",
    "scalar_tensor",
    "empty.memory_format", "empty_strided",
    "tril_indices", "triu_indices",
    "normal.float_float", "normal.float_float_out",
]


def _register_factories():
    lib = torch.library.Library("_", "IMPL")  # noqa: TOR901
    lib.fallback(_factory_fallback, "PrivateUse1")
    _LIBS.append(lib)
    alib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    for name in _FACTORY_OPS:
        base, _, overload = name.partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
        except AttributeError:
            continue
        if "out" in overload:
            continue
        alib.impl(name, _make_factory_kernel(op), "PrivateUse1")
    _LIBS.append(alib)


def _copy_from(src, dst, non_blocking=False):
    return _run_observed(torch.ops.aten._copy_from.default, _copy_from_runner, (src, dst, non_blocking), {})


def _copy_from_runner(_op, args, _uargs, _kwargs):
    return _copy_from_impl(*args)


_copy_from_runner.where = "memory"


def _copy_from_impl(src, dst, non_blocking=False):
    # Reached when the Python key is excluded (torch.tensor(..., device=) does
    # that) and copy_'s CompositeExplicitAutograd kernel calls _copy_from for a
    # non-CPU destination.  A *boxed fallback* cannot handle this: the Python
    # fallback trampoline asserts (python_dispatch.cpp "func != nullptr") when
    # an argument has the Python key, so it must be a per-op kernel.
    s = src._inner if isinstance(src, _t.SidraTensor) else src
    d = dst._inner if isinstance(dst, _t.SidraTensor) else dst
    d.copy_(s, non_blocking)
    _t.charge_copy(dst, src, d)
    return dst


def _copy_from_and_resize(src, dst):
    return _copy_from(src, dst)


def _register_copy_kernels():
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    _LIBS.append(lib)


def _sdpa_autograd(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                   enable_gqa=False):
    """scaled_dot_product_attention at the autograd key of sidra tensors.

    PyTorch picks a fused attention kernel through a C++ dispatch stub a Python backend cannot fill,
    so on the device it would always decompose into the math path's ops. Without gradients to record,
    attention the engine runs whole (`dispatch.fused_attention`) goes on to the device as one op (one
    program), as under inference_mode and as CUDA runs its fused kernels; the rest, the math
    decomposition as before.
    """
    from .dispatch import fused_attention

    op = torch.ops.aten.scaled_dot_product_attention.default
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, attn_mask))
    if grads or not fused_attention(query, key, value, attn_mask, dropout_p, enable_gqa):
        return op.decompose(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    with torch._C._AutoDispatchBelowAutograd():
        return op(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _register_sdpa():
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    lib.impl("scaled_dot_product_attention", _sdpa_autograd, "AutogradPrivateUse1")
    _LIBS.append(lib)


def _register_autocast():
    lib = torch.library.Library("_", "IMPL")  # noqa: TOR901
    lib.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    _LIBS.append(lib)


# --------------------------------------------------------------------------
# Module.to after a forward on the CPU
# --------------------------------------------------------------------------
_TORCH_SWAP_TENSORS = torch.utils.swap_tensors


def _moved_after_forward(grad_outputs):
    raise RuntimeError("a parameter of this graph moved to sidra:0 (Module.to) after the forward that made the graph; "
                       "call backward before moving the module, or run the forward again on the device")


def swap_tensors(t1, t2):
    """`torch.utils.swap_tensors`, which `Module.to` uses for wrapper subclasses, also for a CPU
    parameter that an autograd graph still holds (a forward on the CPU whose outputs are alive).

    torch refuses that swap (the graph holds the parameter's TensorImpl), so `.to("sidra:0")` failed
    where `.to("cuda")`, which assigns `.data`, works. The graph keeps the old CPU tensor, as it
    was; its gradient accumulator is poisoned, as torch does for the one case it allows, so a
    backward through that graph raises instead of filling a tensor the module no longer has. Every
    other swap is torch's own.
    """
    if (not isinstance(t2, _t.SidraTensor) or isinstance(t1, _t.SidraTensor) or t1._use_count() <= 2
            or weakref.getweakrefs(t1) or weakref.getweakrefs(t2)
            or copyreg._slotnames(type(t1)) or copyreg._slotnames(type(t2))):
        return _TORCH_SWAP_TENSORS(t1, t2)
    if t1.requires_grad and t1.is_leaf:
        torch.autograd.graph.get_gradient_edge(t1).node.register_prehook(_moved_after_forward)
    t1.__class__, t2.__class__ = t2.__class__, t1.__class__
    t1.__dict__, t2.__dict__ = t2.__dict__, t1.__dict__
    torch._C._swap_tensor_impl(t1, t2)


# --------------------------------------------------------------------------
def register() -> None:
    """Idempotent.  After this, "sidra:0" is a working device.

    `Module.to("sidra:0")` swaps parameters in place (SidraTensor is a
    traceable wrapper subclass), so tied weights stay tied on the device. The
    global `torch.__future__.set_swap_module_params_on_conversion` flag is left
    alone: it would change how every CPU module converts (and fail while an
    autograd graph holds its parameters), so `.to("cpu")` makes new CPU
    parameters, as for any subclass (HF models re-tie with `tie_weights()`).
    At the device's first use `torch.utils.swap_tensors` is replaced by `swap_tensors` above
    (sidra_torch.first_use), which differs from torch's only for a CPU tensor moving onto the
    device while a graph holds it.

    Returns:
        None.

    Raises:
        RuntimeError: torch's PrivateUse1 backend was already renamed to another device.
    """
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", _t.DEVICE_TYPE):
            raise RuntimeError(f"PrivateUse1 already renamed to {name!r}")
        if hasattr(torch, _t.DEVICE_TYPE):
            # someone (another copy of this module?) already did the setup
            _t.DEVICE = torch.device(_t.DEVICE_TYPE, 0)
            _REGISTERED = True
            return
        _br._setup_privateuseone_for_python_backend(
            _t.DEVICE_TYPE,
            backend_module=device_module,
            hook=_Hooks(),
            device_guard=_Guard(),
        )
        _t.DEVICE = torch.device(_t.DEVICE_TYPE, 0)
        _register_factories()
        _register_copy_kernels()
        _register_autocast()
        _register_sdpa()
        from . import serialization

        serialization.register()
        _REGISTERED = True

"""Which tensors are crossbar weights, and their programmed state on the chip.

A weight is a parameter or buffer on the device, or a view of one (`t`,
`transpose`, `permute`, `view` ...): views carry a link to their base, set
when the view is made. Each (chip, weight view) is programmed once and cached;
the weight's version counter (bumped by every in-place write: an optimizer
step, `load_state_dict`, `p.data.copy_`) tells when the cells must be
rewritten, which is done incrementally by ISPP.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch
from torch.ao.nn.quantized.dynamic import Linear as _DynamicQuantLinear

from sidra_core import EnduranceWarning, conv_weight_matrix, from_int8
from sidra_core.registry import WeightCopies

from . import runtime
from . import tensor as _t

_BASE = "_sidra_weight_base"
_NAME = "_sidra_weight"


def weight_base(t):
    """The weight `t` is (a view of), or None for an activation."""
    d = getattr(t, "__dict__", None)
    if not d:
        return None
    b = d.get(_BASE)
    if b is not None:
        return b
    if _NAME in d or d.get("_is_param", False):
        return t
    return None


def weight_name(base) -> str:
    return base.__dict__.get(_NAME, "parameter")


def _view_tag(func, args, res):
    src = args[0]
    base = weight_base(src)
    if base is None:
        return
    if type(res) is _t.SidraTensor:
        if res is not base:
            res.__dict__[_BASE] = base
    elif isinstance(res, (tuple, list)):
        for r in res:
            if type(r) is _t.SidraTensor:
                r.__dict__[_BASE] = base


class _Running(threading.local):
    qlinear = None  # the dynamically quantised Linear whose forward is running


_RUNNING = _Running()


def _tag_module(module, args):
    """Forward pre-hook on every module: name its device parameters and buffers (once).

    Skipped while dynamo traces: a compiled graph checks capacity and maps its weights itself.
    """
    if torch.compiler.is_compiling():
        return
    if isinstance(module, _DynamicQuantLinear):
        _RUNNING.qlinear = module
    if module.__dict__.get("_sidra_tagged"):
        return
    module.__dict__["_sidra_tagged"] = True
    for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if isinstance(t, _t.SidraTensor):
            t.__dict__.setdefault(_NAME, f"{type(module).__name__}.{name}")
    # The outermost module runs first: it checks the whole model before anything is programmed.
    _check_fits(module)


def _leave_module(module, args, output):
    """Forward hook: a quantized Linear's forward is over (its weights are no longer the context)."""
    if not torch.compiler.is_compiling() and _RUNNING.qlinear is module:
        _RUNNING.qlinear = None


_HOOK = None


def install() -> None:
    """Idempotent: the global module hooks that name parameters and check capacity as modules run
    (installed at the device's first use: sidra_torch.first_use)."""
    global _HOOK
    if _HOOK is None:
        _HOOK = (torch.nn.modules.module.register_module_forward_pre_hook(_tag_module),
                 torch.nn.modules.module.register_module_forward_hook(_leave_module, always_call=True))


# ---------------------------------------------------------------------------
# Capacity: refuse a model that cannot fit before programming any of it.


def crossbar_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, tuple[int, int]]]:
    """The weights a module's layers will put on crossbars (Linear, Conv, HF Conv1D), with K x N."""
    seen, out = set(), []
    for name, m in module.named_modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, _t.SidraTensor) or id(w) in seen:
            continue
        if isinstance(m, torch.nn.Linear):
            shape = (w.shape[1], w.shape[0])
        elif isinstance(m, torch.nn.modules.conv._ConvNd) and not m.transposed:
            shape = (m.in_channels * int(np.prod(w.shape[2:])), w.shape[0])
        elif type(m).__name__ == "Conv1D" and w.dim() == 2:  # transformers' GPT-2 layer: x @ W
            shape = (w.shape[0], w.shape[1])
        else:
            continue
        seen.add(id(w))
        out.append((name or type(m).__name__, w, shape))
    return out


def _check_fits(module) -> None:
    """Before a module's first forward: will all its crossbar weights fit on the chip?"""
    chip = runtime.current_chip()
    pending = [shape for _, w, shape in crossbar_weights(module) if not programmed_on(w, chip)]
    if pending:
        chip.check_fits(pending, name=f"{type(module).__name__} ({len(pending)} crossbar weights)")


def programmed_on(base, chip) -> bool:
    """Does the chip hold a programmed copy (any view) of this weight?"""
    copies = base.__dict__.get(_TABLE)
    return copies is not None and copies.on(chip)


# ---------------------------------------------------------------------------
# Programmed state per (chip, weight view): sidra_core's registry, kept in the weight's __dict__ (not
# a weakref on the tensor: `Module.to` swaps parameters with `torch.utils.swap_tensors`, which refuses
# tensors that have weakrefs). The tiles are freed when the weight dies.

_TABLE = "_sidra_residents"


def _table(base) -> WeightCopies:
    table = base.__dict__.get(_TABLE)
    if table is None:
        table = base.__dict__[_TABLE] = WeightCopies()
    return table


_WRITES = "_sidra_writes"


def _count_write(t) -> None:
    """An in-place op wrote into `t`: if it is (a view of, or `.data` of) a weight, note it."""
    base = weight_base(t)
    if base is not None:
        base.__dict__[_WRITES] = base.__dict__.get(_WRITES, 0) + 1


def _version(base) -> tuple:
    # An inference tensor (a model moved under torch.inference_mode) has no version counter; the
    # in-place writes that reach the device are still counted (_count_write).
    version = -1 if base.is_inference() else base._version
    return (version, base.__dict__.get(_WRITES, 0), id(base._inner))


def host_values(view) -> np.ndarray:
    """A device weight view's values as float32 on the host (a strided view of the weight where it
    can be: programming reads it once, into INT8 codes)."""
    return view._inner.detach().to(torch.float32).numpy()


def matrix(view, transpose: bool) -> np.ndarray:
    """The K x N matrix a weight view presents to the crossbar (`host_values`, transposed if asked)."""
    m = host_values(view)
    return m.T if transpose else m


def _key(view, layout) -> tuple:
    """A weight view's registry key: where its cells are in the weight and how the crossbar holds
    them (`layout` False: as is, True: transposed, or a tag such as a convolution's). W held
    transposed and a transposed view of W held as is are one copy."""
    inner, base = view._inner, weight_base(view)._inner
    shape, stride = tuple(inner.shape), tuple(inner.stride())
    if layout is True:
        shape, stride, layout = shape[::-1], stride[::-1], False
    return inner.storage_offset() - base.storage_offset(), shape, stride, layout


def resident(chip, view, layout=False, matrix_fn=matrix):
    """The chip's programmed copy of a weight view, programmed or reprogrammed as needed;
    `matrix_fn(view, layout)` is the K x N matrix it holds."""
    base = weight_base(view)
    res, done = _table(base).get(chip, _key(view, layout), _version(base), lambda: matrix_fn(view, layout),
                                 name=weight_name(base))
    if done == "programmed":
        runtime.notify_programmed(res)
    elif done == "reprogrammed":
        _note_reprogram(chip, res)
    return res


def fresh(chip, view, layout=False):
    """The chip's copy of a weight view if it is programmed and current, else None."""
    base = weight_base(view)
    return _table(base).fresh(chip, _key(view, layout), _version(base))


def held(chip, view, layout=False) -> bool:
    """Whether the chip holds a copy of a weight view (current or not)."""
    return _table(weight_base(view)).held(chip, _key(view, layout))


def conv_layout(groups: int) -> tuple:
    """The layout tag of a convolution kernel on the crossbar: unrolled to (C_in/groups x k...) x C_out."""
    return "conv", int(groups)


def conv_matrix(view, layout) -> np.ndarray:
    """`matrix_fn` of a convolution kernel (`layout` from conv_layout)."""
    return conv_weight_matrix(host_values(view), layout[1])


_REPROGRAMMED: dict = {}  # chip id -> residents reprogrammed, in order (the last few)
_WARNED: set = set()


def _note_reprogram(chip, res) -> None:
    """Y1 trains the last layer on chip; warn once when a training step rewrites several layers.

    A step's reprogramming is what happened since this weight was last
    reprogrammed: several distinct weights there means full-model training.
    """
    order = _REPROGRAMMED.setdefault(id(chip), [])
    cycle = order[len(order) - 1 - order[::-1].index(id(res)) + 1:] if id(res) in order else []
    order.append(id(res))
    del order[:-64]
    if len(set(cycle) - {id(res)}) >= 1 and id(chip) not in _WARNED:
        _WARNED.add(id(chip))
        warnings.warn(
            "more than one layer is being reprogrammed on the chip: full-model training rewrites every "
            "layer's cells each step (ISPP pulses, time and energy are charged) and RRAM cells endure "
            f"~{chip.spec.ispp.endurance:.0e} writes; Y1 is built for last-layer fine-tuning",
            EnduranceWarning, stacklevel=4,
        )


def residents_of(base) -> list:
    """Every programmed copy of a weight (one per chip and view)."""
    copies = base.__dict__.get(_TABLE)
    return [] if copies is None else copies.residents()


# ---------------------------------------------------------------------------
# Models quantised by torch.ao (quantize_dynamic): their own INT8 codes go to the tiles.

def quantised_resident(chip, packed):
    """The chip's copy of a dynamically quantised Linear, programmed from its INT8 codes and scales.

    Packed parameters reach dispatch as fresh Python objects each call, so the
    programmed copy is kept on the module whose forward is running (and freed
    with it). The packed parameters are immutable: programmed once per chip.
    Returns (resident, bias) or None outside such a module's forward.
    """
    module = _RUNNING.qlinear
    if module is None:
        return None
    qweight, bias = torch.ops.quantized.linear_unpack(packed)

    def contents():
        codes, scale = int8_codes(qweight)
        return from_int8(np.ascontiguousarray(codes.T), scale)

    res, done = _table(module).get(chip, "quantised", None, contents,
                                   name=module.__dict__.get(_NAME, "quantized.Linear"))
    if done == "programmed":
        runtime.notify_programmed(res)
    return res, bias


def int8_codes(qweight) -> tuple[np.ndarray, np.ndarray]:
    """(codes (N, K) int8, scale (N,)) of a symmetric qint8 weight, per tensor or per channel."""
    scheme = qweight.qscheme()
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        zero = np.array([qweight.q_zero_point()])
        scale = np.full(qweight.shape[0], qweight.q_scale(), np.float32)
    elif scheme in (torch.per_channel_affine, torch.per_channel_symmetric) and qweight.q_per_channel_axis() == 0:
        zero = qweight.q_per_channel_zero_points().numpy()
        scale = qweight.q_per_channel_scales().numpy().astype(np.float32)
    else:
        raise NotImplementedError(f"SIDRA programs symmetric qint8 weights per tensor or per output channel; got {scheme}")
    if np.any(zero != 0):
        raise NotImplementedError("SIDRA's differential cells hold symmetric INT8 codes: the weight's zero point must be 0")
    return qweight.int_repr().numpy(), scale


# Device tensors link their views to a weight and count in-place writes into it through these.
_t._view_tag = _view_tag
_t._written = _count_write

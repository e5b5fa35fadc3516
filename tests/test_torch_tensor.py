"""sidra_torch: registration of the device and the semantics of sidra tensors.

Import/registration, torch.device, Tensor.sidra()/Module.sidra(), factories,
transfers, numpy(), printing, views and in-place aliasing, deepcopy,
state_dict, torch.save/torch.load with map_location, tied weights.
"""

from __future__ import annotations

import copy
import importlib
import json
import subprocess
import sys

import pytest
import torch

import sidra_torch
from sidra_torch import SidraTensor

from conftest_torch import SAME_DEVICE_MSG as SAME_DEVICE
from conftest_torch import (D, DEV, assert_close, ideal, no_warnings,  # noqa: F401
                            restore_chip, roundtrip)


@pytest.fixture(autouse=True)
def _on_ideal(ideal):
    """Tensor semantics are checked for exact values: run every test on the ideal chip."""
    yield


# ---------------------------------------------------------------------------
# registration


def test_import_registers_the_device():
    assert torch._C._get_privateuse1_backend_name() == "sidra"
    assert torch.sidra.is_available()
    assert torch.sidra.device_count() == 1
    assert torch.get_device_module("sidra") is torch.sidra


_PROCESS_STATE = """
import io, json, warnings
import torch, torch._dynamo, torch._utils, torch.utils
import torch.autograd.profiler as ap
def ours(fn):
    return "sidra_torch" in fn.__code__.co_filename
def state():
    m = torch.nn.modules.module
    return {"module hooks": [len(m._global_forward_pre_hooks), len(m._global_forward_hooks)],
            "rebuild_tensor": ours(torch._utils._rebuild_tensor),
            "swap_tensors": ours(torch.utils.swap_tensors),
            "profiler parse": ours(ap.profile._parse_kineto_results),
            "specialize_float": torch._dynamo.config.specialize_float,
            "warning filters": len(warnings.filters)}
states = [state()]
import sidra_torch
states.append(state())
x = torch.ones(2, device="sidra:0")
states.append(state())
buf = io.BytesIO()
torch.save(x, buf)
buf.seek(0)
assert torch.load(buf).device.type == "sidra"
states.append(state())
with torch.no_grad():
    torch.compile(torch.nn.Linear(2, 2).to("sidra:0"), backend="sidra")(x)
states.append(state())
print(json.dumps(states))
"""


def test_importing_sidra_torch_changes_nothing_until_the_device_is_used():
    """Importing only registers the device: torch's global module hooks, swap_tensors, profiler
    parsing, tensor rebuilding, dynamo config and warning filters are as they were. The device's
    first tensor installs the process-wide pieces sidra_torch.first_use lists; loading a device
    checkpoint wraps the rebuild of tensors; compiling for the device adds one warning filter and
    leaves dynamo's config alone."""
    out = subprocess.run([sys.executable, "-c", _PROCESS_STATE], capture_output=True, text=True, check=True)
    before, imported, used, loaded, compiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == before
    changed = {k for k in before if used[k] != before[k]}
    assert changed == {"module hooks", "swap_tensors", "profiler parse"}
    assert used["module hooks"] == [1, 1] and used["swap_tensors"] and used["profiler parse"]
    assert loaded["rebuild_tensor"] and not used["rebuild_tensor"]
    assert {k for k in loaded if compiled[k] != loaded[k]} == {"warning filters"}
    assert compiled["warning filters"] == loaded["warning filters"] + 1


def test_register_is_idempotent():
    mod = torch.sidra
    sidra_torch.register()
    sidra_torch.register()
    again = importlib.import_module("sidra_torch")
    assert again is sidra_torch
    assert torch.sidra is mod
    assert torch._C._get_privateuse1_backend_name() == "sidra"
    # still a working device after the repeated registration
    t = torch.ones(3, device=D) * 2
    assert t.device == DEV and t.cpu().tolist() == [2.0, 2.0, 2.0]


@pytest.fixture
def reloaded_sidra_torch():
    """importlib.reload(sidra_torch) + register() again; global hooks it adds are removed afterwards."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    before = set(hooks)
    try:
        mod = importlib.reload(sidra_torch)
        mod.register()
        yield mod, len(hooks) - len(before)
    finally:
        for k in set(hooks) - before:
            del hooks[k]


def test_reload_keeps_the_device_working(reloaded_sidra_torch):
    mod, _ = reloaded_sidra_torch
    assert mod.SidraTensor is SidraTensor
    assert torch.sidra.device_count() == 1
    lin = torch.nn.Linear(3, 2)
    dev = copy.deepcopy(lin).to(D)
    x = torch.randn(1, 3)
    assert_close(dev(x.to(D)), lin(x))


def test_reload_does_not_duplicate_global_hooks(reloaded_sidra_torch):
    _, added = reloaded_sidra_torch
    assert added == 0


def test_torch_device_objects():
    assert str(torch.device("sidra:0")) == "sidra:0"
    assert torch.device("sidra").type == "sidra"
    assert torch.device("sidra", 0) == DEV
    assert sidra_torch.DEVICE == DEV
    # "sidra" without an index means sidra:0
    assert torch.zeros(2, device="sidra").device == DEV


def test_invalid_device_ordinal_is_rejected():
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.zeros(2, device="sidra:1")


def test_tensor_sidra_and_is_sidra():
    c = torch.randn(3)
    t = c.sidra()
    assert type(t) is SidraTensor
    assert t.device == DEV and t.is_sidra
    assert not c.is_sidra
    assert torch.equal(t.cpu(), c)


def test_module_sidra():
    m = torch.nn.Linear(3, 2)
    w = m.weight.detach().clone()
    assert m.sidra() is m
    assert all(p.device == DEV and isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert torch.equal(m.weight.cpu(), w)


# ---------------------------------------------------------------------------
# factories

FACTORIES = {
    "empty": lambda: torch.empty(2, 3, device=D),
    "zeros": lambda: torch.zeros(2, 3, device=D),
    "ones": lambda: torch.ones(2, 3, device=D),
    "full": lambda: torch.full((2, 3), 7.0, device=D),
    "randn": lambda: torch.randn(2, 3, device=D),
    "rand": lambda: torch.rand(2, 3, device=D),
    "randint": lambda: torch.randint(0, 5, (2, 3), device=D),
    "arange": lambda: torch.arange(0, 10, 2, device=D),
    "arange_float": lambda: torch.arange(0.5, 3.0, 0.5, device=D),
    "eye": lambda: torch.eye(3, device=D),
    "linspace": lambda: torch.linspace(0, 1, 5, device=D),
    "tensor": lambda: torch.tensor([[1, 2], [3, 4]], device=D),
    "tensor_scalar": lambda: torch.tensor(3.5, device=D),
    "as_tensor": lambda: torch.as_tensor([1.0, 2.0], device=D),
    "randperm": lambda: torch.randperm(5, device=D),
    "scalar_tensor": lambda: torch.scalar_tensor(2.0, device=D),
    "tril_indices": lambda: torch.tril_indices(3, 3, device=D),
}

# (factory on sidra, the same on cpu): values must match exactly
DETERMINISTIC = {
    "zeros": (lambda d: torch.zeros(2, 3, device=d)),
    "ones": (lambda d: torch.ones(2, 3, device=d, dtype=torch.float16)),
    "full": (lambda d: torch.full((2, 3), 7.0, device=d)),
    "full_int": (lambda d: torch.full((2, 3), 7, device=d)),
    "arange": (lambda d: torch.arange(0, 10, 2, device=d)),
    "arange_float": (lambda d: torch.arange(0.5, 3.0, 0.5, device=d)),
    "eye": (lambda d: torch.eye(3, 4, device=d)),
    "linspace": (lambda d: torch.linspace(0, 1, 5, device=d)),
    "tensor": (lambda d: torch.tensor([[1, 2], [3, 4]], device=d)),
    "tensor_bool": (lambda d: torch.tensor([True, False], device=d)),
    "tensor_scalar": (lambda d: torch.tensor(3.5, device=d)),
    "tril_indices": (lambda d: torch.tril_indices(3, 3, device=d)),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factory_makes_a_sidra_tensor(name):
    t = FACTORIES[name]()
    assert type(t) is SidraTensor
    assert t.device == DEV
    assert t.cpu().device.type == "cpu"


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_factory_values_and_dtype_match_cpu(name):
    f = DETERMINISTIC[name]
    s, c = f(D), f("cpu")
    assert s.dtype == c.dtype and s.shape == c.shape
    assert torch.equal(s.cpu(), c)


@pytest.mark.parametrize("fn", ["randn", "rand", "randint", "randperm"])
def test_random_factories_use_the_host_generator(fn):
    make = {
        "randn": lambda d: torch.randn(4, 5, device=d),
        "rand": lambda d: torch.rand(4, 5, device=d),
        "randint": lambda d: torch.randint(0, 9, (4, 5), device=d),
        "randperm": lambda d: torch.randperm(7, device=d),
    }[fn]
    torch.manual_seed(123)
    s = make(D)
    torch.manual_seed(123)
    c = make("cpu")
    assert s.device == DEV and s.dtype == c.dtype
    assert torch.equal(s.cpu(), c)


LIKE = {
    "empty_like": lambda a: torch.empty_like(a),
    "zeros_like": lambda a: torch.zeros_like(a),
    "ones_like": lambda a: torch.ones_like(a),
    "full_like": lambda a: torch.full_like(a, 2.0),
    "rand_like": lambda a: torch.rand_like(a),
    "randn_like": lambda a: torch.randn_like(a),
    "randint_like": lambda a: torch.randint_like(a, 10),
    "new_zeros": lambda a: a.new_zeros(4),
    "new_ones": lambda a: a.new_ones(4),
    "new_full": lambda a: a.new_full((4,), 3.0),
    "new_empty": lambda a: a.new_empty(4),
    "new_tensor": lambda a: a.new_tensor([1.0, 2.0]),
}


@pytest.mark.parametrize("name", sorted(LIKE))
def test_like_factories_stay_on_device(name):
    a = torch.randn(2, 3, device=D)
    t = LIKE[name](a)
    assert type(t) is SidraTensor and t.device == DEV
    assert t.dtype == a.dtype


def test_like_factory_values():
    a = torch.randn(2, 3, device=D)
    assert torch.equal(torch.zeros_like(a).cpu(), torch.zeros(2, 3))
    assert torch.equal(torch.ones_like(a).cpu(), torch.ones(2, 3))
    assert torch.equal(torch.full_like(a, 2.5).cpu(), torch.full((2, 3), 2.5))
    assert torch.equal(a.new_tensor([1, 2]).cpu(), torch.tensor([1, 2]))


def test_like_factory_with_cpu_device_leaves_the_device():
    a = torch.randn(2, 3, device=D)
    z = torch.zeros_like(a, device="cpu")
    assert type(z) is torch.Tensor and z.device.type == "cpu"


def test_default_device_and_device_context():
    with torch.device(D):
        assert torch.zeros(2).device == DEV
        assert torch.nn.Linear(2, 2).weight.device == DEV
    torch.set_default_device(D)
    try:
        assert torch.randn(2).device == DEV
    finally:
        torch.set_default_device("cpu")
    assert torch.randn(2).device.type == "cpu"


def test_module_constructed_on_device():
    m = torch.nn.Linear(4, 4, device=D)
    assert m.weight.device == DEV and isinstance(m.weight, torch.nn.Parameter)
    assert torch.isfinite(m.weight.cpu()).all()
    t = torch.nn.init.trunc_normal_(torch.empty(3, 3, device=D))
    assert t.device == DEV and torch.isfinite(t.cpu()).all()


# ---------------------------------------------------------------------------
# transfers


def test_to_device_and_back():
    c = torch.randn(4, 5)
    s = c.to(D)
    assert type(s) is SidraTensor and s.device == DEV
    back = s.to("cpu")
    assert type(back) is torch.Tensor and back.device.type == "cpu"
    assert torch.equal(back, c)
    assert type(s.cpu()) is torch.Tensor and torch.equal(s.cpu(), c)
    assert torch.equal(s.to(torch.device("cpu")), c)


def test_to_cpu_is_a_copy_not_the_device_memory():
    s = torch.zeros(3, device=D)
    c = s.cpu()
    c.fill_(5)
    assert s.cpu().tolist() == [0.0, 0.0, 0.0]
    c2 = s.to("cpu")
    c2.fill_(7)
    assert s.cpu().tolist() == [0.0, 0.0, 0.0]


def test_to_cpu_under_inference_mode_is_a_copy():
    s = torch.zeros(3, device=D)
    with torch.inference_mode():
        c = s.to("cpu")
        c.fill_(5)
    assert type(c) is torch.Tensor
    assert s.cpu().tolist() == [0.0, 0.0, 0.0]


def test_to_same_device_is_a_noop():
    s = torch.randn(3, device=D)
    assert s.to(D) is s
    assert s.to(DEV) is s
    assert s.sidra() is s


def test_to_dtype_stays_on_device():
    s = torch.randn(3, device=D)
    h = s.to(torch.float16)
    assert h.device == DEV and h.dtype == torch.float16
    assert torch.equal(h.cpu(), s.cpu().half())


def test_copy_between_devices():
    c = torch.randn(4, 5)
    s = c.to(D)
    assert torch.equal(torch.empty(4, 5, device=D).copy_(s).cpu(), c)
    assert torch.equal(torch.empty(4, 5, device=D).copy_(c).cpu(), c)
    assert torch.equal(torch.empty(4, 5).copy_(s), c)


def test_item_tolist_and_python_scalars():
    c = torch.randn(2, 3)
    s = c.to(D)
    assert s[0, 1].item() == c[0, 1].item()
    assert s.tolist() == c.tolist()
    assert bool(torch.tensor(1.0, device=D) > 0)
    assert int(torch.tensor(3, device=D)) == 3
    assert float(torch.tensor(2.5, device=D)) == 2.5
    assert f"{torch.tensor(2.5, device=D):.2f}" == "2.50"


def test_numpy_raises_type_error_like_cuda():
    s = torch.randn(3, device=D)
    with pytest.raises(TypeError, match=r"can't convert sidra:0 device type tensor to numpy\. Use Tensor\.cpu\(\)"):
        s.numpy()
    import numpy as np

    with pytest.raises(TypeError):
        np.asarray(s)
    # the CPU copy converts fine
    assert s.cpu().numpy().shape == (3,)


# ---------------------------------------------------------------------------
# printing


@pytest.mark.parametrize("make", [
    lambda d: torch.tensor([1.0, 2.5], device=d),
    lambda d: torch.arange(6, device=d).view(2, 3),
    lambda d: torch.tensor(3.25, device=d),
    lambda d: torch.tensor([True, False], device=d),
    lambda d: torch.linspace(-1, 1, 2000, device=d),  # summarised with "..."
    lambda d: torch.zeros(0, 3, device=d),
    lambda d: torch.tensor([1.0, 2.0], dtype=torch.float16, device=d),
    lambda d: torch.tensor([1.0, 2.0], dtype=torch.float64, device=d),
], ids=["float", "int2d", "scalar", "bool", "summarised", "empty", "half", "double"])
def test_repr_like_cuda(make):
    c = make("cpu")
    s = make(D)
    expected = repr(c)
    # CUDA puts the device suffix first: before size= (empty tensors), dtype= or the closing parenthesis
    for key in (", size=", ", dtype="):
        if key in expected:
            expected = expected.replace(key, ", device='sidra:0'" + key, 1)
            break
    else:
        expected = expected[:-1] + ", device='sidra:0')"
    with no_warnings():
        r = repr(s)
        st = str(s)
    # (torch's formatter may wrap the suffix onto its own line: compare modulo whitespace)
    assert " ".join(r.split()) == " ".join(expected.split())
    assert r.startswith("tensor(") and r.endswith(")")
    assert st == r


def test_repr_of_parameter_and_grad_fn():
    lin = torch.nn.Linear(2, 1).to(D)
    with no_warnings():
        r = repr(lin.bias)
    assert r.startswith("Parameter containing:\ntensor([")
    assert r.endswith("device='sidra:0', requires_grad=True)")
    y = lin(torch.ones(1, 2, device=D))
    with no_warnings():
        ry = repr(y)
    assert "device='sidra:0'" in ry and "grad_fn=<" in ry


def test_printing_is_not_counted_as_device_ops():
    s = torch.randn(5, 5, device=D)
    torch.sidra.reset_counters()
    repr(s)
    c = torch.sidra.counters()
    assert c["engine_ops"] == 0 and c["fallback_ops"] == 0 and c["mvms"] == 0
    # reading the tensor to the host once is one transfer
    assert c["host_transfers"] == 1 and c["host_bytes"] == 5 * 5 * 4


def test_printing_a_float64_tensor_does_not_warn():
    from sidra_torch import dispatch

    dispatch._warned_dtypes.clear()
    s = torch.randn(3, dtype=torch.float64, device=D)
    with no_warnings():
        repr(s)


# ---------------------------------------------------------------------------
# views, in-place ops, aliasing


def test_inplace_on_view_updates_base():
    base = torch.zeros(3, 4, device=D)
    v = base[1]
    v.fill_(5)
    assert torch.equal(base.cpu()[1], torch.full((4,), 5.0))
    assert base.cpu()[0].abs().sum() == 0


def test_setitem_through_transposed_view():
    base = torch.zeros(3, 4, device=D)
    t = base.t()
    t[0, 2] = 9
    assert base[2, 0].item() == 9
    assert base.cpu().sum().item() == 9


def test_inplace_on_base_visible_through_views():
    base = torch.zeros(3, 4, device=D)
    v, t, flat = base[1], base.t(), base.view(12)
    base.add_(1)
    assert v[0].item() == 1 and t[0, 2].item() == 1
    flat[0] = -1
    assert base[0, 0].item() == -1
    assert torch.equal(flat.cpu(), base.cpu().reshape(-1))


def test_inplace_returns_the_same_object_and_bumps_version():
    x = torch.zeros(2, device=D)
    v = x[0]
    v0, x0 = v._version, x._version
    assert x.add_(1) is x
    assert x.mul_(2) is x
    assert x._version > x0
    assert v._version > v0  # views share the base's version counter
    assert x.cpu().tolist() == [2.0, 2.0]


def test_view_metadata_mirrors_cpu():
    c = torch.arange(24.0).reshape(2, 3, 4)
    s = c.to(D)
    for f in (lambda t: t.t() if t.dim() == 2 else t.transpose(0, 2), lambda t: t[:, 1:, ::2],
              lambda t: t.permute(2, 0, 1), lambda t: t.unsqueeze(1), lambda t: t.reshape(6, 4),
              lambda t: t.narrow(2, 1, 2), lambda t: t.expand(3, 2, 3, 4), lambda t: t.unflatten(2, (2, 2))):
        sv, cv = f(s), f(c)
        assert sv.shape == cv.shape and sv.stride() == cv.stride()
        assert sv.storage_offset() == cv.storage_offset()
        assert sv.is_contiguous() == cv.is_contiguous()
        assert torch.equal(sv.cpu(), cv)


def test_out_variant_and_resizing_out():
    base = torch.randn(3, 4, device=D)
    o = torch.empty(3, 4, device=D)
    r = torch.add(base, 1, out=o)
    assert r is o
    assert torch.equal(o.cpu(), base.cpu() + 1)
    ob = torch.empty(0, device=D)
    r = torch.cat([torch.ones(2, device=D)] * 2, out=ob)
    assert r is ob and ob.shape == (4,) and ob.cpu().tolist() == [1.0] * 4


def test_split_and_detach_alias():
    xs = torch.arange(6.0, device=D).reshape(2, 3)
    pieces = xs.split(1)
    pieces[1].zero_()
    assert xs.cpu()[1].abs().sum().item() == 0
    z = torch.zeros(2, device=D)
    z.detach().fill_(3)
    assert z.cpu().tolist() == [3.0, 3.0]


def test_inplace_metadata_ops():
    xm = torch.randn(2, 3, device=D)
    c = xm.cpu()
    assert xm.t_() is xm
    assert xm.shape == (3, 2) and xm.stride() == (1, 3)
    assert torch.equal(xm.cpu(), c.t())
    xm.unsqueeze_(0)
    assert xm.shape == (1, 3, 2)
    xm.squeeze_(0).transpose_(0, 1)
    assert xm.shape == (2, 3) and torch.equal(xm.cpu(), c)
    r = torch.zeros(3, device=D).resize_(5)
    assert r.shape == (5,)


def test_data_assignment():
    pa, pb = torch.randn(3, device=D), torch.randn(5, device=D)
    pa.data = pb
    assert pa.shape == (5,) and torch.equal(pa.cpu(), pb.cpu())
    p = torch.nn.Linear(3, 3).to(D).weight
    p.data = torch.zeros(3, 3, device=D)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert p.cpu().abs().sum().item() == 0
    with pytest.raises(RuntimeError, match="cannot assign a cpu tensor"):
        p.data = torch.zeros(3, 3)


def test_set_aliases_other_storage():
    a, b = torch.zeros(2, device=D), torch.zeros(4, device=D)
    a.set_(b)
    a.add_(1)
    assert a.shape == (4,) and b.cpu().tolist() == [1.0] * 4


def test_indexing_with_masks_and_index_tensors():
    c = torch.randn(4, 5)
    s = c.to(D)
    mask_c = c > 0
    mask_s = s > 0
    assert mask_s.dtype == torch.bool and mask_s.device == DEV
    assert torch.equal(s[mask_s].cpu(), c[mask_c])
    idx = torch.tensor([3, 0, 2], device=D)
    assert torch.equal(s[idx].cpu(), c[[3, 0, 2]])
    assert torch.equal(s[torch.tensor([1, 3])].cpu(), c[[1, 3]])  # cpu index tensor, like CUDA
    s2, c2 = s.clone(), c.clone()
    s2[mask_s] = 0.0
    c2[mask_c] = 0.0
    assert torch.equal(s2.cpu(), c2)
    assert torch.equal(torch.where(mask_s, s, torch.zeros_like(s)).cpu(), torch.where(mask_c, c, torch.zeros_like(c)))
    assert torch.equal(s.masked_fill(mask_s, -1.0).cpu(), c.masked_fill(mask_c, -1.0))


def test_storage_identity_follows_device_memory():
    # HF's tied-weight detection and safetensors look at data_ptr / untyped_storage
    a = torch.randn(4, device=D)
    v = a[1:]
    b = torch.randn(4, device=D)
    assert a.data_ptr() != 0
    assert a.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------
# deepcopy, state_dict


def test_deepcopy_module_makes_new_device_parameters():
    lin = torch.nn.Linear(4, 3).to(D)
    lin2 = copy.deepcopy(lin)
    for p1, p2 in zip(lin.parameters(), lin2.parameters()):
        assert p2 is not p1
        assert isinstance(p2, torch.nn.Parameter) and p2.device == DEV and p2.requires_grad
        assert torch.equal(p2.cpu(), p1.cpu())
    with torch.no_grad():
        lin2.weight.add_(1)
    assert not torch.equal(lin.weight.cpu(), lin2.weight.cpu())


def test_deepcopy_tensor():
    t = torch.randn(3, device=D, requires_grad=True)
    t.grad = torch.ones(3, device=D)
    d = copy.deepcopy(t)
    assert type(d) is SidraTensor and d.requires_grad and d is not t
    assert torch.equal(d.detach().cpu(), t.detach().cpu())
    assert d.grad is not None and d.grad.device == DEV
    with torch.no_grad():
        d.add_(1)
    assert not torch.equal(d.detach().cpu(), t.detach().cpu())
    # shared tensors stay shared in a deepcopy of a container
    x = torch.randn(2, device=D)
    a, b = copy.deepcopy([x, x])
    assert a is b


def test_deepcopy_of_a_programmed_weight_is_not_programmed():
    lin = torch.nn.Linear(8, 4).to(D)
    lin(torch.randn(2, 8, device=D))
    lin2 = copy.deepcopy(lin)
    torch.sidra.reset_counters()
    x = torch.randn(2, 8, device=D)
    assert_close(lin2(x), lin(x))
    assert torch.sidra.counters()["cells_programmed"] > 0  # the copy had to be programmed


def test_state_dict_sidra_to_cpu_and_back():
    lin = torch.nn.Linear(4, 3).to(D)
    sd = lin.state_dict()
    assert all(v.device == DEV for v in sd.values())
    cpu = torch.nn.Linear(4, 3)
    cpu.load_state_dict(sd)
    assert type(cpu.weight) is torch.nn.Parameter
    assert torch.equal(cpu.weight, lin.weight.cpu())
    other = torch.nn.Linear(4, 3).to(D)
    other.load_state_dict(cpu.state_dict())
    assert other.weight.device == DEV and isinstance(other.weight, torch.nn.Parameter)
    assert torch.equal(other.weight.cpu(), cpu.weight)


def test_load_state_dict_into_programmed_model_reprograms():
    x = torch.randn(3, 4, device=D)
    lin = torch.nn.Linear(4, 3).to(D)
    lin(x)  # programs the weight
    ref = torch.nn.Linear(4, 3)
    lin.load_state_dict(ref.state_dict())
    assert_close(lin(x), ref(x.cpu()))


# ---------------------------------------------------------------------------
# torch.save / torch.load


def test_save_load_keeps_sidra_tensors_on_device():
    x = torch.randn(3, 4, device=D)
    y = roundtrip(x)
    assert type(y) is SidraTensor and y.device == DEV
    assert torch.equal(y.cpu(), x.cpu())


@pytest.mark.parametrize("loc", ["cpu", torch.device("cpu"), {"sidra:0": "cpu"}],
                         ids=["str", "device", "dict"])
def test_save_load_map_location_cpu(loc):
    x = torch.randn(3, 4, device=D)
    y = roundtrip(x, map_location=loc)
    assert type(y) is torch.Tensor and y.device.type == "cpu"
    assert torch.equal(y, x.cpu())


@pytest.mark.parametrize("loc", ["sidra:0", DEV, {"cpu": "sidra:0"}], ids=["str", "device", "dict"])
def test_cpu_saved_tensor_map_location_sidra(loc):
    c = torch.randn(3, 4)
    y = roundtrip(c, map_location=loc)
    assert type(y) is SidraTensor and y.device == DEV
    assert torch.equal(y.cpu(), c)


def test_save_load_weights_only_false_map_location_sidra():
    c = torch.randn(3)
    y = roundtrip(c, map_location=D, weights_only=False)
    assert y.device == DEV and torch.equal(y.cpu(), c)


def test_load_without_map_location_restores_each_device():
    s, c = torch.randn(2, device=D), torch.randn(2)
    ys, yc = roundtrip([s, c])
    assert ys.device == DEV and type(yc) is torch.Tensor and yc.device.type == "cpu"


def test_save_load_dtypes():
    for t in (torch.randn(3).bfloat16(), torch.randn(3).half(), torch.arange(5), torch.tensor([True, False])):
        y = roundtrip(t.to(D))
        assert y.dtype == t.dtype and y.device == DEV and torch.equal(y.cpu(), t)


def test_saved_views_stay_aliased():
    x = torch.randn(3, 4, device=D)
    y0, y1 = roundtrip([x, x[1:]])
    y1.fill_(0)
    assert y0[1:].cpu().abs().sum().item() == 0
    assert y0[0].cpu().abs().sum().item() > 0


def test_state_dict_roundtrip():
    lin = torch.nn.Linear(4, 3).to(D)
    sd = roundtrip(lin.state_dict())
    assert all(v.device == DEV for v in sd.values())
    assert all(torch.equal(sd[k].cpu(), v.cpu()) for k, v in lin.state_dict().items())
    sdc = roundtrip(lin.state_dict(), map_location="cpu")
    assert all(type(v) is torch.Tensor for v in sdc.values())
    fresh = torch.nn.Linear(4, 3).to(D)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.weight.cpu(), lin.weight.cpu())


def test_parameter_and_module_roundtrip():
    p = roundtrip(torch.nn.Linear(2, 2).to(D).weight)
    assert isinstance(p, torch.nn.Parameter) and p.device == DEV and p.requires_grad
    lin = torch.nn.Linear(4, 3).to(D)
    m = roundtrip(lin, weights_only=False)
    assert m.weight.device == DEV and torch.equal(m.weight.cpu(), lin.weight.cpu())
    mc = roundtrip(lin, weights_only=False, map_location="cpu")
    assert type(mc.weight) is torch.nn.Parameter and mc.weight.device.type == "cpu"
    ms = roundtrip(torch.nn.Linear(2, 2), weights_only=False, map_location=D)
    assert ms.weight.device == DEV and isinstance(ms.weight, torch.nn.Parameter)
    x = torch.randn(2, 4)
    assert_close(m(x.to(D)), mc(x))


def test_save_load_to_file(tmp_path):
    lin = torch.nn.Linear(4, 3).to(D)
    f = tmp_path / "sd.pt"
    torch.save(lin.state_dict(), f)
    assert all(v.device == DEV for v in torch.load(f).values())
    assert all(v.device.type == "cpu" for v in torch.load(f, map_location="cpu").values())


# ---------------------------------------------------------------------------
# tied weights


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_tied_module_stays_tied_on_device():
    m = _Tied()
    n = len(list(m.parameters()))
    m.to(D)
    assert m.head.weight is m.emb.weight
    assert m.head.weight.device == DEV
    assert len(list(m.parameters())) == n
    ids = torch.tensor([[1, 2, 3]], device=D)
    m(ids).sum().backward()
    assert m.emb.weight.grad is not None and m.emb.weight.grad.device == DEV


def test_hf_gpt2_tied_weights_after_to_device():
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    g = transformers.GPT2LMHeadModel(cfg)
    assert g.lm_head.weight is g.transformer.wte.weight
    n = len(list(g.parameters()))
    g.to(D)
    assert g.lm_head.weight is g.transformer.wte.weight
    assert g.lm_head.weight.device == DEV
    assert len(list(g.parameters())) == n
    # safetensors/HF see one storage for the tied pair
    assert g.lm_head.weight.data_ptr() == g.transformer.wte.weight.data_ptr() != 0
    # .to("cpu") makes new CPU parameters by design; HF's tie_weights() re-ties them
    g.to("cpu")
    assert type(g.transformer.wte.weight) is torch.nn.Parameter
    g.tie_weights()
    assert g.lm_head.weight is g.transformer.wte.weight


def test_to_device_after_a_cpu_forward_whose_graph_is_alive():
    """The lines a quick script writes: a CPU forward with autograd on, then `.to`; as on CUDA."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(2, 8)
    ref = m(x)      # autograd graph alive, as in any quick script
    m.to("sidra:0")
    assert all(p.device == DEV and isinstance(p, torch.nn.Parameter) for p in m.parameters())
    y = m(x.to(D))
    assert_close(y, ref.detach())
    y.sum().backward()  # the module trains on the device
    assert m[1].weight.grad is not None and m[1].weight.grad.device == DEV
    # the old CPU graph kept its own tensors; its backward would fill a parameter the module no longer has
    with pytest.raises(RuntimeError, match="moved to sidra:0 .*after the forward that made the graph"):
        ref.sum().backward()


def test_hf_gpt2_stays_tied_when_moved_after_a_cpu_forward():
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    g = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.tensor([[1, 5, 7, 3]])
    ref = g(ids).logits  # the tied weight is held by this graph (the LM head's saved transpose)
    n = len(list(g.parameters()))
    g.to(D)
    assert g.lm_head.weight is g.transformer.wte.weight and g.lm_head.weight.device == DEV
    assert len(list(g.parameters())) == n
    assert_close(g(ids.to(D)).logits, ref.detach())


# ---------------------------------------------------------------------------
# errors like CUDA's


def test_mixing_with_cpu_tensor_raises():
    s, c = torch.randn(3, device=D), torch.randn(3)
    for f in (lambda: s + c, lambda: c + s, lambda: s * c, lambda: torch.cat([s, c]),
              lambda: torch.mm(s.view(3, 1), c.view(1, 3)), lambda: torch.where(c > 0, s, s),
              lambda: s.add_(c)):
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            f()



def test_linear_on_device_with_cpu_input_raises():
    lin = torch.nn.Linear(3, 2).to(D)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        lin(torch.randn(1, 3))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.nn.Linear(3, 2)(torch.randn(1, 3, device=D))


def test_zero_dim_cpu_scalars_are_allowed():
    c = torch.randn(3)
    s = c.to(D)
    assert_close(s * torch.tensor(2.0), c * 2)
    assert_close(s + torch.tensor(1.5), c + 1.5)
    assert_close(s + 1, c + 1)
    assert (s * torch.tensor(2.0)).device == DEV


def test_cpu_index_and_copy_are_allowed():
    c = torch.randn(3)
    s = c.to(D)
    assert torch.equal(s[torch.tensor([0, 2])].cpu(), c[[0, 2]])
    assert torch.equal(torch.empty(3, device=D).copy_(c).cpu(), c)


@pytest.mark.parametrize("direction", ["to_sidra", "to_cpu"])
def test_module_to_under_inference_mode(direction):
    m = torch.nn.Linear(3, 2)
    if direction == "to_cpu":
        m.to(D)
    with torch.inference_mode():
        m.to("cpu" if direction == "to_cpu" else D)
    assert m.weight.device.type == ("cpu" if direction == "to_cpu" else "sidra")

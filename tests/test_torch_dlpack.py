"""sidra_core.dlpack: torch -> JAX without a copy, through jaxlib's import or the public path."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from sidra_core import dlpack


@pytest.fixture
def fresh(monkeypatch):
    """A module state that has not checked the fast import yet (restored after)."""
    monkeypatch.setattr(dlpack, "_state", {"checked": False})
    return dlpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_to_jax_shares_memory(fresh, dtype):
    t = (torch.arange(24).reshape(2, 3, 4) % 3).to(dtype)
    a = fresh.to_jax(t)
    assert isinstance(a, jax.Array) and a.shape == (2, 3, 4)
    assert a.unsafe_buffer_pointer() == t.data_ptr()  # zero-copy
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_the_fast_import_is_used_when_it_agrees(fresh):
    if fresh._IMPORT is None:
        pytest.skip("this jaxlib has no DLPack import with the checked signature")
    calls = []
    real = fresh._IMPORT
    fresh._IMPORT = lambda *a: calls.append(1) or real(*a)
    try:
        fresh.to_jax(torch.ones(3))
        fresh.to_jax(torch.ones(5))
    finally:
        fresh._IMPORT = real
    assert len(calls) == 3  # the check, then each call


def test_a_failing_fast_import_falls_back_for_good(fresh, monkeypatch):
    def broken(*_):
        raise TypeError("signature changed")

    monkeypatch.setattr(fresh, "_IMPORT", broken)
    t = torch.randn(4, 5)
    a = fresh.to_jax(t)
    assert fresh._IMPORT is None  # disabled after the failed check
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert a.unsafe_buffer_pointer() == t.data_ptr()


def test_a_disagreeing_fast_import_is_not_used(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "_IMPORT", lambda capsule, *_: jax.numpy.zeros(1))  # wrong array
    t = torch.randn(2, 2)
    np.testing.assert_array_equal(np.asarray(fresh.to_jax(t)), t.numpy())
    assert fresh._IMPORT is None


def test_a_numpy_array_is_shared_and_an_unaligned_first_one_decides_nothing(fresh):
    buf = np.zeros(64 + 7, np.float32)
    unaligned = buf[1:8] if buf.ctypes.data % 64 == 0 else buf[:7]  # 4 bytes off a 64-byte boundary
    np.testing.assert_array_equal(np.asarray(fresh.to_jax(unaligned)), unaligned)
    assert not fresh._state["checked"]  # XLA copied it: nothing to compare the fast import with
    buf = np.zeros(4096 + 16, np.float32)
    off = (-buf.ctypes.data % 64) // 4
    a = buf[off:off + 4096].reshape(64, 64)
    a[:] = np.arange(4096).reshape(64, 64)
    assert fresh.to_jax(a).unsafe_buffer_pointer() == a.ctypes.data and fresh._state["checked"]


def test_aligned_returns_an_aligned_array_or_a_shared_one():
    buf = np.arange(600, dtype=np.float32)
    start = -buf.ctypes.data % 64 // 4 + 1  # one float past a 64-byte boundary
    off = buf[start:start + 512].reshape(16, 32)
    assert off.ctypes.data % 64
    a = dlpack.aligned(off)
    assert a.ctypes.data % dlpack.ALIGNMENT == 0 and a.flags.writeable and a.dtype == off.dtype
    np.testing.assert_array_equal(a, off)
    assert dlpack.aligned(a) is a


@pytest.mark.parametrize("shape,own_pages", [((1024, 1024), True), ((300, 70), False), ((0, 5), False)])
def test_mapped_arrays_from_4_mib_have_pages_of_their_own(shape, own_pages):
    """A programmed state's large arrays live in an anonymous map (plain pages, not NumPy's huge-page
    heap); smaller ones are `empty`'s. Both are aligned, writeable and shared with XLA."""
    import mmap

    from sidra_core import buckets

    a = dlpack.mapped(shape, np.float32)
    assert a.shape == shape and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
    owner = a
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    assert isinstance(getattr(owner, "obj", owner), mmap.mmap) == own_pages
    if a.size:
        assert a.ctypes.data % dlpack.ALIGNMENT == 0
        a[...] = 2.5
        assert buckets.put(a).unsafe_buffer_pointer() == a.ctypes.data
        np.testing.assert_array_equal(np.asarray(buckets.put(a)), a)


def test_a_programmed_weights_cells_reach_xla_without_a_copy():
    """Every snapshot hands a weight's conductances and drift exponents to XLA: they are shared."""
    import sidra_core as sc
    from sidra_core import buckets, crossbar

    w = np.random.default_rng(0).normal(0, 0.05, (300, 70)).astype(np.float32)
    state = crossbar.program(w, sc.preset("y1"), seed=1)
    for name in ("g_plus", "g_minus", "nu_plus", "nu_minus"):
        a = getattr(state, name)
        assert buckets.put(a).unsafe_buffer_pointer() == a.ctypes.data, name

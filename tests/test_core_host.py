"""sidra_core.host: top-level compile options with nested jits, and the allocator setting."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest

from sidra_core import host


@host.jit
def _double(x):
    return 2.0 * x


def test_host_jit_runs_at_top_level_and_inside_traces():
    # JAX refuses compiler options on a nested jit: host.jit must drop them inside jit and grad
    x = jnp.arange(3.0)
    assert jnp.array_equal(_double(x), 2.0 * x)
    assert jnp.array_equal(jax.jit(lambda v: _double(v) + 1.0)(x), 2.0 * x + 1.0)
    assert float(jax.grad(lambda v: _double(v).sum())(x)[0]) == 2.0
    assert jnp.array_equal(jax.vmap(_double)(x), 2.0 * x)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_keep_freed_memory_takes_and_can_be_switched_off(monkeypatch):
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert host.keep_freed_memory() is True
    monkeypatch.setenv("SIDRA_MALLOC_TUNING", "0")
    assert host.keep_freed_memory() is False

"""sidra_core.host: top-level compile options with nested jits, and the allocator setting."""

from __future__ import annotations

import ctypes
import os
import subprocess
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


def _glibc() -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").gnu_get_libc_version)
    except (OSError, AttributeError):
        return False


glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or not _glibc(), reason="glibc malloc only")


@glibc_only
def test_keep_freed_memory_takes_and_can_be_switched_off(monkeypatch):
    assert host.keep_freed_memory() is True
    monkeypatch.setenv("SIDRA_MALLOC_TUNING", "0")
    assert host.keep_freed_memory() is False


_ARENAS = """
import ctypes, re, tempfile, threading
import numpy as np
import sidra_core
if SIDRA_TUNE:
    sidra_core.host.tune()  # sets the allocator up

def work():
    np.ones(1 << 20).sum()  # 8 MB through malloc on this thread

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
path = tempfile.mktemp()
fp = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
libc.malloc_info(0, fp)
libc.fclose(fp)
print(len(re.findall(r'<heap nr="[0-9]+">', open(path).read())))
"""


@glibc_only
def test_worker_threads_share_the_one_arena():
    # XLA's worker threads would each get a malloc arena whose heaps give large buffers back to the
    # kernel on free (a page fault per 4 kB on every run); with the setting every thread uses one arena.
    def arenas(tune: bool, tuning: str = "1") -> int:
        env = dict(os.environ, SIDRA_MALLOC_TUNING=tuning)
        out = subprocess.run([sys.executable, "-c", f"SIDRA_TUNE = {tune}\n" + _ARENAS], env=env, capture_output=True,
                             text=True, check=True)
        return int(out.stdout.strip().splitlines()[-1])

    assert arenas(True) == 1
    assert arenas(True, tuning="0") > 1  # the switch leaves malloc alone, and the check can tell
    assert arenas(False) > 1  # importing sidra_core does not touch malloc


def _async_dispatch(env: dict, jax_first: bool, tune: bool = True) -> str:
    code = ("import jax\n" + ("jax.numpy.ones(1).block_until_ready()\n" if jax_first else "")
            + "import sidra_core\n" + ("sidra_core.host.tune()\n" if tune else "")
            + "print(jax.config.read('jax_cpu_enable_async_dispatch'))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().splitlines()[-1]


def test_xla_programs_run_inline_unless_asked_or_too_late():
    # thread hand-offs of asynchronous dispatch cost more than a small kernel on a VM
    assert _async_dispatch({"SIDRA_JAX_ASYNC": "0"}, jax_first=False) == "False"
    assert _async_dispatch({"SIDRA_JAX_ASYNC": "1"}, jax_first=False) == "True"
    # JAX's CPU backend already exists: the setting cannot take and is left as the user has it
    assert _async_dispatch({"SIDRA_JAX_ASYNC": "0"}, jax_first=True) == "True"
    # without tune(), JAX's own default
    assert _async_dispatch({"SIDRA_JAX_ASYNC": "0"}, jax_first=False, tune=False) == "True"


def test_assumed_cpu_flags_give_another_hosts_choices():
    """SIDRA_CPU_FLAGS stands in for /proc/cpuinfo: with an AVX2 host's flags a process takes the
    portable path (float32 XLA dots, no VNNI kernel), whatever the real CPU has."""
    code = ("from sidra_core import host, vnni; "
            "print(sorted(host.cpu_flags()), host.LOW_PRECISION_DOTS, vnni.host_supports(), host.vnni_dots(), "
            "vnni.available())")
    env = {**os.environ, "SIDRA_CPU_FLAGS": "avx2 fma"}
    for key in ("SIDRA_LOW_PRECISION_DOTS", "SIDRA_VNNI_DOTS"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == "['avx2', 'fma'] False False False False"
    env["SIDRA_CPU_FLAGS"] = "avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_int8"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    *_, low, supports, used, available = out.stdout.split("\n")[0].split()
    # AMX: XLA's int8 dots for what the kernel does not read; the kernel where it built
    assert (low, supports, used) == ("True", "True", available)


def test_the_kernel_cache_keeps_every_program(tmp_path):
    """Every compiled program persists, however fast it compiled: loading a small one beats
    compiling it again in the next process."""
    code = ("import jax, sidra_core; sidra_core.host.tune(); "
            "print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")
    env = {**os.environ, "SIDRA_JAX_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == f"{tmp_path} 0.0"


_JAX_SETTINGS = """
import jax
{imports}
print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
      jax.config.read("jax_cpu_enable_async_dispatch"))
"""


@pytest.mark.parametrize("package", ["sidra_core", "sidra_jax", "sidra_torch"])
def test_importing_a_package_leaves_jax_settings_as_they_were(package):
    """Host tuning is tune()'s, not the import's: JAX's cache and dispatch settings after importing a
    package are those of a process that never imported it."""
    def settings(imports: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
        out = subprocess.run([sys.executable, "-c", _JAX_SETTINGS.format(imports=imports)], env=env,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip().splitlines()[-1]

    untouched = settings("")
    assert settings(f"import {package}") == untouched
    tuned = settings(f"import {package}\nfrom sidra_core import host\nhost.tune()")
    assert tuned != untouched  # the check can tell the difference


@glibc_only
def test_tuned_says_which_settings_the_process_has():
    code = "import sidra_core; print(sidra_core.host.tuned()); sidra_core.host.tune(); print(sidra_core.host.tuned())"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SIDRA_JAX", "SIDRA_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after = out.stdout.strip().splitlines()[-2:]
    assert "kernel cache off" in before and "dispatched to a worker" in before and "malloc as it was" in before
    assert "kernel cache off" not in after and "XLA programs inline" in after and "malloc kept" in after

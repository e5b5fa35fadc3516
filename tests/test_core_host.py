"""sidra_core.host: the backend choice, top-level compile options with nested jits, and the process
settings."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sidra_core as sc
from sidra_core import host, vnni


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
    env["SIDRA_CPU_FLAGS"] = "avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_int8"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    *_, low, supports, used, available = out.stdout.split("\n")[0].split()
    # AMX: XLA's int8 dots for what the kernel does not read; the kernel where it built
    assert (low, supports, used) == ("True", "True", available)
    # AVX-512 VNNI without BF16 (Cascade Lake, Ice Lake): the kernel needs no BF16 instruction
    env["SIDRA_CPU_FLAGS"] = "avx2 avx512f avx512bw avx512vl avx512_vnni"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    *_, low, supports, used, available = out.stdout.split("\n")[0].split()
    assert (low, supports, used) == ("False", "True", available)


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


# ---------------------------------------------------------------------------
# the backend: chosen in one place, shown, overridable


def test_the_backend_is_native_where_its_library_runs(monkeypatch):
    monkeypatch.delenv("SIDRA_BACKEND", raising=False)
    assert host.backend() == ("native" if vnni.available() else "xla")
    assert host.summary().startswith(f"{host.backend()} backend: ")


def test_sidra_backend_xla_moves_every_job_to_xla(monkeypatch):
    monkeypatch.setenv("SIDRA_BACKEND", "xla")
    assert host.backend() == "xla"
    assert not (host.vnni_dots() or host.native_ispp() or host.native_snapshot() or host.native_engine())
    text = host.summary()
    assert text.startswith("xla backend: ") and "native library" not in text and "VNNI kernel" not in text
    if vnni.available():  # where native could run, each job says why it does not
        assert text.count("SIDRA_BACKEND=xla") == 4


def test_a_wrong_backend_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("SIDRA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="SIDRA_BACKEND='cuda' is not a backend: use one of native, xla"):
        host.backend()
    monkeypatch.setenv("SIDRA_BACKEND", "native")
    monkeypatch.setattr(vnni, "available", lambda: False)
    with pytest.raises(RuntimeError, match="does not run on this host.*set it to xla"):
        host.backend()


@pytest.mark.skipif(not vnni.available(), reason="the native backend needs Linux, AVX-512 VNNI and a C++ compiler "
                                                 "(sidra_core.vnni.available() is False here)")
@pytest.mark.parametrize("preset", ["y1", "int8"])
def test_both_backends_program_and_compute_a_chip_to_the_same_bits(preset, monkeypatch):
    """The same chip and seed on the native and the XLA backend: the same programmed cells and the
    same bits of a drifted read and of attention; an activation and a norm within a rounding of the
    engine's format (XLA's own loops for them round their tails apart)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((600, 300)).astype(np.float32)
    x = rng.standard_normal((7, 600)).astype(np.float32)
    q, k, v = (rng.standard_normal((2, 9, 64)).astype(np.float32) for _ in range(3))
    runs = {}
    for backend in host.BACKENDS:
        monkeypatch.setenv("SIDRA_BACKEND", backend)
        chip = sc.Chip(spec=sc.preset(preset), seed=5)
        res = chip.program(w)
        chip.advance(100.0)
        y = np.asarray(chip.linear(res, x))
        runs[backend] = (res.state, y, np.asarray(chip.attention(q, k, v, scale=0.125)),
                         np.asarray(chip.engine("gelu", y)),
                         np.asarray(chip.engine("layer_norm", y, weight=np.ones(300, np.float32))))
    (native, *got), (xla, *want) = runs["native"], runs["xla"]
    for field in ("g_plus", "g_minus", "nu_plus", "nu_minus", "stuck_plus", "stuck_minus", "writes_plus",
                  "writes_minus", "adc_full_scale"):
        assert np.array_equal(getattr(native, field), getattr(xla, field)), field
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got[2:], want[2:]):
        np.testing.assert_allclose(a, b, rtol=2.0 ** -10, atol=2.0 ** -20)

"""How the simulator uses its host: which backend runs its kernels (chosen here alone), XLA's compile
options, and the process settings `tune()` applies (kernel cache, allocator, inline dispatch).

Each choice has an environment switch for users who manage it themselves.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import jax

try:  # the one way to ask whether a call happens inside a trace (jit, grad, vmap)
    from jax._src.core import trace_state_clean as _outside_traces
except ImportError:  # pragma: no cover - a JAX without it: every kernel compiles with XLA's defaults
    def _outside_traces() -> bool:
        return False

# XLA:CPU removes optimization barriers early ("cse_barrier_expander") and then fuses a crossbar MVM's
# output (its noise draw, ADC rounding and tile sum) into every consumer, recomputing it there: the next
# layer's DAC quantisation alone reads it three times. A whole program made of several MVMs (sidra_jax,
# torch.compile's backend) is compiled with these options and puts a barrier on each crossbar result, so
# each MVM's result materialises once, as the chip's SRAM buffer holds it. SIDRA_JAX_KEEP_BARRIERS=0
# compiles with XLA's defaults. 512-bit vectors (XLA:CPU prefers 256) speed up the per-element
# noise draw and ADC on AVX-512 hosts and change nothing elsewhere.
XLA_COMPILER_OPTIONS: dict = {"xla_cpu_prefer_vector_width": 512}
if os.environ.get("SIDRA_JAX_KEEP_BARRIERS", "1") != "0":
    XLA_COMPILER_OPTIONS["xla_disable_hlo_passes"] = "cse_barrier_expander"


def cpu_flags() -> set[str]:
    """The CPU feature flags Linux reports (empty elsewhere).

    SIDRA_CPU_FLAGS (space-separated) replaces them, so that any host can run what a host with other
    instructions runs: "avx2 fma" gives an AVX2 host's choices (no AMX dots, no VNNI kernel).
    """
    forced = os.environ.get("SIDRA_CPU_FLAGS")
    if forced is not None:
        return set(forced.split())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _low_precision_dots() -> bool:
    """Whether XLA:CPU's int8 and bfloat16 dots beat its float32 one on this host.

    With AMX tiles (amx_int8) they do. Without AMX, XLA's int8 dot runs no faster than its float32
    one and its bf16 dot slower, so a (whole, fraction) int8 pair (2N columns) costs twice a
    float32 dot of N. SIDRA_LOW_PRECISION_DOTS=1/0 forces the choice.
    """
    forced = os.environ.get("SIDRA_LOW_PRECISION_DOTS")
    if forced is not None:
        return forced != "0"
    return "amx_int8" in cpu_flags()


# Read by each snapshot (snapshots already made keep their form) and by the engine's INT8 matmul
# (exact either way: the choice only picks the faster kernel).
LOW_PRECISION_DOTS: bool = _low_precision_dots()


BACKENDS = ("native", "xla")


def backend() -> str:
    """The backend that runs the kernels with a native implementation (crossbar reads, the engine's
    non-linearities, norms and attention, programming, snapshots): "native" (sidra_core.vnni's
    library, on Linux hosts with AVX-512 VNNI) or "xla" (XLA on JAX's platform, any host).
    Native where its library runs; SIDRA_BACKEND=native|xla chooses. Every backend gives a chip and
    seed the same DAC and ADC codes and programmed conductances (test_core_vnni checks each kernel)."""
    from . import vnni

    forced = os.environ.get("SIDRA_BACKEND", "")
    if forced not in ("", *BACKENDS):
        raise ValueError(f"SIDRA_BACKEND={forced!r} is not a backend: use one of {', '.join(BACKENDS)}, or unset it "
                         "to run natively where the host can")
    if forced == "xla" or not vnni.available():
        if forced == "native":
            raise RuntimeError("SIDRA_BACKEND=native, but sidra_core.vnni's library does not run on this host (it "
                               "needs Linux, AVX-512 VNNI and a C++ compiler): unset SIDRA_BACKEND or "
                               "set it to xla")
        return "xla"
    return "native"


def _xla_why(switch: str, native: str = "the native library") -> str:
    """Why a job that could run natively (in `native`) runs on XLA."""
    if os.environ.get("SIDRA_BACKEND") == "xla":
        return "SIDRA_BACKEND=xla"
    return f"{switch}=0" if os.environ.get(switch) == "0" else f"{native} is not available"


def vnni_dots() -> bool:
    """Whether a snapshot of INT8 DAC-code weights is packed for `sidra_core.vnni`'s custom call
    (the partial sums and the read-noise variances as AVX-512 VNNI dots).

    Used wherever the CPU has the instructions and a C++ compiler built it (`vnni.available()`),
    AMX hosts included: there XLA's int8 dot keeps up on large reads, but at the few rows of eager
    inference (one sentence, a row bucket) each call costs more than the kernel, which reads
    tiles packed once per snapshot (docs/performance.md). SIDRA_VNNI_DOTS=0 forces the
    XLA dots (1 still needs the instructions and the build), as SIDRA_BACKEND=xla does.
    """
    return os.environ.get("SIDRA_VNNI_DOTS") != "0" and backend() == "native"


def dots() -> str:
    """Which dots this host's crossbar reads and engine INT8 matmuls use, and why (sidra info, the
    benchmarks' headers, the pytest header)."""
    if vnni_dots():
        return "sidra_core.vnni's AVX-512 VNNI kernel" + (" (XLA's other dots: AMX int8/bf16)" if LOW_PRECISION_DOTS else "")
    why = _xla_why("SIDRA_VNNI_DOTS", "the VNNI kernel")
    if LOW_PRECISION_DOTS:
        return f"XLA's int8/bf16 dots on AMX tiles ({why})"
    return f"XLA's float32 dots (the portable path: {why})"


def _native(switch: str) -> bool:
    return os.environ.get(switch) != "0" and backend() == "native"


def _where(switch: str, native: str, xla: str) -> str:
    """`native`'s or `xla`'s description of a job (sidra info, the benchmarks' headers), with why."""
    if _native(switch):
        return f"sidra_core.vnni's native library, {native}"
    return f"XLA, {xla} ({_xla_why(switch)})"


def summary() -> str:
    """The backend and where each job runs on this host (sidra info, the benchmarks' and pytest's
    headers: ratios depend on them)."""
    return (f"{backend()} backend: crossbar reads and engine INT8 matmuls by {dots()}; engine non-linearities "
            f"and norms by {engine_ops()}; ISPP write-verify by {programming()}; packed snapshots by {snapshots()}")


def native_ispp() -> bool:
    """Whether programming runs in the native kernel library (sidra_core.vnni's build, the same bits
    as XLA): ISPP write-verify cell by cell rather than in XLA's chunks, and the cells' stuck map
    and drift exponents; where that library runs, unless SIDRA_NATIVE_ISPP=0."""
    return _native("SIDRA_NATIVE_ISPP")


def programming() -> str:
    """Where programming (ISPP write-verify and the cells' draws) runs on this host, and why."""
    return _where("SIDRA_NATIVE_ISPP", "cell by cell", "in chunks of pulses")


def native_snapshot() -> bool:
    """Whether a packed snapshot (the VNNI kernel's tiles) is read in the native library (the same
    codes as XLA's program; no program per weight shape) rather than by XLA: where that library
    runs, unless SIDRA_NATIVE_SNAPSHOT=0. A weight with IR drop or drift compensation, or
    reprogrammed cell by cell, is read by XLA either way."""
    return _native("SIDRA_NATIVE_SNAPSHOT")


def snapshots() -> str:
    """Where packed snapshots are read on this host, and why."""
    return _where("SIDRA_NATIVE_SNAPSHOT", "any shape", "a program per weight shape")


def native_engine() -> bool:
    """Whether the compute engine's element-wise non-linearities and norms run as the native
    library's kernels (in XLA programs as custom calls, eagerly on host buffers: any shape, no
    program) rather than as XLA's fused loops: where that library runs, unless SIDRA_NATIVE_ENGINE=0."""
    return _native("SIDRA_NATIVE_ENGINE")


def engine_ops() -> str:
    """Where the engine's element-wise ops and norms run on this host, and why."""
    return _where("SIDRA_NATIVE_ENGINE", "any shape", "at row buckets")


def narrow_float() -> str:
    """The dtype for dot operands that need only ~0.4 % (read-noise variances) or are small
    integers (INT8 codes, exact in either): bfloat16 where its dots are fast, else float32."""
    return "bfloat16" if LOW_PRECISION_DOTS else "float32"


def jit(fn=None, **jit_kwargs):
    """`jax.jit` that compiles with XLA_COMPILER_OPTIONS when called at top level; inside another
    trace it is a plain nested jit (JAX refuses compiler options there; the outer program has its own)."""
    if fn is None:
        return functools.partial(jit, **jit_kwargs)
    top = jax.jit(fn, compiler_options=XLA_COMPILER_OPTIONS, **jit_kwargs)
    nested = jax.jit(fn, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return (top if _outside_traces() else nested)(*args, **kwargs)

    return call


def available_memory() -> int | None:
    """Bytes of host memory new allocations can have (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@functools.cache
def _glibc():
    """glibc, or None under another C library (or another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # glibc only: other C libraries read malloc's parameters differently
    except (OSError, AttributeError):
        return None
    return libc


def release_freed_memory() -> None:
    """Hand the free pages of malloc's heap back to the OS (glibc's malloc_trim): a weight's
    programming frees temporaries several times its programmed state, which malloc would
    otherwise keep (tune() keeps freed memory for the reads' temporaries, reused run after run)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def tune() -> dict[str, bool]:
    """Set this process up for the simulator: compiled kernels persist across processes
    (use_compilation_cache), glibc's malloc keeps freed memory (keep_freed_memory), XLA programs run
    on the calling thread (run_inline). Importing the packages changes none of this; the `sidra`
    command, the benchmarks and the test suite call it first. Each setting has its switch, and
    run_inline takes only before the process's first JAX computation. Returns what took."""
    return {"kernel cache": use_compilation_cache(), "malloc": keep_freed_memory(), "inline dispatch": run_inline()}


def tuned() -> str:
    """Which of tune()'s settings this process has (sidra info)."""
    cache = jax.config.jax_compilation_cache_dir
    inline = not jax.config.read("jax_cpu_enable_async_dispatch")
    return (f"kernel cache {cache or 'off'}, XLA programs {'inline' if inline else 'dispatched to a worker'}, "
            f"malloc {'kept' if _MALLOC['kept'] else 'as it was'} (sidra_core.host.tune())")


def use_compilation_cache() -> bool:
    """Compiled kernels persist across processes (the first forward of a model compiles one MVM per
    layer shape and row bucket), all of them: loading even a small one beats compiling it again.
    A user's own cache setting wins; SIDRA_JAX_CACHE=0 disables. Returns whether the cache is on."""
    cache_dir = os.environ.get("SIDRA_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "sidra", "jax"))
    if cache_dir != "0" and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return bool(jax.config.jax_compilation_cache_dir)


def run_inline() -> bool:
    """Run XLA:CPU programs on the calling thread instead of dispatching them to a worker.

    The simulator's kernels are many and small (one MVM, one engine op), and every caller reads
    the result at once; with JAX's asynchronous CPU dispatch each call hands the program to a
    sleeping worker thread and sleeps until it is done: two thread wake-ups, which can cost more
    than a small kernel itself.
    Only possible before JAX creates its CPU backend (the first JAX computation of the process);
    returns whether the setting took. SIDRA_JAX_ASYNC=1 keeps JAX's default.
    """
    if os.environ.get("SIDRA_JAX_ASYNC", "0") == "1":
        return False
    try:  # the one way to ask whether JAX has made its backends (and read this setting) already
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # pragma: no cover - another JAX: leave its dispatch as it is
        return False
    if backends_are_initialized():
        return not jax.config.read("jax_cpu_enable_async_dispatch")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MALLOC_KEEP_BYTES = 1 << 30
_MALLOC = {"kept": False}  # whether keep_freed_memory took in this process (glibc has no getter)


def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse freed memory of up to MALLOC_KEEP_BYTES instead of unmapping it.

    XLA:CPU allocates each run's temporaries afresh; past glibc's 32 MB mmap ceiling every run
    maps new pages and faults them in. Keeping the memory is what a GPU runtime's caching
    allocator does. One arena for all threads: XLA's worker threads otherwise get arenas of their
    own, whose 64 MB heaps hand a large buffer back to the kernel on free regardless of the
    thresholds, so a large temporary is faulted in again on every run.
    Returns whether the setting took; SIDRA_MALLOC_TUNING=0 leaves malloc alone.
    """
    libc = _glibc()
    if os.environ.get("SIDRA_MALLOC_TUNING", "1") == "0" or libc is None:
        return False
    _MALLOC["kept"] = all(libc.mallopt(param, value) for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES), (_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)))
    return _MALLOC["kept"]

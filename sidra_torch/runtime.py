"""The device's runtime state on the torch side: which chip, its memory, its clock.

One `sidra` torch device is one SIDRA system (possibly several chips, mapped
by sidra_core). The chip in use can be switched globally or for a `with`
block; each distinct spec is one physical chip that keeps its programmed
weights, so switching back does not reprogram.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
import torch
import torch.compiler as _torch_compiler

import sidra_core
from sidra_core import Chip, ChipSpec


_torch_threads = threading.local()  # .user: the caller's torch thread count while a device op runs


def on_one_torch_thread(fn):
    """Run fn with torch limited to one intra-op thread (restored after).

    The simulated chip's kernels are XLA programs that use every core; torch's OpenMP workers,
    once woken by a multi-threaded op, spin-wait on a core for a while after it and slow the next
    kernel. The chip's own host-side arithmetic
    (element-wise ops, format rounding) therefore runs on the calling thread; host-CPU work (the
    user's, and fallback ops inside a device op: `users_torch_threads`) keeps torch's setting.
    torch's count is per thread (OpenMP), so concurrent callers do not interfere.
    """
    get, set_ = torch.get_num_threads, torch.set_num_threads

    @functools.wraps(fn)
    def run(*args, **kwargs):
        n = get()
        if n == 1:
            return fn(*args, **kwargs)
        set_(1)
        outer, _torch_threads.user = getattr(_torch_threads, "user", None), n
        try:
            return fn(*args, **kwargs)
        finally:
            _torch_threads.user = outer
            set_(n)

    return run


@contextlib.contextmanager
def users_torch_threads():
    """Inside a device op: torch's thread count as the caller had it (a host fallback is CPU work)."""
    n = getattr(_torch_threads, "user", None)
    if n is None:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(1)


@dataclass
class _Memory:
    allocated: int = 0
    peak: int = 0
    allocations: int = 0
    frees: int = 0


@dataclass
class _State:
    chip: Chip | None = None
    chips: dict = field(default_factory=dict)  # spec -> Chip
    memory: _Memory = field(default_factory=_Memory)
    seed: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)


_STATE = _State()


class _Quiet(threading.local):
    on = False


QUIET = _Quiet()


def unpriced() -> bool:
    """Ops run as plain host computations, unpriced and untracked: under `quiet()`, and while
    torch.compile traces (sidra tensors then hold fake tensors: only shapes propagate)."""
    return QUIET.on or _torch_compiler._is_compiling_flag


@contextlib.contextmanager
def quiet():
    """Run ops as plain host computations, unpriced (printing, debugging reads)."""
    prev, QUIET.on = QUIET.on, True
    try:
        yield
    finally:
        QUIET.on = prev


def _get_chip(spec: ChipSpec, seed: int) -> Chip:
    """The one chip of this spec (seeding reseeds it, it does not make another chip)."""
    chip = _STATE.chips.get(spec)
    if chip is None:
        chip = _STATE.chips[spec] = Chip(spec=spec, seed=seed)
    return chip


def current_chip() -> Chip:
    """The chip ops run on now (the `y1` preset unless another was chosen).

    Returns:
        The current sidra_core.Chip.
    """
    chip = _STATE.chip
    if chip is not None:
        return chip
    with _STATE.lock:
        if _STATE.chip is None:
            _STATE.chip = _get_chip(sidra_core.preset("y1"), _STATE.seed)
        return _STATE.chip


def set_chip(chip: "str | Path | ChipSpec" = "y1", **overrides) -> Chip:
    """Choose the chip for all following ops: a preset name, a TOML path or a ChipSpec.

    Each distinct spec is one chip that keeps its programmed weights: choosing it again does not
    reprogram.

    Args:
        chip: A preset name, a TOML path or a ChipSpec.
        **overrides: Field overrides, as `sidra_core.preset` takes them.

    Returns:
        The chosen sidra_core.Chip.

    Raises:
        ValueError: An unknown preset, or an invalid override.
    """
    spec = sidra_core.resolve(chip, **overrides)
    with _STATE.lock:
        _STATE.chip = _get_chip(spec, _STATE.seed)
        return _STATE.chip


@contextlib.contextmanager
def use_chip(chip: "str | Path | ChipSpec | Chip", **overrides):
    """`with sidra_torch.use_chip("ideal"): ...` runs the block on another chip, then switches back.

    Args:
        chip: A preset name, a TOML path, a ChipSpec, or a sidra_core.Chip itself (one chip of a
            sidra_core.Population, say).
        **overrides: Field overrides, as `sidra_core.preset` takes them (not with a Chip).

    Returns:
        A context manager that yields the block's sidra_core.Chip.

    Raises:
        ValueError: An unknown preset, an invalid override, or overrides given with a Chip.
    """
    if isinstance(chip, Chip):
        if overrides:
            raise ValueError("use_chip(chip) of a sidra_core.Chip takes no overrides: its spec is fixed")
        target = chip
    else:
        target = None
        spec = sidra_core.resolve(chip, **overrides)
    with _STATE.lock:
        previous = current_chip()
        _STATE.chip = target if target is not None else _get_chip(spec, _STATE.seed)
    try:
        yield _STATE.chip
    finally:
        with _STATE.lock:
            _STATE.chip = previous


def manual_seed(seed: int) -> None:
    """Seed the device's noise streams (read noise, ISPP) on every chip, like torch.cuda.manual_seed.

    Args:
        seed: The seed (taken modulo 2**64).

    Returns:
        None.
    """
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    with _STATE.lock:
        _STATE.seed = seed
        for chip in _STATE.chips.values():
            chip.manual_seed(seed)


def initial_seed() -> int:
    return _STATE.seed


# -- programming progress ---------------------------------------------------

_PROGRAM_LISTENERS: list = []


@contextlib.contextmanager
def on_programmed(callback):
    """Call `callback(resident)` each time a weight is programmed into crossbars (progress bars)."""
    _PROGRAM_LISTENERS.append(callback)
    try:
        yield
    finally:
        _PROGRAM_LISTENERS.remove(callback)


def notify_programmed(resident) -> None:
    for cb in list(_PROGRAM_LISTENERS):
        cb(resident)


# -- dry run: price without computing ------------------------------------------

_KERNELS = ("linear", "conv", "engine", "matmul")  # the Chip methods that compute and charge an op


def _shapes_only(method):
    """`method` under jax.eval_shape: its Python part (pricing, noise seeds, snapshots) runs as in a
    real call, its jitted kernels are traced for their output shapes and never execute."""

    def run(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        arrays = [i for i, v in enumerate(leaves) if isinstance(v, (jax.Array, np.ndarray))]

        def traced(*values):
            filled = list(leaves)
            for i, v in zip(arrays, values):
                filled[i] = v
            a, kw = jax.tree_util.tree_unflatten(tree, filled)
            # Work on concrete values (a weight's read snapshot, cached on the chip) is done for real:
            # only what depends on the traced inputs is left abstract, so no tracer outlives the call.
            with jax.ensure_compile_time_eval():
                return method(*a, **kw)

        return jax.eval_shape(traced, *(leaves[i] for i in arrays))

    return run


@contextlib.contextmanager
def dry_run():
    """Price ops without computing them (`sidra bench --dry-run`).

    Inside the block the current chip's crossbar and engine kernels only trace their output shapes,
    and their results are zeros; everything else runs as in a real call: dispatch, the same cost
    functions, the noise-seed stream, and the programming of new weights (ISPP pulses depend on the
    weights' values, so it is simulated). A dry run's counters equal a real run's.
    """
    chip = current_chip()
    if any(name in vars(chip) for name in _KERNELS):
        raise RuntimeError("a dry run of this chip is already in progress")
    for name in _KERNELS:  # instance attributes shadow the Chip methods for this chip only
        setattr(chip, name, _shapes_only(getattr(chip, name)))
    try:
        yield chip
    finally:
        for name in _KERNELS:
            delattr(chip, name)


# -- memory ---------------------------------------------------------------


def _check_capacity(nbytes: int) -> None:
    cap = current_chip().spec.memory.dram_bytes
    mem = _STATE.memory
    if mem.allocated + nbytes > cap:
        gib = 1024 ** 3
        raise torch.OutOfMemoryError(
            f"SIDRA out of memory. Tried to allocate {nbytes / gib:.2f} GiB. The device has a total "
            f"capacity of {cap / gib:.2f} GiB of which {(cap - mem.allocated) / gib:.2f} GiB is free; "
            f"{mem.allocated / gib:.2f} GiB is allocated by tensors. Free tensors (del, or move them "
            f"to the CPU) or choose a chip with more memory (memory__dram_bytes=...)."
        )


def track_alloc(nbytes: int) -> None:
    with _STATE.lock:
        _check_capacity(nbytes)
        mem = _STATE.memory
        mem.allocated += nbytes
        mem.allocations += 1
        mem.peak = max(mem.peak, mem.allocated)


def track_free(nbytes: int) -> None:
    with _STATE.lock:
        _STATE.memory.allocated -= nbytes
        _STATE.memory.frees += 1


def memory_allocated(device=None) -> int:
    """Bytes of device memory held by tensors, as torch.cuda.memory_allocated.

    Args:
        device: Ignored (one device).

    Returns:
        The bytes allocated now.
    """
    return _STATE.memory.allocated


def max_memory_allocated(device=None) -> int:
    """The peak of `memory_allocated` since the last `reset_peak_memory_stats`.

    Args:
        device: Ignored (one device).

    Returns:
        The peak bytes allocated.
    """
    return _STATE.memory.peak


def reset_peak_memory_stats(device=None) -> None:
    """Restart the peak of `max_memory_allocated` from the bytes allocated now.

    Args:
        device: Ignored (one device).

    Returns:
        None.
    """
    with _STATE.lock:
        _STATE.memory.peak = _STATE.memory.allocated


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A printable summary of device memory and crossbar tiles, as torch.cuda.memory_summary.

    Args:
        device: Ignored (one device).
        abbreviated: Ignored (the summary is short).

    Returns:
        The summary text.
    """
    chip = current_chip()
    mem = _STATE.memory
    mib = 1024 ** 2
    held = chip.host_memory()

    def per_weight(key):
        return held[key] / max(held["weights"], 1)

    return "\n".join([
        f"SIDRA memory summary ({chip.spec.name} chip)",
        f"  device memory   : {mem.allocated / mib:10.2f} MiB allocated, peak {mem.peak / mib:.2f} MiB, "
        f"capacity {chip.spec.memory.dram_bytes / mib:.0f} MiB",
        f"  allocations     : {mem.allocations} allocated, {mem.frees} freed",
        f"  crossbar tiles  : {chip.tiles_in_use} of {chip.tiles_total} programmed "
        f"({len(chip.residents)} weights)",
        f"  host memory     : {(held['state_bytes'] + held['snapshot_bytes']) / mib:10.2f} MiB for "
        f"{held['weights']:,} programmed weights ({per_weight('state_bytes'):.1f} B per weight of programmed "
        f"state, {per_weight('snapshot_bytes'):.1f} B of read snapshots)",
    ])


# -- clock and counters -----------------------------------------------------


def counters() -> dict:
    """Device time, energy by component and event counts since the last reset.

    Returns:
        A dict: time_s, busy_s, idle_s, energy_j, energy_<component>_j and each counter.
    """
    return current_chip().clock.counters.as_dict()


def reset_counters() -> None:
    """Zero the current chip's counters and energy; its clock keeps its time (cells keep drifting).

    Returns:
        None.
    """
    current_chip().clock.reset_counters()


def device_time() -> float:
    """The simulated device clock (s): busy time plus any time advanced by the user.

    Returns:
        The current chip's device time (s).
    """
    return current_chip().clock.now


@contextlib.contextmanager
def drift_compensation(enabled: bool = True):
    """Read the current chip with global drift compensation on (or off) inside the block.

    Args:
        enabled: Compensation inside the block; the previous setting comes back after it.

    Returns:
        A context manager that yields the current sidra_core.Chip.
    """
    chip = current_chip()
    previous = chip.spec.noise.drift_compensation
    chip.set_drift_compensation(enabled)
    try:
        yield chip
    finally:
        chip.set_drift_compensation(previous)


def advance(seconds: float) -> float:
    """Jump the device clock, e.g. `advance(3600)` to read weights an hour after programming.

    Args:
        seconds: How far to move the clock (s), not negative.

    Returns:
        The device time after the jump (s).

    Raises:
        ValueError: `seconds` is negative.
    """
    return current_chip().advance(seconds)


class Event:
    """Like torch.cuda.Event, but `elapsed_time` reads the simulated device clock (ms).

    Args:
        enable_timing: Allow `elapsed_time` between this event and another.
        blocking: Accepted for torch.cuda.Event's signature (the simulator runs eagerly).
        interprocess: Accepted for torch.cuda.Event's signature.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream=None) -> None:
        self._time = device_time()

    def query(self) -> bool:
        return True  # the simulator runs eagerly: work is done when recorded

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True to measure elapsed time")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end_event._time - self._time) * 1e3

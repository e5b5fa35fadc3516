"""The device profiler, mirroring torch.profiler:

    with sidra_torch.profiler.profile() as prof:
        y = model(x)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=10))
    prof.export_chrome_trace("trace.json")   # open in Perfetto / chrome://tracing

Per op: calls, simulated device time, energy, where it ran (crossbar, engine,
memory, host), host-link bytes and host simulation time. User ranges from
`torch.profiler.record_function` appear as rows and on the timeline.

PyTorch's own profiler works too, as the SIDRA chapter writes it:

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.SIDRA]) as prof:
        y = model(x)
    print(prof.key_averages().table())   # device ops with their SIDRA (device) time

PyTorch takes a PrivateUse1 device's events only from a C++ Kineto plugin, which would need a
compiler and a build per torch version on every user's machine; `install` instead adds the device
ops to the events torch parses from Kineto, in one wrapped method, for profiles that record the
SIDRA activity. torch's table has no energy column: energy is in this module's table.
"""

from __future__ import annotations

import functools
import time

import torch.autograd.profiler as _autograd_profiler
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from sidra_core.cost import Cost
from sidra_core.report import OpRecord, Recording

from . import runtime
from . import tensor as _t

from .tensor import _enter_range, _exit_range, op_name as _op_name


def _delta(before, after) -> tuple[Cost, dict]:
    (b0, e0, c0), (b1, e1, c1) = before, after
    cost = Cost(b1 - b0, *(y - x for x, y in zip(e0, e1)))
    return cost, {k: c1[k] - c0[k] for k in c1}


class profile(Recording):
    """Records every device op (and user range) between __enter__ and __exit__."""

    def __init__(self, *, record_ranges: bool = True):
        super().__init__()
        self._record_ranges = record_ranges
        self._stack: list = []
        self._saved = None

    # -- recording ----------------------------------------------------------

    def _observe(self, func, runner, args, uargs, ukwargs):
        clock = runtime.current_chip().clock
        before = clock.raw()
        start = clock.now
        t0 = time.perf_counter()
        rec = _enter_range(_op_name(func), None) if self._record_ranges else None
        try:
            out = runner(func, args, uargs, ukwargs)
        finally:
            if rec is not None:
                _exit_range(rec)
        host_s = time.perf_counter() - t0
        cost, counts = _delta(before, clock.raw())
        # Where it ran, from what the op charged (a matmul may go to the crossbar or the engine).
        if counts["fallback_ops"] or counts["host_bytes"]:
            where = "host"
        elif counts["mvms"]:
            where = "crossbar"
        elif counts["engine_ops"]:
            where = "engine"
        elif counts["memory_ops"]:
            where = "memory"
        else:
            where = getattr(runner, "where", "engine")
        self.records.append(OpRecord(_op_name(func), where, cost, counts["host_bytes"], host_s, start))
        return out

    def _range_enter(self, name):
        clock = runtime.current_chip().clock
        self._stack.append((name, clock.raw(), clock.now, time.perf_counter()))

    def _range_exit(self):
        name, before, start, t0 = self._stack.pop()
        clock = runtime.current_chip().clock
        cost, counts = _delta(before, clock.raw())
        self.ranges.append(OpRecord(name, "user range", cost, counts["host_bytes"], time.perf_counter() - t0, start))

    def __enter__(self):
        if _t.observer is not None:
            raise RuntimeError("a sidra_torch profiler is already recording; nest record_function ranges instead")
        _t.observer = self._observe
        self._saved = (_autograd_profiler.record_function.__enter__, _autograd_profiler.record_function.__exit__)
        prof = self
        enter, exit_ = self._saved

        def rf_enter(rf):
            prof._range_enter(rf.name)
            return enter(rf)

        def rf_exit(rf, *exc):
            try:
                return exit_(rf, *exc)
            finally:
                prof._range_exit()

        _autograd_profiler.record_function.__enter__ = rf_enter
        _autograd_profiler.record_function.__exit__ = rf_exit
        self._start()
        return self

    def __exit__(self, *exc):
        self._stop(*exc)
        _t.observer = None
        _autograd_profiler.record_function.__enter__, _autograd_profiler.record_function.__exit__ = self._saved
        return False


# -- PyTorch's profiler: the SIDRA activity ------------------------------------


def device_events(prof, events: list) -> list:
    """The device ops `prof` (a torch.autograd.profiler.profile that has stopped) saw, as FunctionEvents
    on the SIDRA device, named as the op (`addmm`), placed at their host start and lasting their
    simulated device time. Where the profile also recorded the CPU, each is a kernel of its
    `sidra::<op>` range, as CUDA kernels are of the ops that launch them. Ops up to the profile's end
    are taken off the record either way, so a profile without the SIDRA activity leaves nothing behind."""
    start, end = prof.profiling_start_time_ns, prof.profiling_end_time_ns
    ops = [op for op in _t.torch_profiled if op[1] <= end]
    del _t.torch_profiled[:len(ops)]
    if prof.use_device != _t.DEVICE_TYPE:
        return []
    ranges: dict = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("sidra::"):
            ranges.setdefault(e.name, []).append(e)
    for launched in ranges.values():
        launched.reverse()  # events come sorted by start: pop() gives the earliest
    first_id = max((e.id for e in events), default=0) + 1
    out = []
    for name, t0, device_s in (op for op in ops if op[1] >= start):
        kernel, begin = name.removeprefix("sidra::"), (t0 - start) / 1e3
        out.append(FunctionEvent(id=first_id + len(out), name=kernel, thread=0, start_us=begin,
                                 end_us=begin + device_s * 1e6, use_device=prof.use_device, input_shapes=[],
                                 stack=[], device_type=DeviceType.PrivateUse1, device_index=0, is_async=False))
        if ranges.get(name):
            ranges[name].pop().append_kernel(kernel, 0, device_s * 1e6)
    return out


def install() -> None:
    """Wrap torch's parsing of a profile's Kineto results to add `device_events` (idempotent)."""
    cls = _autograd_profiler.profile
    if getattr(cls._parse_kineto_results, "_sidra", False):
        return
    parse = cls._parse_kineto_results

    @functools.wraps(parse)
    def parse_with_device_ops(prof, result, *args, **kwargs):
        events = parse(prof, result, *args, **kwargs)
        added = device_events(prof, events)
        return sorted(events + added, key=lambda e: (e.time_range.start, -e.time_range.end)) if added else events

    parse_with_device_ops._sidra = True
    cls._parse_kineto_results = parse_with_device_ops

"""The sidra_jax profiler: the same table as sidra_torch's (sidra_core.report).

    with sidra_jax.profile() as prof:
        y = f(params, x)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=10))

One row per device op name (`sidra::dot_general`, `sidra::softmax`, ...) with
calls, simulated device time, energy, where it ran, host-link bytes. A
sidra_jax call is one fused XLA program, so host simulation time is measured
per call, not per op: it appears on the `sidra_jax::<function>` row (a range,
like a torch `record_function`, not counted twice in the totals) and in the
table's "Host simulation time" total.
"""

from __future__ import annotations

import threading

from sidra_core.cost import Cost
from sidra_core.report import OpRecord, Recording

_ACTIVE: list = []
_LOCK = threading.Lock()


def active() -> list:
    return _ACTIVE


class profile(Recording):
    """Records every device op of every sidra_jax call between __enter__ and __exit__.

    Takes no arguments; use it as `with sidra_jax.profile() as prof:`, then
    `prof.key_averages().table(...)` or `prof.export_chrome_trace(path)`.

    Attributes:
        records: One OpRecord per device op.
        ranges: One OpRecord per sidra_jax call (a user range).
        host_s: Host simulation time of the calls (s), measured per call.
    """

    def __init__(self):
        super().__init__()
        self.host_s = 0.0

    def __enter__(self):
        with _LOCK:
            _ACTIVE.append(self)
        self._start()
        return self

    def __exit__(self, *exc):
        self._stop(*exc)
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        return False

    def _add_call(self, name: str, records: list, total: Cost, host_s: float, start_s: float) -> None:
        self.records.extend(records)
        self.ranges.append(OpRecord(name, "user range", total, sum(r.host_bytes for r in records), host_s, start_s))
        self.host_s += host_s

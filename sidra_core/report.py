"""The profiler both bridges share: per-op records of device work, the table and the timeline.

A bridge records one OpRecord per device op (what it was, where it ran, its
priced Cost, host bytes moved, host simulation time) into a `Recording`;
`key_averages` groups them by name and renders the same table from PyTorch and
from JAX. The bridges only capture (dispatch's observer and `record_function`
ranges; a sidra_jax call's plan).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

from . import compiles as _compiles
from .cost import COMPONENTS, ZERO, Cost

WHERE = ("crossbar", "engine", "memory", "host")


@dataclass(frozen=True)
class OpRecord:
    """One device op: name, where it ran, its simulated cost, host-link bytes, host wall time."""

    name: str
    where: str
    cost: Cost
    host_bytes: int = 0
    host_s: float = 0.0
    start_s: float = 0.0  # device clock at the op's start (for timelines)


@dataclass
class OpStats:
    """Aggregate of the records that share a name."""

    name: str
    where: str
    calls: int = 0
    cost: Cost = ZERO
    host_bytes: int = 0
    host_s: float = 0.0
    places: set = field(default_factory=set)

    @property
    def device_time_total(self) -> float:
        return self.cost.latency_s

    @property
    def device_time_avg(self) -> float:
        return self.cost.latency_s / self.calls if self.calls else 0.0

    @property
    def energy_total(self) -> float:
        return self.cost.energy_j

    @property
    def host_time_total(self) -> float:
        return self.host_s


SORT_KEYS = {
    "device_time_total": lambda s: s.device_time_total,
    "device_time": lambda s: s.device_time_total,
    "self_device_time_total": lambda s: s.device_time_total,
    "energy_total": lambda s: s.energy_total,
    "energy": lambda s: s.energy_total,
    "calls": lambda s: s.calls,
    "count": lambda s: s.calls,
    "host_time_total": lambda s: s.host_time_total,
    "cpu_time_total": lambda s: s.host_time_total,
    "bytes": lambda s: s.host_bytes,
}


class KeyAverages(list):
    """A list of OpStats with torch.profiler's `table()`; totals over all records."""

    def __init__(self, stats, total: Cost, host_s: float, compiles=None):
        super().__init__(stats)
        self.total = total
        self.host_s = host_s
        self.compiles = compiles  # sidra_core.compiles.Compiles of the profile, if it recorded them

    def table(self, sort_by: str = "device_time_total", row_limit: int = -1, **_ignored) -> str:
        if sort_by not in SORT_KEYS:
            raise ValueError(f"sort_by={sort_by!r} is not a column; choose one of {sorted(SORT_KEYS)}")
        rows = sorted(self, key=SORT_KEYS[sort_by], reverse=True)
        if row_limit is not None and row_limit >= 0:
            rows = rows[:row_limit]
        return render_table(rows, self.total, self.host_s, self.compiles)


def key_averages(records, compiles=None) -> KeyAverages:
    by_name: dict[str, OpStats] = {}
    total, host = ZERO, 0.0
    for r in records:
        s = by_name.get(r.name)
        if s is None:
            s = by_name[r.name] = OpStats(name=r.name, where=r.where)
        s.calls += 1
        s.cost = s.cost + r.cost
        s.host_bytes += r.host_bytes
        s.host_s += r.host_s
        s.places.add(r.where)
        if r.where in WHERE:  # user ranges enclose device ops already counted
            total = total + r.cost
            host += r.host_s
    for s in by_name.values():
        s.where = "/".join(w for w in WHERE if w in s.places) or "/".join(sorted(s.places))
    return KeyAverages(by_name.values(), total, host, compiles)


class Recording:
    """What a profiler keeps while it records: the device ops and user ranges it saw and the host
    programs built meanwhile (sidra_core.compiles); the table and the timeline they make. `host_s`,
    where set, is the host simulation time measured per call rather than per op."""

    def __init__(self):
        self.records: list[OpRecord] = []
        self.ranges: list[OpRecord] = []
        self.host_s: float | None = None
        self._recording = _compiles.record()
        self.compiles: _compiles.Compiles | None = None  # the programs the host built meanwhile

    def _start(self) -> None:
        self.compiles = self._recording.__enter__()

    def _stop(self, *exc) -> None:
        self._recording.__exit__(*exc)

    def key_averages(self) -> KeyAverages:
        """Rows per op name (and per user range or call), with `.table(sort_by=..., row_limit=...)`."""
        ka = key_averages(self.records + self.ranges, self.compiles)
        if self.host_s is not None:
            ka.host_s = self.host_s
        return ka

    @property
    def total(self) -> Cost:
        return self.key_averages().total

    def export_chrome_trace(self, path: str) -> None:
        """A device timeline (simulated clock) in the Chrome trace format: one event per device op."""
        write_chrome_trace(self.ranges + self.records, path)


def _fmt_time(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f}ms"
    return f"{s * 1e6:.3f}us"


def _fmt_energy(j: float) -> str:
    if j >= 1e-3:
        return f"{j * 1e3:.3f}mJ"
    if j >= 1e-6:
        return f"{j * 1e6:.3f}uJ"
    return f"{j * 1e9:.3f}nJ"


def _fmt_bytes(b: int) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.2f}{unit}"
    return f"{b}B"


def render_table(rows, total: Cost, host_s: float, compiles=None) -> str:
    """The profiler table as text: one row per op name, then device totals, the energy breakdown and
    the host's program builds (new shapes compile new kernels)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="SIDRA device profile", show_footer=False)
    for col, justify in (("Name", "left"), ("Where", "left"), ("# Calls", "right"), ("Device total", "right"),
                         ("Device avg", "right"), ("Device %", "right"), ("Energy", "right"),
                         ("Energy %", "right"), ("Host bytes", "right"), ("Host sim time", "right")):
        t.add_column(col, justify=justify)
    tot_t = total.latency_s or 1.0
    tot_e = total.energy_j or 1.0
    for s in rows:
        t.add_row(s.name, s.where, str(s.calls), _fmt_time(s.device_time_total), _fmt_time(s.device_time_avg),
                  f"{100 * s.device_time_total / tot_t:.1f}%", _fmt_energy(s.energy_total),
                  f"{100 * s.energy_total / tot_e:.1f}%", _fmt_bytes(s.host_bytes), _fmt_time(s.host_s))
    buf = io.StringIO()
    console = Console(file=buf, width=150, force_terminal=False, force_jupyter=False, color_system=None)
    console.print(t)
    console.print(f"Device time total: {_fmt_time(total.latency_s)}   Energy total: {_fmt_energy(total.energy_j)}   "
                  f"Host simulation time: {_fmt_time(host_s)}")
    parts = "  ".join(f"{c}={_fmt_energy(getattr(total, c))}" for c in COMPONENTS if getattr(total, c) > 0)
    console.print(f"Energy by component: {parts or 'none'}")
    if compiles is not None:
        console.print(compiles.summary())
    return buf.getvalue()


def write_chrome_trace(records, path: str) -> None:
    """A device timeline (simulated clock) in the Chrome trace format (Perfetto, chrome://tracing):
    one complete event per record, on a lane per place (crossbar, engine, memory, host, user ranges)."""
    lanes = {"crossbar": 1, "engine": 2, "memory": 3, "host": 4, "user range": 0}
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "SIDRA device (simulated clock)"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}}
               for lane, tid in lanes.items()]
    for r in records:
        events.append({
            "name": r.name, "ph": "X", "pid": 0, "tid": lanes.get(r.where, 5), "cat": r.where,
            "ts": r.start_s * 1e6, "dur": r.cost.latency_s * 1e6,
            "args": {"energy_J": r.cost.energy_j, "host_bytes": r.host_bytes, "host_sim_s": r.host_s,
                     **{f"energy_{k}_J": v for k, v in r.cost.energy_by_component().items() if v}},
        })
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, fh)

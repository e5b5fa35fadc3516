"""Parameter sweeps: spec fields x times since programming x tasks, each point on a population of chips.

    from sidra_jax import sweep, tasks
    points = sweep.grid({"adc.bits": [6, 8], "noise.read_sigma": [0.01, 0.02]}, times=[86400.0],
                        tasks=["digits-cnn"])
    table = sweep.run(points, "results/adc", chip="y1", chips=16)     # a pandas DataFrame

A point is one set of spec overrides, one time and one task; it runs on `chips` chips of the
population seeded `seed` (chip i is the same chip at every point) and gives one row per chip: every
spec field, the chip, its seeds, the time, the task and the task's metrics. Points are written as
they finish to `<out>.jsonl` (a line per point, flushed), so an interrupted sweep run again with
the same `out` skips the points done and loses none; the tidy table is written to `<out>.csv` and
`<out>.parquet` at the end. Locally the points run one after another in this process (each a
population program using the machine's cores); with `ray_address` (or inside `ray.init()`) they run
as Ray tasks across the cluster, a task whose worker dies retried (Ray is the `ray` extra).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from sidra_core import ChipSpec, Population, resolve

from . import tasks as _tasks

RETRIES = 3  # a Ray task whose worker dies is run again up to this many times


@dataclass(frozen=True)
class Point:
    """One sweep point: spec overrides ((dotted field, value), ...), a time since programming (s), a task."""

    overrides: tuple
    t: float
    task: str

    @property
    def key(self) -> str:
        """A stable identity of the point (its journal key)."""
        return json.dumps({"overrides": [list(o) for o in self.overrides], "t": self.t, "task": self.task})


def grid(fields: dict | None = None, times: Sequence[float] = (0.0,), tasks: Sequence[str] = ("digits-mlp",)) -> list:
    """Every combination of the fields' values ({"adc.bits": [6, 8], ...}), times and tasks, in order."""
    fields = dict(fields or {})
    names = list(fields)
    return [Point(tuple(zip(names, values)), float(t), str(task))
            for values in itertools.product(*(fields[n] for n in names)) for t in times for task in tasks]


def spec_of(chip: "str | ChipSpec", point: Point) -> ChipSpec:
    """The chip spec of a point: `chip` with the point's overrides (a dotted field per override)."""
    return resolve(chip, **{name.replace(".", "__"): value for name, value in point.overrides})


def flat_spec(spec: ChipSpec) -> dict:
    """Every spec field as a column: section.field -> value (and name, seed)."""
    out = {}
    for key, value in dataclasses.asdict(spec).items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def task_named(name: str, extra: dict | None = None) -> _tasks.Task:
    """A task by name: the built-in "digits-mlp", "digits-cnn" and "minilm-agreement", or one of
    `extra` ({name: Task})."""
    if extra and name in extra:
        return extra[name]
    if name.startswith("digits-"):
        return _tasks.digits(name.split("-", 1)[1])
    if name == "minilm-agreement":  # (PyTorch's MiniLM on each chip)
        from sidra_torch.population import minilm_agreement

        return minilm_agreement()
    raise ValueError(f"unknown sweep task {name!r}: use digits-mlp, digits-cnn, minilm-agreement or pass it in "
                     f"tasks=")


def evaluate(point: Point, chip, chips: int, seed: int, extra: dict | None = None) -> list:
    """The rows of one point: its task on a fresh population of `chips` chips of its spec."""
    spec = spec_of(chip, point)
    pop = Population.create(spec, n=chips, seed=seed)
    metrics = task_named(point.task, extra).run(pop, point.t)
    columns = flat_spec(spec)
    columns.pop("seed")  # (each chip's own seeds are columns)
    return [{"point": point.key, **columns, "chip": i, "chip_seed": c.spec.seed, "run_seed": c.seed, "t_s": point.t,
             "task": point.task, **m} for i, (c, m) in enumerate(zip(pop, metrics))]


def metric_columns(table) -> list:
    """The table's metric columns: those that are not the point, a spec field, the chip or the time."""
    meta = {"point", "name", "chip", "chip_seed", "run_seed", "t_s", "task"}
    return [c for c in table.columns if c not in meta and "." not in c]


def _journal(path: Path) -> dict:
    """The points done so far: key -> rows (a last line cut short by an interruption is ignored)."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[entry["key"]] = entry["rows"]
    return done


def _append(path: Path, key: str, rows: list) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"key": key, "rows": rows}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _local(todo, chip, chips, seed, extra) -> Iterable:
    for point in todo:
        yield point, evaluate(point, chip, chips, seed, extra)


def _ray(todo, chip, chips, seed, extra, address) -> Iterable:
    """The points as Ray tasks (retried where a worker dies), yielded as they finish."""
    try:
        import ray
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("a sweep on a Ray cluster needs Ray: pip install 'sidra[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    remote = ray.remote(max_retries=RETRIES)(evaluate)
    pending = {remote.remote(p, chip, chips, seed, extra): p for p in todo}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        point = pending.pop(done[0])
        yield point, ray.get(done[0])


def run(points: Sequence[Point], out, *, chip: "str | ChipSpec" = "y1", chips: int = 8, seed: int = 0,
        tasks: dict | None = None, ray_address: str | None = None, progress: bool = True,
        on_point: Callable[[Point], None] | None = None):
    """Run the points not yet in `<out>.jsonl`, journal each as it finishes, and write the table.

    Args:
        points: The sweep's points (`grid`).
        out: The results' path without suffix (`<out>.jsonl`, `.csv`, `.parquet`).
        chip: The base chip: a preset name, TOML path or ChipSpec.
        chips: Chips per point (the population's size).
        seed: The population's seed.
        tasks: Tasks by name beside the built-in ones ({name: sidra_jax.tasks.Task}).
        ray_address: A Ray cluster's address ("auto", "ray://host:port"): the points run as Ray tasks;
            None: here, unless `ray.init()` was called.
        progress: Show a progress bar with an ETA.
        on_point: Called after each point is journaled.

    Returns:
        The table (a pandas DataFrame): a row per chip and point, in the points' order.
    """
    import pandas as pd
    from tqdm import tqdm

    base = Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    journal = base.with_suffix(".jsonl")
    if len({p.key for p in points}) != len(points):
        raise ValueError("a sweep's points must differ: a point is listed twice")
    done = _journal(journal)
    todo = [p for p in points if p.key not in done]
    use_ray = ray_address is not None or _ray_initialized()
    results = (_ray(todo, chip, chips, seed, tasks, ray_address) if use_ray else
               _local(todo, chip, chips, seed, tasks))
    with tqdm(total=len(points), initial=len(points) - len(todo), disable=not progress, unit="point",
              desc="sweep") as bar:
        for point, rows in results:
            _append(journal, point.key, rows)
            done[point.key] = rows
            bar.update(1)
            if on_point is not None:
                on_point(point)
    table = pd.DataFrame([row for p in points for row in done[p.key]])
    table.to_csv(base.with_suffix(".csv"), index=False)
    table.to_parquet(base.with_suffix(".parquet"), index=False)
    return table


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # (not imported: not initialised either)
    return ray is not None and ray.is_initialized()


def plot(table, x: str, metric: str = "accuracy", *, by: str | None = None, ax=None):
    """`metric` against swept field `x`: the mean over chips with the spread (min to max) shaded, a
    line per value of `by` (another field, or the time "t_s")."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(5, 3.2))[1]
    groups = [(None, table)] if by is None else list(table.groupby(by))
    for label, part in groups:
        stats = part.groupby(x)[metric].agg(["mean", "min", "max"]).sort_index()
        line = ax.plot(stats.index, stats["mean"], marker="o", label=None if by is None else f"{by} = {label}")[0]
        ax.fill_between(stats.index, stats["min"], stats["max"], alpha=0.2, color=line.get_color())
    ax.set_xlabel(x)
    ax.set_ylabel(f"{metric} (mean, min-max over chips)")
    if by is not None:
        ax.legend(fontsize="small")
    return ax


def heatmap(table, x: str, y: str, metric: str = "accuracy", *, ax=None):
    """The mean of `metric` over chips on a grid of two swept fields."""
    import matplotlib.pyplot as plt

    grid_ = table.groupby([y, x])[metric].mean().unstack(x).sort_index()
    ax = ax or plt.subplots(figsize=(5, 3.2))[1]
    im = ax.imshow(grid_.values, origin="lower", aspect="auto", cmap="viridis")
    ax.set_xticks(range(grid_.shape[1]), [str(v) for v in grid_.columns])
    ax.set_yticks(range(grid_.shape[0]), [str(v) for v in grid_.index])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    for (i, j), v in np.ndenumerate(grid_.values):
        ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="white", fontsize="small")
    ax.figure.colorbar(im, ax=ax, label=f"{metric} (mean over chips)")
    return ax

"""Parameter sweeps (sidra_jax.sweep, `sidra sweep`): the tidy table, resuming an interrupted sweep
without losing or repeating a point, a user's task, the plots, and the same table from a Ray cluster
(slow), also after a worker dies mid-sweep."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest

import sidra_core as sc
from sidra_jax import sweep, tasks

FIELDS = {"adc.bits": [6, 8]}
TIMES = [0.0, 3600.0]


def _points():
    return sweep.grid(FIELDS, times=TIMES, tasks=["digits-mlp"])


def test_the_grid_is_every_combination_in_order():
    pts = sweep.grid({"adc.bits": [6, 8], "noise.read_sigma": [0.01, 0.02]}, times=[1.0, 2.0], tasks=["a", "b"])
    assert len(pts) == 16 and len({p.key for p in pts}) == 16
    assert pts[0] == sweep.Point((("adc.bits", 6), ("noise.read_sigma", 0.01)), 1.0, "a")
    assert pts[-1] == sweep.Point((("adc.bits", 8), ("noise.read_sigma", 0.02)), 2.0, "b")
    assert sweep.spec_of("y1", pts[-1]).adc.bits == 8 and sweep.spec_of("y1", pts[-1]).noise.read_sigma == 0.02
    with pytest.raises(ValueError, match="listed twice"):
        sweep.run(pts[:1] * 2, "/nonexistent/never", progress=False)


def test_a_sweep_writes_a_tidy_table(tmp_path):
    table = sweep.run(_points(), tmp_path / "s", chips=2, progress=False)
    assert len(table) == 4 * 2
    spec_columns = set(sweep.flat_spec(sc.preset("y1"))) - {"seed"}
    assert spec_columns <= set(table.columns)
    assert {"chip", "chip_seed", "run_seed", "t_s", "task", "accuracy"} <= set(table.columns)
    assert sorted(table["adc.bits"].unique()) == [6, 8] and sorted(table["t_s"].unique()) == TIMES
    assert table["accuracy"].between(0.9, 1.0).all()
    # chip i is one chip at every point: its seeds do not depend on the point
    assert table.groupby("chip")["chip_seed"].nunique().eq(1).all()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "s.parquet"), table)
    csv = pd.read_csv(tmp_path / "s.csv")
    assert list(csv.columns) == list(table.columns) and np.allclose(csv["accuracy"], table["accuracy"])


def test_an_interrupted_sweep_resumes_without_losing_or_repeating_a_point(tmp_path):
    whole = sweep.run(_points(), tmp_path / "whole", chips=2, progress=False)
    ran = []

    def stop_after_two(point):
        ran.append(point.key)
        if len(ran) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep.run(_points(), tmp_path / "part", chips=2, progress=False, on_point=stop_after_two)
    journal = tmp_path / "part.jsonl"
    assert len(journal.read_text().splitlines()) == 2
    with open(journal, "a") as f:
        f.write('{"key": "a line cut short by the interrupt')  # a write the interruption cut off
    again = []
    resumed = sweep.run(_points(), tmp_path / "part", chips=2, progress=False, on_point=lambda p: again.append(p.key))
    assert again == [p.key for p in _points()[2:]]  # only the points not done
    pd.testing.assert_frame_equal(resumed, whole)


def test_a_users_task_runs_per_chip(tmp_path):
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((64, 32)).astype(np.float32) * 0.1, rng.standard_normal((8, 64)).astype(np.float32)

    def noisy_read(chip, t):  # the relative error of one MVM
        res = chip.program(w)
        chip.advance(t)
        y = np.asarray(chip.linear(res, x))
        return {"error": float(np.abs(y - x @ w).mean() / np.abs(x @ w).mean())}

    task = tasks.per_chip("mvm-error", noisy_read)
    table = sweep.run(sweep.grid({"noise.read_sigma": [0.0, 0.2]}, tasks=["mvm-error"]), tmp_path / "u", chips=3,
                      tasks={"mvm-error": task}, progress=False)
    quiet, loud = (table[table["noise.read_sigma"] == s]["error"] for s in (0.0, 0.2))
    assert loud.mean() > 1.5 * quiet.mean() and len(table) == 6
    with pytest.raises(ValueError, match="unknown sweep task"):
        sweep.task_named("nope")


def test_minilm_agreement_falls_with_drift(tmp_path):
    """The packaged MiniLM on each chip against the CPU: close right after programming, further a
    year later (drift)."""
    table = sweep.run(sweep.grid(times=[0.0, 365 * 86400.0], tasks=["minilm-agreement"]), tmp_path / "m",
                      chips=2, progress=False)
    fresh, year = (table[table.t_s == t] for t in (0.0, 365 * 86400.0))
    # (top-1 over the demo's 5 queries: a query whose two best documents are close may swap them)
    assert (fresh.cosine > 0.95).all() and (fresh.top1 >= 0.8).all()
    assert (year.cosine.values < fresh.cosine.values).all()


def test_the_plots_show_the_mean_and_spread_over_chips(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    table = sweep.run(_points(), tmp_path / "p", chips=2, progress=False)
    ax = sweep.plot(table, "adc.bits", by="t_s")
    lines = ax.get_lines()
    assert len(lines) == 2
    want = table[table.t_s == 0.0].groupby("adc.bits")["accuracy"].mean().values
    np.testing.assert_allclose(lines[0].get_ydata(), want)
    ax = sweep.heatmap(table, "adc.bits", "t_s")
    np.testing.assert_allclose(ax.images[0].get_array(), table.groupby(["t_s", "adc.bits"])["accuracy"].mean()
                               .unstack().values)


def test_the_sidra_sweep_command(tmp_path, capsys):
    from sidra_torch import cli

    out = tmp_path / "cmd"
    assert cli.main(["sweep", "--field", "adc.bits=6,8", "--time", "0", "--chips", "2", "--out", str(out),
                     "--no-progress", "--plot", "adc.bits"]) == 0
    text = capsys.readouterr().out
    assert "2 points x 2 chips" in text and (out.with_suffix(".png")).stat().st_size > 0
    assert len(pd.read_csv(out.with_suffix(".csv"))) == 4
    assert cli.main(["sweep", "--field", "adc.bits", "--out", str(out)]) == 2
    assert "--field takes NAME=V1,V2" in capsys.readouterr().out


def test_a_sweep_on_ray_without_ray_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs Ray: pip install 'sidra\[ray\]'"):
        sweep.run(sweep.grid(), tmp_path / "r", chips=1, ray_address="auto", progress=False)


@pytest.mark.slow
def test_a_ray_cluster_gives_the_same_table_even_when_a_worker_dies(tmp_path):
    import ray
    whole = sweep.run(_points(), tmp_path / "local", chips=2, progress=False)
    marker = tmp_path / "killed"

    def dies_once(chip, t):  # the first attempt of the first point kills its worker process
        if not marker.exists():
            marker.write_text("x")
            os._exit(1)
        return {}

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        table = sweep.run(_points(), tmp_path / "ray", chips=2, progress=False)
        pd.testing.assert_frame_equal(table, whole)
        killed = sweep.run(sweep.grid(tasks=["dies"]), tmp_path / "dies", chips=2, progress=False,
                           tasks={"dies": tasks.per_chip("dies", dies_once)})
        assert marker.exists() and len(killed) == 2  # the task ran again on another worker
        assert [json.loads(line)["key"] for line in (tmp_path / "dies.jsonl").read_text().splitlines()] == \
            [sweep.grid(tasks=["dies"])[0].key]
    finally:
        ray.shutdown()

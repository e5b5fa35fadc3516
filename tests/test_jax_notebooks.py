"""The notebooks in notebooks/ run clean (executed with nbclient), and are stored without outputs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import nbformat
import nbclient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_torch_vs_jax.ipynb", "02_digits_noise_drift.ipynb", "03_transformer_encoder.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_clean(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::DeprecationWarning")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    took = time.perf_counter() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"{path.name} draws no chart"
    print(f"{path.name}: {took:.1f} s")

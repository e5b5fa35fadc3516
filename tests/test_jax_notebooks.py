"""The notebooks in notebooks/ are stored with their outputs (tables, small PNG plots; `scripts/notebooks`
regenerates them), open with the question they answer and end with the answer, and still run clean
(executed again here with nbclient, in memory)."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

import nbformat
import nbclient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PNG_LIMIT = 100_000  # bytes, decoded


def test_the_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_torch_vs_jax.ipynb", "02_digits_noise_drift.ipynb", "03_transformer_encoder.ipynb",
                     "04_populations.ipynb"]


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _kinds(cell):
    """What a code cell's outputs are, as a set: ("stream", "stdout"), ("display_data", "image/png", ...)."""
    kinds = set()
    for out in cell.outputs:
        if out.output_type == "stream":
            kinds.add(("stream", out.name))
        elif out.output_type == "error":
            kinds.add(("error", out.ename))
        else:
            kinds.add((out.output_type, *sorted(out.get("data", {}))))
    return kinds


def _pngs(nb):
    return [base64.b64decode(out.data["image/png"]) for c in _code_cells(nb) for out in c.outputs
            if out.output_type in ("display_data", "execute_result") and "image/png" in out.get("data", {})]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and "?" in first.source, f"{path.name}: open with the question it answers"
    assert last.cell_type == "markdown" and last.source.strip(), f"{path.name}: end with the answer"

    code = _code_cells(nb)
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: run scripts/notebooks (execution counts {counts})"
    for cell in nb.cells:
        assert "execution" not in cell.metadata, f"{path.name}: timing metadata in cell {cell.id}"
    for cell in code:
        assert not any(o.output_type == "error" for o in cell.outputs), f"{path.name}: error output in cell {cell.id}"
        if "print(" in cell.source or "plt.show()" in cell.source:
            assert cell.outputs, f"{path.name}: cell {cell.id} is stored without its outputs; run scripts/notebooks"
        text = nbformat.writes(nbformat.from_dict({"outputs": cell.outputs}))
        for prefix in {str(ROOT), os.path.expanduser("~") + os.sep}:
            assert prefix not in text, f"{path.name}: an absolute path in the outputs of cell {cell.id}"

    pngs = _pngs(nb)
    assert pngs, f"{path.name}: no stored plot"
    for png in pngs:
        assert png.startswith(b"\x89PNG") and len(png) < PNG_LIMIT, f"{path.name}: a {len(png)} byte PNG"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_clean(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore::DeprecationWarning")
    stored_bytes = path.read_bytes()
    stored = nbformat.reads(stored_bytes.decode("utf-8"), as_version=4)
    nb = nbformat.reads(stored_bytes.decode("utf-8"), as_version=4)  # the copy that runs, in memory
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    took = time.perf_counter() - t0
    assert path.read_bytes() == stored_bytes, "executing the notebook wrote to it"
    errors = [o for c in _code_cells(nb) for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert _pngs(nb), f"{path.name} draws no chart"
    # The stored outputs are the ones the notebook produces now: the same kinds of output, cell by cell.
    for fresh, kept in zip(_code_cells(nb), _code_cells(stored), strict=True):
        assert _kinds(kept) == _kinds(fresh), \
            f"{path.name}: cell {fresh.id}'s stored outputs are stale ({_kinds(kept)} vs {_kinds(fresh)}); run scripts/notebooks"
    print(f"{path.name}: {took:.1f} s")

"""`sidra bench MODEL`: runs end to end for every model (tiny sizes), prints figures that agree with
torch.sidra's counters, writes its plot, and refuses bad input with a message naming the fix."""

from __future__ import annotations

import re

import pytest
import torch

import sidra_core
import sidra_torch
from conftest_torch import restore_chip  # noqa: F401  (puts back the chip and seed)
from sidra_torch import cli
from sidra_torch.models import MODELS
from sidra_torch.weights import crossbar_weights

ROWS = ("simulated latency per inference", "energy per inference", "throughput", "crossbar tiles used",
        "tile utilisation", "first call (programming included)", "programming (first call less one inference)",
        "host wall time per inference", "energy by component", "H100 latency", "H100 energy",
        "GPU energy per sentence", "Y1 energy per sentence")
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "J": 1.0, "mJ": 1e-3, "uJ": 1e-6}


def _value(out: str, row: str) -> float:
    """The first number with a unit on a table row, in SI units."""
    line = next(ln for ln in out.splitlines() if row in ln)
    number, unit = re.search(r"([\d.,]+) (s|ms|us|J|mJ|uJ)\b", line.split(row, 1)[1]).groups()
    return float(number.replace(",", "")) * UNITS[unit]


def _bench(capsys, *argv):
    """Run `sidra bench` on the y1 chip the test holds; its counters then cover the timed inferences."""
    with sidra_torch.use_chip("y1"):
        code = cli.main(["bench", *argv])
        counters = torch.sidra.counters()
    return code, capsys.readouterr(), counters


@pytest.mark.parametrize("model", list(MODELS))
def test_bench_runs_every_model_and_agrees_with_the_counters(model, capsys, restore_chip):
    iters = 2
    code, out, c = _bench(capsys, model, "--tiny", "--seq", "8", "--iters", str(iters))
    assert code == 0, out.err
    for row in ROWS:
        assert row in out.out, row
    # The printed figures are the device counters of the timed inferences (printed to 4-5 digits).
    assert _value(out.out, "simulated latency per inference") == pytest.approx(c["busy_s"] / iters, rel=2e-3)
    assert _value(out.out, "energy per inference") == pytest.approx(c["energy_j"] / iters, rel=2e-3)
    tokens_per_s = float(re.search(r"([\d,]+) tokens/s", out.out).group(1).replace(",", ""))
    assert tokens_per_s == pytest.approx(8 * iters / c["busy_s"], rel=2e-3)
    assert c["pulses"] == 0  # programmed on the first call, before the timed inferences
    # Tiles: the model's crossbar weights mapped onto 256 x 256 tiles.
    spec = sidra_core.preset("y1")
    weights = crossbar_weights(MODELS[model](tiny=True).model.to("sidra:0"))
    expected = sum(sidra_core.tile_grid(k, n, spec).tiles for _, _, (k, n) in weights)
    assert f"crossbar tiles used │ {expected} of 2048" in re.sub(r" +", " ", out.out)
    assert "programming crossbars (ISPP)" in out.err  # the progress bar


def test_dry_run_and_plot(capsys, restore_chip, tmp_path):
    path = tmp_path / "bench.png"
    code, out, c = _bench(capsys, "marian-en-tr", "--tiny", "--seq", "6", "--iters", "1", "--dry-run",
                          "--plot", str(path))
    assert code == 0, out.err
    assert "(dry run)" in out.out and f"plot written to {path}" in out.out
    assert _value(out.out, "simulated latency per inference") == pytest.approx(c["busy_s"], rel=2e-3)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_compile_runs_and_pipelines(capsys, restore_chip):
    """--compile: the same model through torch.compile(backend="sidra"): same crossbar work,
    lower simulated latency (graph mode pipelines tokens across layers)."""
    argv = ("bert-base", "--tiny", "--seq", "32", "--iters", "1")
    code, eager, ce = _bench(capsys, *argv)
    assert code == 0, eager.err
    torch._dynamo.reset()
    code, comp, cc = _bench(capsys, *argv, "--compile")
    assert code == 0, comp.err
    assert cc["mvms"] == ce["mvms"] and cc["tile_reads"] == ce["tile_reads"]
    assert _value(comp.out, "simulated latency per inference") < _value(eager.out, "simulated latency per inference")


@pytest.mark.parametrize("argv,message", [
    (["gpt-4"], "unknown model 'gpt-4'; choose one of bert-base, minilm, marian-en-tr, gpt2"),
    (["bert-base", "--batch", "0"], "--batch must be a positive integer, got 0"),
    (["bert-base", "--iters", "-2"], "--iters must be a positive integer, got -2"),
    (["bert-base", "--tiny", "--seq", "513"],
     "--seq 513 is longer than bert-base allows (512 positions); use --seq 512"),
    (["gpt2", "--chip", "y2"], "unknown chip preset 'y2'"),
    (["minilm", "--plot", "out.svg"], "give a file name ending in .png"),
    (["minilm", "--plot", "no/such/folder/out.png"], "the folder 'no/such/folder' does not exist"),
])
def test_bad_input_names_the_problem_and_the_fix(argv, message, capsys, restore_chip):
    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err

"""The `sidra` command: `sidra info` and `sidra demo` run end to end and exit 0."""

import subprocess
import sys

from conftest_torch import restore_chip  # noqa: F401  (puts back the chip and seed)
from sidra_torch import cli


def test_sidra_info(capsys, restore_chip):
    assert cli.main(["info", "--chip", "int8"]) == 0
    out = capsys.readouterr().out
    for word in ("Device properties", "tiles_per_chip", "ideal", "int8", "y1", "Cost model"):
        assert word in out
    flat = lambda text: " ".join(text.split())  # noqa: E731  (rich wraps long lines)
    assert "background power 0 W" in flat(out)  # int8 has none; y1's is calibrated
    from sidra_core import host

    assert f"engine INT8 matmuls by {host.dots()}" in flat(out)  # which kernels run here
    assert f"ISPP write-verify by {host.programming()}" in flat(out)
    assert f"norms by {host.engine_ops()}" in flat(out)
    assert f"packed snapshots by {host.snapshots()}" in flat(out)
    assert f"process settings: {host.tuned()}" in flat(out)
    assert cli.main(["info", "--chip", "y1"]) == 0
    assert "background power 2.9 W while busy" in flat(capsys.readouterr().out)


def test_sidra_demo_quick(capsys, restore_chip):
    assert cli.main(["demo", "--quick", "--top-ops", "3"]) == 0
    out = capsys.readouterr().out
    assert "Semantic search" in out and "Embedding agreement with CPU" in out
    assert "mean cosine 0.9" in out  # the y1 chip's embeddings stay close to the CPU's
    assert "SIDRA device profile" in out and "sidra::addmm" in out


def test_console_script_help():
    r = subprocess.run([sys.executable, "-m", "sidra_torch.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout

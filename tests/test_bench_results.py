"""benchmarks/results.py: figures recorded per host kind, and docs/performance.md's generated tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import results  # noqa: E402


@pytest.mark.parametrize("flags, machine, kind", [
    ({"avx2", "fma", "avx512f", "avx512_vnni", "amx_int8"}, "x86_64", "x86-amx"),
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "x86_64", "x86-avx512"),
    ({"avx2", "fma"}, "x86_64", "x86-avx2"),
    (set(), "aarch64", "arm64"),
])
def test_host_kind_follows_the_instruction_set(flags, machine, kind):
    assert results.kind(flags, machine) == kind


def test_the_portable_flags_record_as_an_avx2_host(monkeypatch):
    monkeypatch.setenv("SIDRA_CPU_FLAGS", "avx2 fma")
    assert results.kind(machine="x86_64") == "x86-avx2"


def test_record_then_render_one_table_per_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("SIDRA_CPU_FLAGS", "avx2 fma")
    out = results.record("bench_x", [("a ratio", "1.23x", "<= 1.5x")], path=tmp_path / "x86-avx2.json")
    results.record("bench_x", [("a ratio", "1.11x", "<= 1.5x")], path=out)  # replaces the entry
    results.record("bench_y", [("a time", "2.0 s", "")], path=out)
    data = json.loads(out.read_text())
    assert set(data) == {"bench_x", "bench_y"} and data["bench_x"]["figures"] == [["a ratio", "1.11x", "<= 1.5x"]]
    from sidra_core import host

    assert "SIDRA_CPU_FLAGS='avx2 fma'" in data["bench_x"]["cpu"] and data["bench_x"]["kernels"] == host.summary()
    page = tmp_path / "performance.md"
    page.write_text(f"# P\n\nintro\n\n{results.START}\nold\n{results.END}\n\nafter\n")
    results.write_page(page, tmp_path)
    text = page.read_text()
    assert "old" not in text and text.startswith("# P\n\nintro\n\n") and text.endswith(f"{results.END}\n\nafter\n")
    assert "| `bench_x` | a ratio | 1.11x | <= 1.5x |" in text and "| `bench_y` | a time | 2.0 s |" in text
    assert text.count("No recorded run yet.") == len(results.KINDS) - 1
    results.write_page(page, tmp_path)  # idempotent
    assert page.read_text() == text


def test_the_page_holds_the_tables_of_the_recorded_results():
    """docs/performance.md's tables are what benchmarks/results.py makes of benchmarks/results/."""
    text = (ROOT / "docs" / "performance.md").read_text()
    start, end = text.index(results.START), text.index(results.END)
    assert text[start + len(results.START) + 1:end] == results.tables()

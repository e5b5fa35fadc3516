"""Benchmark figures per host kind, and the generated tables of docs/performance.md.

A benchmark run with `--record` stores its headline figures in `benchmarks/results/<kind>.json`,
one file per host kind (the CPU's instruction set decides which kernels run, so ratios are only
comparable within a kind); `python3 benchmarks/results.py` rewrites the tables between the
markers of docs/performance.md from those files, one table per kind with the date, the CPU and
the kernels each figure was measured with.
"""

from __future__ import annotations

import datetime
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- benchmark-tables:start -->", "<!-- benchmark-tables:end -->"

# slug -> title, in the order the page shows them
KINDS = {
    "x86-amx": "x86-64 with AMX (AVX-512 VNNI/BF16 and AMX tiles)",
    "x86-avx512": "x86-64 with AVX-512 VNNI (no AMX)",
    "x86-avx2": "x86-64 with AVX2 only (the portable path)",
    "arm64": "ARM64",
}


def kind(flags: set[str] | None = None, machine: str | None = None) -> str:
    """This host's kind (a key of KINDS) from the CPU flags the simulator chooses by
    (`sidra_core.host.cpu_flags()`, which SIDRA_CPU_FLAGS replaces)."""
    if flags is None:
        from sidra_core import host

        flags = host.cpu_flags()
    machine = (machine or platform.machine()).lower()
    if machine in ("arm64", "aarch64"):
        return "arm64"
    if "amx_int8" in flags:
        return "x86-amx"
    if "avx512_vnni" in flags or "avx512vnni" in flags:
        return "x86-avx512"
    return "x86-avx2"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record(bench: str, figures: list[tuple[str, str, str]], path: Path | None = None) -> Path:
    """Store one benchmark's figures ((name, value, target) rows, value and target as printed) for
    this host kind, replacing that benchmark's previous entry. Returns the file written."""
    import os

    from sidra_core import host

    path = path or RESULTS / f"{kind()}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    forced = os.environ.get("SIDRA_CPU_FLAGS")
    data[bench] = {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_model() + (f" (as SIDRA_CPU_FLAGS={forced!r})" if forced else ""),
        "cores": os.cpu_count(),
        "kernels": host.summary(),
        "figures": [list(f) for f in figures],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def tables(results: Path = RESULTS) -> str:
    """The Markdown of every recorded kind's table (kinds without results are listed as such)."""
    out = []
    for slug, title in KINDS.items():
        path = results / f"{slug}.json"
        out.append(f"### {title}\n")
        if not path.exists():
            out.append("No recorded run yet.\n")
            continue
        data = json.loads(path.read_text())
        hosts = sorted({(v["cpu"], v["cores"], v["kernels"]) for v in data.values()})
        for cpu, cores, kernels in hosts:
            out.append(f"- {cpu}, {cores} cores; {kernels}")
        out.append("\n| benchmark | figure | value | target | date |\n| --- | --- | ---: | --- | --- |")
        for bench in sorted(data):
            v = data[bench]
            for name, value, target in v["figures"]:
                out.append(f"| `{bench}` | {name} | {value} | {target} | {v['date']} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write_page(page: Path = PAGE, results: Path = RESULTS) -> None:
    """Replace the text between the benchmark-table markers of docs/performance.md."""
    text = page.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{page} has no {START} ... {END} markers")
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    page.write_text(pattern.sub(lambda _: f"{START}\n{tables(results)}{END}", text, count=1))


def ratio(x: float) -> str:
    return f"{x:.2f}x"


if __name__ == "__main__":
    write_page()
    print(f"wrote {PAGE.relative_to(ROOT)} from {len(list(RESULTS.glob('*.json')))} host kind(s)")
    sys.exit(0)

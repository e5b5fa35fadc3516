"""The README and docs/: the README stays short and its examples run as written; the docs build
strictly (no broken link or anchor) and every page is in the navigation."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_the_readme_has_a_pytorch_and_a_jax_example():
    assert len(BLOCKS) == 2
    assert 'to("sidra:0")' in BLOCKS[0] and "sidra_jax.jit" in BLOCKS[1]


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["pytorch", "jax"][:len(BLOCKS)])
def test_a_readme_example_runs_as_written(index, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip()  # each prints what it shows


def test_every_docs_page_is_in_the_navigation():
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_the_docs_build_strictly(tmp_path):
    """mkdocs (the docs extra) with --strict: a broken link, anchor or missing page fails."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").exists()

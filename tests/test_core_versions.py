"""The tested torch and JAX ranges: declared in pyproject.toml, installed by scripts/setup, and
checked at import with a warning that names the range."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sidra_core import versions

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_declares_the_tested_ranges():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in versions.SUPPORTED:
        assert versions.requirement(name) in deps


def test_setup_installs_the_lowest_declared_releases():
    setup = (ROOT / "scripts" / "setup").read_text()
    for name, (low, _) in versions.SUPPORTED.items():
        assert f'"{name}=={low if low.count(".") == 2 else low + ".0"}"' in setup


@pytest.mark.parametrize("name,version,ok", [
    ("torch", "2.13.0+cpu", True), ("torch", "2.13.1", True), ("torch", "2.12.1", False), ("torch", "2.14.0", False),
    ("jax", "0.10.2", True), ("jax", "0.10.1", False), ("jax", "0.11.0", False), ("jaxlib", "0.10.9rc1", True),
])
def test_versions_in_and_out_of_range(name, version, ok):
    assert versions.supported(name, version) is ok


def test_the_running_releases_are_the_tested_ones():
    import jax
    import jaxlib
    import torch

    for name, module in (("torch", torch), ("jax", jax), ("jaxlib", jaxlib)):
        assert versions.supported(name, module.__version__), (name, module.__version__)


@pytest.mark.parametrize("module,package", [("sidra_torch", "torch"), ("sidra_core", "jax")])
def test_importing_with_an_untested_release_warns_naming_the_range(module, package):
    code = (f"import warnings; warnings.simplefilter('error', RuntimeWarning); import {package}; "
            f"{package}.__version__ = '9.0.0'; import {module}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode != 0
    assert f"sidra is tested with {versions.requirement(package)}, and this is {package} 9.0.0" in out.stderr
    assert f"pip install '{versions.requirement(package)}'" in out.stderr

"""The torch and JAX releases the project is tested with; pyproject.toml declares the same ranges.

The bridges use private entry points of both (torch's Python PrivateUse1 backend, JAX's trace state
and FFI), which change between releases, so a release outside these ranges gets a warning at import.
"""

from __future__ import annotations

import re
import warnings

SUPPORTED: dict[str, tuple[str, str]] = {  # name: (lowest tested, first untested)
    "torch": ("2.13", "2.14"),
    "jax": ("0.10.2", "0.11"),
    "jaxlib": ("0.10.2", "0.11"),
}


def requirement(name: str) -> str:
    low, high = SUPPORTED[name]
    return f"{name}>={low},<{high}"


def _release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0): the numeric release, without local or pre-release tags."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def supported(name: str, version: str) -> bool:
    low, high = SUPPORTED[name]
    return _release(low) <= _release(version) < _release(high)


def check(name: str, version: str) -> None:
    """Warn (RuntimeWarning) when `version` of `name` is outside the tested range, naming the range."""
    if not supported(name, version):
        warnings.warn(f"sidra is tested with {requirement(name)}, and this is {name} {version}: the private "
                      f"{name} APIs it uses may differ. Install a tested release: pip install '{requirement(name)}'",
                      RuntimeWarning, stacklevel=3)

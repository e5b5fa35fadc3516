"""The suite itself: nothing in it can skip a whole module quietly."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_is_skipped_for_a_missing_import_or_at_module_level():
    """Test dependencies are declared (pyproject's test extra): a missing one must fail the run,
    not skip the tests beside the import (a skip at module level hides every test of the file)."""
    pattern = re.compile(r"importorskip|allow_module_level|^pytestmark\s*=.*skip", re.M)
    offenders = [p.name for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name and pattern.search(p.read_text())]
    assert not offenders, offenders

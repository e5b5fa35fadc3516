import os
import sys
from pathlib import Path

# Test helpers (opdb_harness) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

# The suite runs with the simulator's process settings, as the `sidra` command does (importing the
# packages changes nothing; test_core_host checks both).
from sidra_core import host  # noqa: E402

host.tune()


def pytest_report_header(config):
    """Which backend and kernels this run uses: the host's instructions choose (SIDRA_CPU_FLAGS stands in)."""
    from sidra_core import host

    assumed = os.environ.get("SIDRA_CPU_FLAGS")
    return f"sidra: {host.summary()}" + (f"; CPU flags assumed: {assumed}" if assumed is not None else "")

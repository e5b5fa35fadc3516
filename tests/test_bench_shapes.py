"""benchmarks/bench_shapes.py: the any-shape workload is what the issue describes, and one child
process's pass runs and counts the programs it builds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_shapes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_shapes", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_workload_is_40_sentences_of_26_lengths_in_batches_of_1_to_32(bench):
    lengths = bench.sentence_lengths()
    assert len(lengths) == 40 and len(set(lengths)) == 26 and min(lengths) >= 5 and max(lengths) <= 60
    groups = bench.batches(lengths)
    assert [n for g in groups for n in g] == lengths and all(1 <= len(g) <= 32 for g in groups)
    ids, mask = bench._inputs([[3, 7]], vocab=2000)[0]
    assert ids.shape == (2, 7) and mask.sum(1).tolist() == [3, 7]


@pytest.mark.slow  # loads and programs MiniLM
def test_a_pass_on_the_device_counts_its_programs(bench, monkeypatch):
    import jax

    monkeypatch.setattr(bench, "sentence_lengths", lambda: [5, 9, 5])
    # snapshots read by XLA, a program per weight shape, so that the first pass builds programs on
    # every host (where the native library runs, it builds none)
    monkeypatch.setenv("SIDRA_NATIVE_SNAPSHOT", "0")
    jax.clear_caches()
    out = bench.child("sentences", "sidra", 2)
    assert out["calls"] == 3 and out["shapes"] == 2 and len(out["times"]) == 2
    assert sum(out["built"][0].values()) > 0  # new shapes build programs ...
    assert sum(out["built"][1].values()) == 0  # ... the same shapes again build none
    assert out["writes"][0] > 0 and out["writes"][1] == 0  # the weights are programmed in the first pass only


@pytest.mark.slow  # loads and programs MiniLM
def test_where_the_native_library_runs_a_first_pass_builds_no_program(bench, monkeypatch):
    """Programming, snapshots, reads, attention and engine ops all run natively at any shape: a new
    process's first pass over new lengths compiles nothing."""
    import jax

    from sidra_core import host

    if not (host.native_ispp() and host.native_snapshot() and host.native_engine() and host.vnni_dots()):
        pytest.skip(f"the native library does not run every job here: ISPP by {host.programming()}; snapshots by "
                    f"{host.snapshots()}; engine ops by {host.engine_ops()}; reads by {host.dots()}")
    monkeypatch.setattr(bench, "sentence_lengths", lambda: [5, 9, 17])
    jax.clear_caches()
    out = bench.child("sentences", "sidra", 1)
    assert out["built"][0] == {} and out["writes"][0] > 0


def test_programming_time_counts_chip_program_and_puts_it_back(bench):
    from sidra_core.device import Chip

    write = Chip.program
    chip = Chip.create("int8", seed=0)
    with bench.programming_time() as spent:
        chip.program(np.ones((300, 20), np.float32))
        assert Chip.program is not write
    assert spent[0] > 0 and Chip.program is write

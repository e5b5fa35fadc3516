"""Conformance: PyTorch's own OpInfo float32 samples on sidra:0 under the ideal chip equal CPU.

The default run checks a deterministic sample of the ops (every 6th); the full
sweep (`-m slow`, run by CI) checks all of them and the 95 % bar, counted over the
ops that ran on the crossbar or the engine (the others compare the CPU with itself).
"""

import pytest

from opdb_harness import STATUSES, conformance, float32_ops, known_failures, op_key, run_op, sweep

ALL_OPS = float32_ops()
KNOWN = known_failures()


def test_known_failures_file_names_real_ops():
    names = {op_key(op) for op in ALL_OPS}
    assert set(KNOWN) <= names, sorted(set(KNOWN) - names)
    assert all(KNOWN.values()), "every known failure needs a reason"


@pytest.mark.parametrize("op", ALL_OPS[::6], ids=op_key)
def test_op_sample(op):
    import sidra_torch

    with sidra_torch.use_chip("ideal"):
        status, why = run_op(op)
    assert status in STATUSES
    if op_key(op) in KNOWN:
        assert status == "failed", f"{op_key(op)} passes now ({why}): remove it from tests/opdb_known_failures.txt"
    else:
        assert status != "failed", why


def test_the_sweep_tells_device_ops_from_memory_host_and_missing_samples():
    import sidra_torch

    ops = {op_key(op): op for op in ALL_OPS}
    with sidra_torch.use_chip("ideal"):
        assert run_op(ops["mm"])[0] == "device"  # the crossbar or the engine
        assert run_op(ops["softmax"])[0] == "device"
        assert run_op(ops["transpose"])[0] == "memory"  # a view: the CPU compared with itself
        assert run_op(ops["linalg.svd"])[0] == "host"
        assert run_op(ops["normal"])[0] == "no samples"

    class Broken:
        name, variant_test_name = "broken", ""

        def sample_inputs(self, *args, **kwargs):
            raise RuntimeError("no samples on this build")

    assert run_op(Broken()) == ("no samples", "sample generation raised RuntimeError")
    counts, rate = conformance({"a": ("device", ""), "b": ("memory", ""), "c": ("failed", ""), "d": ("host", "")})
    assert counts == {"device": 1, "memory": 1, "host": 1, "no samples": 0, "failed": 1} and rate == 0.5


@pytest.mark.slow
def test_full_sweep_pass_rate():
    results = sweep(ALL_OPS)
    failed = {k for k, (status, _) in results.items() if status == "failed"}
    unexpected = {k: results[k][1] for k in failed - set(KNOWN)}
    newly_passing = sorted(set(KNOWN) - failed)
    assert not unexpected, f"new failures: {unexpected}"
    assert not newly_passing, f"passing now, remove from tests/opdb_known_failures.txt: {newly_passing}"
    counts, rate = conformance(results)
    print(f"OpInfo float32 on sidra:0: {counts} of {len(results)} ops; conformance {rate:.1%}")
    assert rate >= 0.95, f"only {rate:.1%} of the {counts['device'] + counts['failed']} device ops pass"

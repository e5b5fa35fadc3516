"""Conformance: PyTorch's own OpInfo float32 samples on sidra:0 under the ideal chip equal CPU.

The default run checks a deterministic sample of the ops (every 6th); the full
sweep (`-m slow`, run by CI) checks all of them and the 95 % pass-rate bar.
"""

import pytest

from opdb_harness import float32_ops, known_failures, op_key, run_op, sweep

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
        ok, why = run_op(op)
    if op_key(op) in KNOWN:
        assert not ok, f"{op_key(op)} passes now: remove it from tests/opdb_known_failures.txt"
    else:
        assert ok, why


@pytest.mark.slow
def test_full_sweep_pass_rate():
    results = sweep(ALL_OPS)
    failed = {k for k, (ok, _) in results.items() if not ok}
    unexpected = {k: results[k][1] for k in failed - set(KNOWN)}
    newly_passing = sorted(set(KNOWN) - failed)
    assert not unexpected, f"new failures: {unexpected}"
    assert not newly_passing, f"passing now, remove from tests/opdb_known_failures.txt: {newly_passing}"
    rate = 1 - len(failed) / len(results)
    assert rate >= 0.95, f"only {rate:.1%} of {len(results)} ops pass"

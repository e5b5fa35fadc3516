"""`sidra info`: the chip's properties, the presets and how this host runs them."""

from __future__ import annotations

import dataclasses

import sidra_core
from sidra_core import host


def add_arguments(p) -> None:
    p.add_argument("--chip", default="y1", help="preset name or TOML path (default: y1)")


def _row(spec: sidra_core.ChipSpec) -> dict:
    n, t = spec.noise, spec.tile
    return {
        "preset": spec.name,
        "weights": spec.quant.weights,
        "DAC/ADC bits": f"{spec.dac.bits if spec.dac.enabled else '-'}/{spec.adc.bits if spec.adc.enabled else '-'}",
        "read noise": f"{n.read_sigma:.2%}",
        "drift nu": f"{n.drift_nu_mean:g}+-{n.drift_nu_std:g}",
        "stuck off/on": f"{n.stuck_off_rate:.2%}/{n.stuck_on_rate:.2%}",
        "ISPP": f"+-{spec.ispp.tolerance:.1%}" if spec.ispp.enabled else "exact",
        "engine": spec.engine.precision,
        "tiles": str(t.tiles_per_chip * t.chips),
    }


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    import torch

    import sidra_torch

    spec = sidra_core.resolve(args.chip)
    sidra_torch.set_chip(spec)
    props = torch.sidra.get_device_properties()
    console = Console()
    console.print(f"[bold]{torch.sidra.get_device_name()}[/bold]  (torch device 'sidra:0', "
                  f"torch {torch.__version__})")
    t = Table(title="Device properties")
    t.add_column("property")
    t.add_column("value", justify="right")
    for f in dataclasses.fields(props):
        v = getattr(props, f.name)
        if f.name == "total_memory":
            v = f"{v / 2**30:.1f} GiB"
        elif f.name == "weight_capacity":
            v = f"{v / 1e6:.1f} M INT8 weights"
        t.add_row(f.name, str(v))
    console.print(t)
    p = Table(title="Presets (sidra_core.preset(name) / sidra_torch.set_chip(name))")
    rows = [_row(sidra_core.preset(name)) for name in sidra_core.PRESETS]
    for col in rows[0]:
        p.add_column(col)
    for r in rows:
        p.add_row(*r.values())
    console.print(p)
    c = spec.cost
    console.print(f"Cost model: tile MVM {c.tile_mvm_s * 1e9:.0f} ns, array {c.array_pj_per_mac} pJ/MAC, "
                  f"ADC {c.adc_pj} pJ/conversion, engine {spec.engine.ops_per_s / 1e12:.1f} TOPS, "
                  f"host link {spec.memory.host_bw / 1e9:.0f} GB/s, programming pulse {c.pulse_s * 1e9:.0f} ns, "
                  f"background power {c.background_w:g} W while busy")
    console.print(f"Host: the {host.summary()}; SIDRA_BACKEND=native|xla chooses the backend; process settings: "
                  f"{host.tuned()}")
    return 0

"""The `sidra` command: `sidra demo`, `sidra info`, `sidra bench MODEL`, `sidra sweep`.

Each subcommand lives in its own module (demo.py, info.py, bench.py, sweep.py) with
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sidra_core import host

SUBCOMMANDS = {
    "demo": ("sidra_torch.demo", "semantic search with the packaged MiniLM on CPU and on sidra:0, side by side"),
    "info": ("sidra_torch.info", "the chip's properties and the presets"),
    "bench": ("sidra_torch.bench", "simulated latency, energy and host time of a model on the chip"),
    "sweep": ("sidra_torch.sweep", "a parameter sweep on populations of chips, as a table and a plot"),
}


def main(argv=None) -> int:
    host.tune()
    ap = argparse.ArgumentParser(prog="sidra", description="SIDRA analog in-memory-computing chip, simulated.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (mod, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            modules[name] = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        modules[name].add_arguments(p)
    args = ap.parse_args(argv)
    if args.command is None:
        args = ap.parse_args(["demo", *(argv or [])])
    if args.command not in modules:
        ap.error(f"'sidra {args.command}' is not available in this build")
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`sidra sweep`: a parameter sweep over spec fields x times since programming x tasks, each point on
a population of chips (sidra_jax.sweep), written as a tidy table (CSV and Parquet) and a plot.

    sidra sweep --field adc.bits=6,8 --field noise.read_sigma=0.01,0.02 --time 3600,86400 \\
        --task digits-cnn --chips 16 --out results/adc [--ray ADDRESS] [--plot adc.bits]

Run again with the same --out, it resumes: the points already journaled are not run again.
"""

from __future__ import annotations

import json


def _value(text: str):
    """A field value as JSON reads it (6, 0.01, true, "fp16"), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_fields(items) -> dict:
    """--field NAME=V1,V2 ... -> {NAME: [V1, V2]} (dotted spec field names)."""
    fields = {}
    for item in items or []:
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"--field takes NAME=V1,V2,... (a dotted spec field, say adc.bits=6,8), got {item!r}")
        fields[name] = [_value(v) for v in values.split(",")]
    return fields


def add_arguments(p) -> None:
    p.add_argument("--chip", default="y1", help="the base chip: a preset or a TOML path (default y1)")
    p.add_argument("--field", action="append", metavar="NAME=V1,V2",
                   help="a spec field and its values, e.g. adc.bits=6,8 (repeat for a grid)")
    p.add_argument("--time", default="0", help="times since programming in seconds, comma-separated (default 0)")
    p.add_argument("--task", action="append", help="digits-mlp (default), digits-cnn or minilm-agreement; repeat for several")
    p.add_argument("--chips", type=int, default=8, help="chips per point (default 8)")
    p.add_argument("--seed", type=int, default=0, help="the population's seed (default 0)")
    p.add_argument("--out", default="sweep", help="results path without suffix: .jsonl, .csv, .parquet (default sweep)")
    p.add_argument("--ray", metavar="ADDRESS", help="run the points as tasks on this Ray cluster ('auto': the local one)")
    p.add_argument("--plot", metavar="FIELD", help="also plot the (first) metric against this field to <out>.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from sidra_jax import sweep

    try:
        fields = parse_fields(args.field)
        times = [float(t) for t in str(args.time).split(",")]
    except ValueError as e:
        print(f"sidra sweep: {e}")
        return 2
    points = sweep.grid(fields, times=times, tasks=args.task or ["digits-mlp"])
    table = sweep.run(points, args.out, chip=args.chip, chips=args.chips, seed=args.seed, ray_address=args.ray,
                      progress=not args.no_progress)
    keys = [*fields, "t_s", "task"]
    metrics = sweep.metric_columns(table)
    print(table.groupby(keys)[metrics].agg(["mean", "std", "min", "max"]).to_string())
    print(f"\n{len(points)} points x {args.chips} chips: {args.out}.csv, {args.out}.parquet")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        by = next((k for k in keys if k != args.plot and table[k].nunique() > 1), None)
        ax = sweep.plot(table, args.plot, metrics[0], by=by)
        ax.figure.tight_layout()
        ax.figure.savefig(f"{args.out}.png", dpi=100)
        print(f"plot: {args.out}.png")
    return 0

"""A short tour of the device model: program a layer, run it on each preset, read the clock."""

from __future__ import annotations

import numpy as np

from . import Chip, preset


def main() -> None:
    rs = np.random.default_rng(0)
    w = rs.standard_normal((768, 3072)).astype(np.float32) * 0.04
    x = rs.standard_normal((128, 768)).astype(np.float32)
    ref = x @ w
    print("SIDRA device model: a 768x3072 layer, 128 input rows")
    print(f"{'chip':<8}{'rel. error':>12}{'tiles':>7}{'pulses':>12}{'device us':>11}{'energy uJ':>11}")
    for name in ("ideal", "int8", "y1"):
        chip = Chip(spec=preset(name), seed=0)
        res = chip.program(w, name="fc")
        prog = chip.clock.counters
        y = np.asarray(chip.linear(res, x))
        run = chip.clock.counters
        err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        print(f"{name:<8}{err:>12.4f}{res.tiles:>7}{prog.pulses:>12,}"
              f"{(run.time_s - prog.time_s) * 1e6:>11.1f}{(run.energy_j - prog.energy_j) * 1e6:>11.2f}")
    chip = Chip(spec=preset("y1"), seed=0)
    res = chip.program(w, name="fc")
    y0 = np.asarray(chip.linear(res, x))
    chip.advance(365 * 24 * 3600.0)
    y1 = np.asarray(chip.linear(res, x))
    print(f"y1 after one year of drift: output gain {np.sum(y1 * y0) / np.sum(y0 * y0):.4f}")


if __name__ == "__main__":
    main()

"""Chip specification: frozen dataclasses, presets, TOML loading and validation.

Every field carries its allowed range in the dataclass metadata, so validation,
error messages and documentation come from one place.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping


def _f(default, lo=None, hi=None, choices=None, doc: str = ""):
    """A spec field with its allowed range (inclusive) or choices and a one-line doc."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "choices": choices, "doc": doc})


class _Section:
    """Validation shared by every spec section: ranges and choices from field metadata."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            where = f"{type(self).__name__}.{f.name}"
            if meta.get("choices") is not None:
                if value not in meta["choices"]:
                    raise ValueError(
                        f"{where} = {value!r} is not allowed; choose one of {list(meta['choices'])}"
                    )
                continue
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{where} = {value!r} must be true or false")
                continue
            if isinstance(f.default, (int, float)):
                if isinstance(f.default, int) and (isinstance(value, bool) or not isinstance(value, int)):
                    raise ValueError(f"{where} = {value!r} must be an integer")
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{where} = {value!r} must be a number")
                if isinstance(value, float) and math.isnan(value):
                    raise ValueError(f"{where} = nan is not a number")
                lo, hi = meta.get("lo"), meta.get("hi")
                if (lo is not None and value < lo) or (hi is not None and value > hi):
                    raise ValueError(f"{where} = {value!r} is out of range; allowed [{lo}, {hi}]")


@dataclass(frozen=True)
class TileSpec(_Section):
    """Crossbar geometry and conductance window (DEVICE_MODEL section 2)."""

    rows: int = _f(256, 1, 4096, doc="word lines per array (input dimension of a tile)")
    cols: int = _f(256, 1, 4096, doc="bit lines per array (output dimension of a tile)")
    tiles_per_chip: int = _f(2048, 1, 1 << 20, doc="crossbar tiles (G+/G- array pairs) on one chip")
    chips: int = _f(1, 1, 1024, doc="chips in the system")
    allow_multi_chip: bool = _f(True, doc="map a model over several chips when one is not enough")
    g_min: float = _f(0.5e-6, 0.0, 1e-3, doc="lowest programmable conductance (S)")
    g_max: float = _f(40e-6, 1e-9, 1e-2, doc="highest programmable conductance (S)")

    def __post_init__(self):
        super().__post_init__()
        if self.g_max <= self.g_min:
            raise ValueError(
                f"TileSpec.g_max = {self.g_max!r} must be larger than TileSpec.g_min = {self.g_min!r}"
            )


@dataclass(frozen=True)
class DACSpec(_Section):
    """Input digital-to-analog converters driving the word lines."""

    enabled: bool = _f(True, doc="quantise inputs to signed `bits` with a dynamic per-row scale")
    bits: int = _f(8, 2, 16, doc="DAC resolution (signed)")
    v_read: float = _f(0.2, 0.01, 2.0, doc="read voltage at full scale (V)")


@dataclass(frozen=True)
class ADCSpec(_Section):
    """Column analog-to-digital converters, one conversion per tile column and read."""

    enabled: bool = _f(True, doc="digitise each tile's column sums")
    bits: int = _f(8, 2, 16, doc="ADC resolution (signed)")
    full_scale: float = _f(
        0.125, 1e-4, 1.0,
        doc="full-scale range as a fraction of the largest sum the column can produce "
        "(127 x sum|w| of that tile column); larger values clip less but resolve less. "
        "1/8: digits int8 within 0.2 points of float32 and MiniLM cosine 0.983 under y1; "
        "1/16 clips the all-positive sums after ReLU (digits -2.6 points)",
    )


@dataclass(frozen=True)
class QuantSpec(_Section):
    """How float weights are mapped to INT8 codes."""

    weights: str = _f("int8", choices=("int8", "float"), doc="float = ideal analog weights, no quantisation")
    granularity: str = _f("per_channel", choices=("per_channel", "per_tensor"), doc="weight scale per output channel or per tensor")
    clip_percentile: float = _f(100.0, 50.0, 100.0, doc="percentile of |w| mapped to code 127 (100 = max)")


@dataclass(frozen=True)
class NoiseSpec(_Section):
    """Analog non-idealities (DEVICE_MODEL section 3); every one can be switched off."""

    read_sigma: float = _f(0.0, 0.0, 0.5, doc="read noise sigma as a fraction of the cell's G, fresh per read")
    prog_relax_sigma: float = _f(0.0, 0.0, 0.5, doc="conductance relaxation right after write-verify, fraction of G")
    drift_nu_mean: float = _f(0.0, 0.0, 1.0, doc="mean drift exponent nu, G(t) = G0 ((t - t_prog + t0)/t0)^-nu")
    drift_nu_std: float = _f(0.0, 0.0, 1.0, doc="spread of nu across cells (drawn at programming)")
    drift_t0: float = _f(20.0, 1e-6, 1e6, doc="drift reference time t0 (s)")
    stuck_off_rate: float = _f(0.0, 0.0, 0.5, doc="fraction of cells stuck at G_min (fixed per chip seed)")
    stuck_on_rate: float = _f(0.0, 0.0, 0.5, doc="fraction of cells stuck at G_max (fixed per chip seed)")
    ir_drop: float = _f(0.0, 0.0, 0.5, doc="first-order IR-drop attenuation at the far corner of a fully-on array")
    drift_compensation: bool = _f(False, doc="rescale each tile by a gain re-estimated from a reference read")


@dataclass(frozen=True)
class ISPPSpec(_Section):
    """Incremental step pulse programming (write-verify), DEVICE_MODEL section 4.

    A pulse of the n-th step of a ramp moves the normalised conductance u by
    `step0 * (1 + n * ramp) * (1 - u)` (SET) or `... * u` (RESET), times a
    cycle-to-cycle factor `1 + c2c_sigma * N(0, 1)`; a verify read (with read
    noise) after each pulse stops the cell once within `tolerance`.
    """

    enabled: bool = _f(True, doc="simulate write-verify; off = targets written exactly")
    tolerance: float = _f(0.01, 1e-5, 0.5, doc="verify window, fraction of G_max")
    step0: float = _f(0.04, 1e-4, 1.0, doc="normalised step of the first pulse of a ramp")
    ramp: float = _f(0.5, 0.0, 10.0, doc="step growth per pulse as the amplitude ramps up")
    c2c_sigma: float = _f(0.15, 0.0, 1.0, doc="cycle-to-cycle variation of a pulse's effect")
    max_pulses: int = _f(40, 1, 1000, doc="pulses before a cell is given up (stays where it is)")
    endurance: float = _f(1e6, 1.0, 1e15, doc="write cycles a cell survives; warn past it")


@dataclass(frozen=True)
class EngineSpec(_Section):
    """Digital compute engine for non-linear and activation x activation ops."""

    precision: str = _f("fp16", choices=("fp32", "fp16", "bf16", "int8"), doc="arithmetic of the engine")
    matmul: str = _f("int8", choices=("int8", "fp32"), doc="activation x activation matmul: INT8 MACs or float")
    ops_per_s: float = _f(1.5e12, 1e6, 1e18, doc="engine throughput (ops/s, INT8 MAC = 2 ops)")
    pj_per_op: float = _f(0.5, 0.0, 1e6, doc="engine energy per op (pJ)")
    launch_s: float = _f(50e-9, 0.0, 1.0, doc="fixed latency to start an engine op (s)")


@dataclass(frozen=True)
class MemorySpec(_Section):
    """Device memory, on-chip SRAM and the host link."""

    dram_bytes: int = _f(4 << 30, 1, 1 << 50, doc="device memory capacity (bytes)")
    dram_bw: float = _f(200e9, 1e6, 1e15, doc="device memory bandwidth (B/s)")
    dram_pj_per_byte: float = _f(20.0, 0.0, 1e6, doc="device memory energy (pJ/B)")
    sram_bw: float = _f(1e12, 1e6, 1e16, doc="on-chip SRAM buffer bandwidth (B/s)")
    sram_pj_per_byte: float = _f(1.0, 0.0, 1e6, doc="SRAM buffer energy (pJ/B)")
    host_bw: float = _f(16e9, 1e6, 1e15, doc="host link bandwidth (B/s)")
    host_latency_s: float = _f(2e-6, 0.0, 1.0, doc="host link latency per transfer (s)")
    host_pj_per_byte: float = _f(60.0, 0.0, 1e6, doc="host link energy (pJ/B)")
    chip_link_bw: float = _f(50e9, 1e6, 1e15, doc="inter-chip link bandwidth (B/s)")
    chip_link_pj_per_byte: float = _f(10.0, 0.0, 1e6, doc="inter-chip link energy (pJ/B)")


@dataclass(frozen=True)
class CostSpec(_Section):
    """Latency and energy coefficients of the crossbar and its periphery."""

    tile_mvm_s: float = _f(130e-9, 1e-12, 1e-3, doc="one tile MVM: DAC, array settle, ADC conversions (s)")
    dac_pj: float = _f(0.05, 0.0, 1e6, doc="energy per DAC conversion (one input row) (pJ)")
    array_pj_per_mac: float = _f(0.05, 0.0, 1e6, doc="array read energy per multiply-accumulate (pJ)")
    adc_pj: float = _f(2.0, 0.0, 1e6, doc="energy per ADC conversion (one column) (pJ)")
    accum_pj: float = _f(0.1, 0.0, 1e6, doc="digital partial-sum accumulation per output per tile (pJ)")
    accum_s_per_tile: float = _f(2e-9, 0.0, 1e-3, doc="digital accumulation latency per extra input tile (s)")
    pulse_s: float = _f(100e-9, 1e-12, 1.0, doc="one programming pulse plus its verify read (s)")
    pulse_pj: float = _f(10.0, 0.0, 1e9, doc="energy of one programming pulse plus verify read (pJ)")
    rows_programmed_in_parallel: int = _f(1, 1, 4096, doc="word lines written at once in a tile")
    tiles_programmed_in_parallel: int = _f(64, 1, 1 << 20, doc="tiles written at once")
    background_w: float = _f(
        0.0, 0.0, 1e4,
        doc="power the chip draws while busy whatever it computes: leakage, clock tree, analog bias, "
        "DRAM refresh, link PHYs (W); charged by the device clock over busy time, not over idle time",
    )


@dataclass(frozen=True)
class ChipSpec:
    """The whole chip: every section plus the chip seed that fixes its bad cells.

    Attributes:
        name: The chip's name (a preset's, or "custom").
        seed: The chip seed, in [0, 2**63): with each cell's physical id it fixes the stuck cells.
        tile: Crossbar geometry and conductance window.
        dac: The input DACs.
        adc: The column ADCs.
        quant: How float weights become INT8 codes.
        noise: The analog non-idealities.
        ispp: Write-verify programming.
        engine: The digital compute engine.
        memory: Device memory, on-chip SRAM and the links.
        cost: Latency and energy coefficients of the crossbar and its periphery.

    Raises:
        ValueError: The seed is out of range (each section checks its own fields).
    """

    name: str = "custom"
    seed: int = 0
    tile: TileSpec = TileSpec()
    dac: DACSpec = DACSpec()
    adc: ADCSpec = ADCSpec()
    quant: QuantSpec = QuantSpec()
    noise: NoiseSpec = NoiseSpec()
    ispp: ISPPSpec = ISPPSpec()
    engine: EngineSpec = EngineSpec()
    memory: MemorySpec = MemorySpec()
    cost: CostSpec = CostSpec()

    def __post_init__(self):
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"ChipSpec.seed = {self.seed!r} is out of range; allowed [0, 2**63)")
        # Specs key memoised cost functions and jit caches on every op: hash the tree once.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def quantised(self) -> bool:
        return self.quant.weights == "int8"

    @property
    def analog_noise(self) -> bool:
        n = self.noise
        return n.read_sigma > 0

    @property
    def drifts(self) -> bool:
        """Programmed conductances drift with device time (some cells have a drift exponent)."""
        return self.noise.drift_nu_mean != 0 or self.noise.drift_nu_std != 0

    @property
    def cells_per_tile(self) -> int:
        return self.tile.rows * self.tile.cols

    def replace(self, **overrides) -> "ChipSpec":
        """Copy with overrides; nested fields as `section={...}` or `section__field=value`."""
        return _apply_overrides(self, overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: "ChipSpec | None" = None) -> "ChipSpec":
        base = base if base is not None else preset(data.get("preset", "y1"))
        data = {k: v for k, v in data.items() if k != "preset"}
        return _apply_overrides(base, data)

    @classmethod
    def from_toml(cls, path: str | Path, **overrides) -> "ChipSpec":
        """Load a spec from TOML: an optional `preset = "y1"` key, then sections as tables."""
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        return cls.from_dict(data).replace(**overrides)


_SECTIONS = {f.name: f.type for f in fields(ChipSpec) if f.name not in ("name", "seed")}


def _apply_overrides(spec: ChipSpec, overrides: Mapping[str, Any]) -> ChipSpec:
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name and section not in _SECTIONS:
            raise ValueError(
                f"ChipSpec has no section {section!r} (in {key!r}); sections are {sorted(_SECTIONS)}"
            )
        if name:
            nested.setdefault(section, {})[name] = value
        elif key in _SECTIONS and isinstance(value, Mapping):
            nested.setdefault(key, {}).update(value)
        else:
            top[key] = value
    for key in list(top) + list(nested):
        if key not in ("name", "seed") and key not in _SECTIONS:
            raise ValueError(
                f"ChipSpec has no field {key!r}; fields are name, seed and the sections {sorted(_SECTIONS)}"
            )
    for section, values in nested.items():
        current = getattr(spec, section)
        valid = {f.name for f in fields(current)}
        for name in values:
            if name not in valid:
                raise ValueError(
                    f"{type(current).__name__} has no field {name!r}; fields are {sorted(valid)}"
                )
        top[section] = replace(current, **values)
    return replace(spec, **top)


def _ideal() -> ChipSpec:
    return ChipSpec(
        name="ideal",
        dac=DACSpec(enabled=False),
        adc=ADCSpec(enabled=False),
        quant=QuantSpec(weights="float"),
        ispp=ISPPSpec(enabled=False),
        engine=EngineSpec(precision="fp32", matmul="fp32"),
    )


def _int8() -> ChipSpec:
    return ChipSpec(name="int8", ispp=ISPPSpec(enabled=False))


def _y1() -> ChipSpec:
    # The full chip: device figures from DEVICE_MODEL section 3, cost terms calibrated to the SIDRA
    # documentation's Y1 figures (sidra_torch/bench.py; tests/test_calibration.py checks each).
    # Why each value is what it is: see docs/device-model.md.
    return ChipSpec(
        name="y1",
        cost=CostSpec(
            tile_mvm_s=100e-9,  # one tile MVM: DAC, array settling, ADC conversions
            pulse_s=270e-9,  # one ISPP cycle: write pulse, verify read, line-bias switching
            background_w=2.9,  # the working chip's background power, charged over busy time
        ),
        engine=EngineSpec(
            ops_per_s=8.2e12,  # a 64 x 64 INT8 MAC array at 1 GHz
            pj_per_op=1.0,  # a digital INT8 engine with its operand buffers (1 TOPS/W)
            launch_s=0.9e-6,  # fixed cost of starting an engine op (descriptor, LUTs, SRAM streams)
        ),
        ispp=ISPPSpec(tolerance=0.01),  # verify window +-1 % of G_max
        noise=NoiseSpec(
            read_sigma=0.0075,  # read noise, 0.75 % of G per read
            prog_relax_sigma=0.015,  # relaxation after the last verify, 1.5 % of G
            drift_nu_mean=0.01,  # RRAM drift exponent nu ~ N(0.01, 0.004), t0 = 20 s
            drift_nu_std=0.004,
            drift_t0=20.0,
            stuck_off_rate=0.001,  # 0.1 % stuck at G_min
            stuck_on_rate=0.0005,  # 0.05 % stuck at G_max
        ),
    )


def _y1_ir() -> ChipSpec:
    return _y1().replace(name="y1-ir", noise__ir_drop=0.05)


def _pcm() -> ChipSpec:
    return _y1().replace(name="pcm", noise__drift_nu_mean=0.06, noise__drift_nu_std=0.02)


PRESETS = {"ideal": _ideal, "int8": _int8, "y1": _y1, "y1-ir": _y1_ir, "pcm": _pcm}


def preset(name: str, **overrides) -> ChipSpec:
    """A named preset (`ideal`, `int8`, `y1`, `y1-ir`, `pcm`), optionally with overrides.

    Args:
        name: The preset's name (a key of PRESETS).
        **overrides: Field overrides, as `section__field=value` or `section={field: value}`.

    Returns:
        The preset's ChipSpec with the overrides applied.

    Raises:
        ValueError: An unknown preset, or an override that names no field or is out of range.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown chip preset {name!r}; choose one of {sorted(PRESETS)} or pass a ChipSpec / TOML path")
    spec = PRESETS[name]()
    return spec.replace(**overrides) if overrides else spec


def resolve(chip: "str | Path | ChipSpec", **overrides) -> ChipSpec:
    """A ChipSpec from a preset name, a TOML path or a spec object.

    Args:
        chip: A preset name, a TOML file (a Path, or a str ending in .toml) or a ChipSpec.
        **overrides: Field overrides, as `preset` takes them.

    Returns:
        The ChipSpec with the overrides applied.

    Raises:
        TypeError: `chip` is none of these.
        ValueError: An unknown preset, or an override that names no field or is out of range.
    """
    if isinstance(chip, ChipSpec):
        return chip.replace(**overrides) if overrides else chip
    if isinstance(chip, Path) or (isinstance(chip, str) and chip.endswith(".toml")):
        return ChipSpec.from_toml(chip, **overrides)
    if isinstance(chip, str):
        return preset(chip, **overrides)
    raise TypeError(f"a chip is a preset name, a TOML path or a ChipSpec, not {type(chip).__name__}")

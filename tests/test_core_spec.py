"""ChipSpec: presets, TOML loading, overrides, and validation of every field from its metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import sidra_core as sc
from sidra_core.spec import ChipSpec, TileSpec

SECTION_NAMES = [f.name for f in dataclasses.fields(ChipSpec) if f.name not in ("name", "seed")]
SECTION_CLASSES = {name: type(getattr(ChipSpec(), name)) for name in SECTION_NAMES}


def _all_fields():
    """(section class, field) for every field of every spec section."""
    out = []
    for name in SECTION_NAMES:
        cls = SECTION_CLASSES[name]
        out.extend((cls, f) for f in dataclasses.fields(cls))
    return out


ALL_FIELDS = _all_fields()


def _make(cls, fname, value):
    """Construct a section with one field set, keeping cross-field constraints (g_min < g_max) satisfied."""
    kwargs = {fname: value}
    if cls is TileSpec and fname == "g_min":
        kwargs["g_max"] = 1e-2  # the largest allowed g_max, so any allowed g_min is below it
    if cls is TileSpec and fname == "g_max":
        kwargs["g_min"] = 0.0
    return cls(**kwargs)


def _is_int_field(f):
    return isinstance(f.default, int) and not isinstance(f.default, bool)


def _outside(f):
    """Values just outside the allowed range of a numeric field, as (value, side)."""
    lo, hi = f.metadata["lo"], f.metadata["hi"]
    vals = []
    if lo is not None:
        vals.append(lo - 1 if _is_int_field(f) else (lo - abs(lo) * 0.01 if lo else -1e-9))
    if hi is not None:
        vals.append(hi + 1 if _is_int_field(f) else hi * 1.01)
    return vals


def _field_id(p):
    cls, f = p
    return f"{cls.__name__}.{f.name}"


# ---------------------------------------------------------------------------
# Presets


def test_preset_names():
    assert set(sc.PRESETS) == {"ideal", "int8", "y1", "y1-ir", "pcm"}
    for name in sc.PRESETS:
        spec = sc.preset(name)
        assert isinstance(spec, ChipSpec)
        assert spec.name == name
        assert sc.preset(name) == spec  # deterministic construction


def _no_analog_noise(spec):
    n = spec.noise
    return (n.read_sigma == 0 and n.prog_relax_sigma == 0 and n.drift_nu_mean == 0 and n.drift_nu_std == 0
            and n.stuck_off_rate == 0 and n.stuck_on_rate == 0 and n.ir_drop == 0)


def test_preset_ideal():
    s = sc.preset("ideal")
    assert s.quant.weights == "float" and not s.quantised
    assert not s.dac.enabled and not s.adc.enabled
    assert _no_analog_noise(s) and not s.analog_noise
    assert not s.ispp.enabled
    assert s.engine.precision == "fp32" and s.engine.matmul == "fp32"


def test_preset_int8():
    s = sc.preset("int8")
    assert s.quantised and s.quant.weights == "int8"
    assert s.dac.enabled and s.adc.enabled
    assert s.dac.bits == 8 and s.adc.bits == 8
    assert _no_analog_noise(s) and not s.analog_noise
    assert not s.ispp.enabled


@pytest.mark.parametrize("name", ["y1", "y1-ir", "pcm"])
def test_preset_y1_family(name):
    s = sc.preset(name)
    n = s.noise
    assert s.quantised and s.dac.enabled and s.adc.enabled and s.ispp.enabled
    assert s.dac.bits == 8 and s.adc.bits == 8
    assert (s.tile.rows, s.tile.cols) == (256, 256)
    assert 0.005 <= n.read_sigma <= 0.01  # 0.5-1 % of G
    assert n.prog_relax_sigma > 0
    assert n.drift_t0 == 20.0
    assert n.stuck_off_rate == pytest.approx(0.001)
    assert n.stuck_on_rate == pytest.approx(0.0005)
    if name == "pcm":
        assert 0.05 <= n.drift_nu_mean <= 0.1
    else:
        assert n.drift_nu_mean == pytest.approx(0.01) and n.drift_nu_std == pytest.approx(0.004)
    if name == "y1-ir":
        assert n.ir_drop > 0
    else:
        assert n.ir_drop == 0
    assert not n.drift_compensation


def test_y1_ir_differs_from_y1_only_in_ir_drop():
    a, b = sc.preset("y1"), sc.preset("y1-ir")
    assert b.replace(name="y1", noise__ir_drop=0.0) == a


def test_y1_is_default_and_plausible_window():
    s = sc.preset("y1")
    assert 0.1e-6 <= s.tile.g_min <= 2e-6 and 20e-6 <= s.tile.g_max <= 100e-6
    assert 0.1 <= s.dac.v_read <= 0.5


def test_unknown_preset():
    with pytest.raises(ValueError) as ei:
        sc.preset("y2")
    msg = str(ei.value)
    assert "'y2'" in msg
    for name in sc.PRESETS:
        assert name in msg
    with pytest.raises(ValueError, match="y2"):
        sc.resolve("y2")


# ---------------------------------------------------------------------------
# Overrides, TOML, resolve


def test_keyword_overrides():
    base = sc.preset("int8")
    s = base.replace(adc__bits=6, noise={"read_sigma": 0.01}, seed=5)
    assert s.adc.bits == 6
    assert s.noise.read_sigma == 0.01
    assert s.seed == 5
    # everything else untouched
    assert s.adc.full_scale == base.adc.full_scale and s.dac == base.dac and s.ispp == base.ispp
    assert base.adc.bits == 8  # the original is not modified
    assert sc.preset("int8", adc__bits=6) == base.replace(adc__bits=6)


def _write_toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "chip.toml"
    p.write_text(text)
    return p


TOML = """
preset = "int8"
seed = 7

[adc]
bits = 10
full_scale = 0.25

[noise]
read_sigma = 0.002
stuck_on_rate = 0.001
"""


def test_from_toml(tmp_path):
    path = _write_toml(tmp_path, TOML)
    s = ChipSpec.from_toml(path)
    base = sc.preset("int8")
    assert s.seed == 7
    assert s.adc.bits == 10 and s.adc.full_scale == 0.25
    assert s.noise.read_sigma == 0.002 and s.noise.stuck_on_rate == 0.001
    # the rest comes from the int8 preset, not y1
    assert not s.ispp.enabled
    assert s.noise.drift_nu_mean == 0
    assert s.dac == base.dac and s.tile == base.tile and s.engine == base.engine


def test_from_toml_with_overrides(tmp_path):
    path = _write_toml(tmp_path, TOML)
    s = ChipSpec.from_toml(path, adc__bits=6, noise={"read_sigma": 0.01})
    assert s.adc.bits == 6
    assert s.adc.full_scale == 0.25  # from the file
    assert s.noise.read_sigma == 0.01
    assert s.noise.stuck_on_rate == 0.001  # section dict override merges, does not replace the section


def test_from_toml_default_preset_is_y1(tmp_path):
    path = _write_toml(tmp_path, "[adc]\nbits = 7\n")
    s = ChipSpec.from_toml(path)
    assert s.adc.bits == 7
    assert s.noise == sc.preset("y1").noise


def test_from_toml_invalid_value(tmp_path):
    path = _write_toml(tmp_path, 'preset = "int8"\n[adc]\nbits = 40\n')
    with pytest.raises(ValueError, match=r"ADCSpec\.bits = 40"):
        ChipSpec.from_toml(path)


@pytest.mark.parametrize("text,needle", [
    ('preset = "int8"\n[adc]\nbitz = 6\n', "bitz"),
    ('preset = "int8"\n[adcc]\nbits = 6\n', "adcc"),
    ('preset = "int9"\n', "int9"),
])
def test_from_toml_unknown_names(tmp_path, text, needle):
    path = _write_toml(tmp_path, text)
    with pytest.raises(ValueError, match=needle):
        ChipSpec.from_toml(path)


def test_resolve(tmp_path):
    path = _write_toml(tmp_path, TOML)
    by_name = sc.resolve("int8")
    assert by_name == sc.preset("int8")
    assert sc.resolve("int8", adc__bits=6).adc.bits == 6
    assert sc.resolve(str(path)) == ChipSpec.from_toml(path)
    assert sc.resolve(path) == ChipSpec.from_toml(path)
    assert sc.resolve(path, adc__bits=5).adc.bits == 5
    obj = sc.preset("y1", seed=3)
    assert sc.resolve(obj) is obj
    assert sc.resolve(obj, adc__bits=6) == obj.replace(adc__bits=6)
    with pytest.raises(TypeError):
        sc.resolve(42)


def test_dict_roundtrip():
    for name in sc.PRESETS:
        s = sc.preset(name, seed=11)
        assert ChipSpec.from_dict(s.to_dict()) == s


# ---------------------------------------------------------------------------
# Unknown names


@pytest.mark.parametrize("overrides,needles", [
    ({"adc__bitz": 6}, ["ADCSpec", "'bitz'", "bits"]),
    ({"adcc__bits": 6}, ["'adcc'", "adc"]),
    ({"foo": 1}, ["'foo'"]),
    ({"noise": {"read_sigmaa": 0.1}}, ["NoiseSpec", "'read_sigmaa'", "read_sigma"]),
])
def test_unknown_field_names(overrides, needles):
    with pytest.raises(ValueError) as ei:
        sc.preset("y1", **overrides)
    for n in needles:
        assert n in str(ei.value)


@pytest.mark.parametrize("key", ["seed__x", "name__x"])
def test_unknown_subfield_of_scalar(key):
    with pytest.raises(ValueError, match="x"):
        sc.preset("y1", **{key: 1})


# ---------------------------------------------------------------------------
# Validation of every field, generated from dataclass metadata


def test_every_field_has_range_or_choices():
    """The generated validation tests below cover a field only if it declares what is allowed."""
    for cls, f in ALL_FIELDS:
        m = f.metadata
        if isinstance(f.default, bool):
            continue
        if m.get("choices") is not None:
            assert f.default in m["choices"], _field_id((cls, f))
            continue
        assert isinstance(f.default, (int, float)), _field_id((cls, f))
        assert m.get("lo") is not None and m.get("hi") is not None, f"{_field_id((cls, f))} has no range"
        assert m["lo"] <= f.default <= m["hi"], _field_id((cls, f))
        assert m.get("doc"), f"{_field_id((cls, f))} has no doc"


@pytest.mark.parametrize("cf", ALL_FIELDS, ids=_field_id)
def test_field_out_of_range(cf):
    cls, f = cf
    where = f"{cls.__name__}.{f.name}"
    m = f.metadata
    if m.get("choices") is not None:
        bad = "not-a-choice"
        with pytest.raises(ValueError) as ei:
            _make(cls, f.name, bad)
        msg = str(ei.value)
        assert where in msg and repr(bad) in msg
        for c in m["choices"]:
            assert repr(c) in msg
        # every allowed choice is accepted
        for c in m["choices"]:
            assert getattr(_make(cls, f.name, c), f.name) == c
        return
    if isinstance(f.default, bool):
        for bad in ("yes", 1, None):
            with pytest.raises(ValueError) as ei:
                _make(cls, f.name, bad)
            msg = str(ei.value)
            assert where in msg and repr(bad) in msg and "true or false" in msg
        for ok in (True, False):
            assert getattr(_make(cls, f.name, ok), f.name) is ok
        return
    lo, hi = m["lo"], m["hi"]
    values = _outside(f)
    assert len(values) == 2
    for bad in values:
        with pytest.raises(ValueError) as ei:
            _make(cls, f.name, bad)
        msg = str(ei.value)
        assert where in msg, msg
        assert repr(bad) in msg, msg
        assert f"[{lo}, {hi}]" in msg, msg
    # the bounds themselves are allowed (inclusive)
    for ok in (lo, hi):
        assert getattr(_make(cls, f.name, ok), f.name) == ok
    # wrong types and NaN
    for bad in ("1", None, float("nan")) if not _is_int_field(f) else ("1", None, float("nan"), lo + 0.5):
        with pytest.raises(ValueError) as ei:
            _make(cls, f.name, bad)
        assert where in str(ei.value)


@pytest.mark.parametrize("cf", [cf for cf in ALL_FIELDS if cf[1].metadata.get("lo") is not None], ids=_field_id)
def test_field_out_of_range_through_overrides(cf):
    """The same validation applies to `preset(..., section__field=value)`."""
    cls, f = cf
    section = next(n for n, c in SECTION_CLASSES.items() if c is cls)
    bad = _outside(f)[-1]
    with pytest.raises(ValueError, match=f"{cls.__name__}\\.{f.name}"):
        sc.preset("ideal", **{f"{section}__{f.name}": bad})


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True, "3"])
def test_seed_out_of_range(bad):
    with pytest.raises(ValueError) as ei:
        ChipSpec(seed=bad)
    assert "ChipSpec.seed" in str(ei.value) and repr(bad) in str(ei.value)
    assert ChipSpec(seed=2**63 - 1).seed == 2**63 - 1


def test_g_window_order():
    with pytest.raises(ValueError) as ei:
        TileSpec(g_min=50e-6, g_max=40e-6)
    msg = str(ei.value)
    assert "TileSpec.g_max" in msg and "TileSpec.g_min" in msg


def test_int_field_given_integral_float_is_int_or_rejected():
    try:
        s = sc.preset("int8", tile__rows=128.0)
    except ValueError:
        return
    assert type(s.tile.rows) is int
    st = sc.program(np.ones((10, 10), np.float32), s)
    assert st.grid.rows == 128


# ---------------------------------------------------------------------------
# Frozen


def test_frozen():
    s = sc.preset("y1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.adc.bits = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.noise = sc.NoiseSpec()
    assert s.seed == 0 and s.adc.bits == 8 and s.noise == sc.preset("y1").noise

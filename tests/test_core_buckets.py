"""Row buckets (sidra_core.buckets): a chip op runs at its rows' bucket, gives its real rows the
bits it gives them unpadded, is priced for its real rows, and compiles a program per bucket only."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sidra_core as sc
from sidra_core import buckets, compiles, crossbar, engine, host

# The chips whose reads are integer arithmetic (INT8 DAC codes): bit-identical padded or not.
INTEGER_CHIPS = ["y1", "int8"]


def _x(shape, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


@pytest.fixture
def unpadded(monkeypatch):
    """A switch: `unpadded()` makes every op run at its own shape from then on."""
    return lambda: monkeypatch.setattr(buckets, "size", lambda n: int(n))


def _twice(chip, unpadded, run):
    """run(chip) bucketed, then unpadded, from the same noise-stream position; with the charges."""
    chip.manual_seed(11)
    before = chip.clock.counters
    padded = run(chip)
    charged = chip.clock.counters
    chip.manual_seed(11)
    unpadded()
    exact = run(chip)
    return padded, exact, (before, charged, chip.clock.counters)


def _same_charges(marks):
    before, padded, exact = marks
    a, b = padded.as_dict(), exact.as_dict()
    base = before.as_dict()
    for key in a:
        assert math.isclose(a[key] - base[key], b[key] - a[key], rel_tol=1e-12, abs_tol=1e-30), key


def test_bucket_sizes():
    sizes = [buckets.size(n) for n in range(0, 5000)]
    assert sizes[:6] == [0, 1, 2, 4, 4, 8] and buckets.size(33) == 48 and buckets.size(49) == 64
    assert all(s >= n for n, s in enumerate(sizes)) and sizes == sorted(sizes)
    assert all(s <= 1.5 * n for n, s in enumerate(sizes) if n > 32)
    assert len(set(sizes[1:4097])) <= 2 * 12  # two per doubling


@pytest.mark.parametrize("chip_name", INTEGER_CHIPS)
@pytest.mark.parametrize("k,n", [(384, 384), (700, 10), (600, 300)])
def test_linear_padded_gives_the_unpadded_bits_and_charges(chip_name, k, n, unpadded, monkeypatch):
    chip = sc.Chip.create(chip_name, seed=1)
    res = chip.program(np.asarray(_x((k, n), 1, 0.05)))
    xs = [_x((1, rows, k), rows) for rows in (1, 5, 37, 50, 100)]
    bias, per_row = _x((n,), 2), _x((1, 37, n), 3)

    def run(c):
        return [np.asarray(c.linear(res, x, bias)) for x in xs] + [np.asarray(c.linear(res, xs[2], per_row))]

    with monkeypatch.context() as m:  # padded: the XLA program at each bucket
        m.setattr(crossbar, "direct", lambda *a: False)
        chip.manual_seed(11)
        before = chip.clock.counters
        padded = run(chip)
        charged = chip.clock.counters
    chip.manual_seed(11)
    unpadded()  # each row count as it is: the direct read where the snapshot is packed, else XLA
    exact = run(chip)
    for a, b in zip(padded, exact):
        np.testing.assert_array_equal(a, b)
    _same_charges((before, charged, chip.clock.counters))


def test_ideal_linear_padded_agrees_to_float32_rounding(unpadded):
    """The ideal chip reads float inputs with float32 dots, whose summation order XLA:CPU picks per
    row count: padded rows leave the real ones within float32 rounding, not always bit-identical."""
    chip = sc.Chip.create("ideal")
    w = _x((384, 384), 1, 0.05)
    res = chip.program(np.asarray(w))
    xs = [_x((rows, 384), rows) for rows in (1, 5, 37, 50, 100)]
    padded, exact, marks = _twice(chip, unpadded, lambda c: [np.asarray(c.linear(res, x)) for x in xs])
    for a, b in zip(padded, exact):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())
    _same_charges(marks)


@pytest.mark.parametrize("chip_name", INTEGER_CHIPS)
def test_conv_padded_gives_the_unpadded_bits_and_charges(chip_name, unpadded):
    chip = sc.Chip.create(chip_name, seed=2)
    w = _x((8, 3, 3, 3), 4, 0.2)
    res = chip.program(sc.conv_weight_matrix(np.asarray(w)))
    xs = [_x((batch, 3, 10, 10), batch) for batch in (1, 3, 5)]
    bias = _x((8,), 5)

    def run(c):
        return [np.asarray(c.conv(res, x, w.shape, bias, stride=1, padding=1)) for x in xs]

    padded, exact, marks = _twice(chip, unpadded, run)
    for a, b, x in zip(padded, exact, xs):
        assert a.shape == (x.shape[0], 8, 10, 10)
        np.testing.assert_array_equal(a, b)
    _same_charges(marks)


ENGINE_CALLS = [(op, {}) for op in engine.ELEMENTWISE] + [
    ("softmax", {}), ("softmax", {"axis": 1}), ("log_softmax", {}),
    ("layer_norm", {"eps": 1e-5}), ("layer_norm", {"ndim": 2, "stats": True}), ("rms_norm", {}),
]


@pytest.mark.parametrize("chip_name", ["y1", "ideal"])
@pytest.mark.parametrize("op,kw", ENGINE_CALLS, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_engine_ops_padded_give_the_unpadded_bits_and_charges(chip_name, op, kw, unpadded):
    chip = sc.Chip.create(chip_name)
    xs = [_x((2, rows, 37), rows, 3.0) for rows in (1, 7, 33)]

    def run(c):
        outs = [c.engine(op, x, **kw) for x in xs]
        return [tuple(map(np.asarray, o)) if isinstance(o, tuple) else (np.asarray(o),) for o in outs]

    padded, exact, marks = _twice(chip, unpadded, run)
    for a, b in zip(padded, exact):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)
    _same_charges(marks)


needs_native_engine = pytest.mark.skipif(not host.native_engine(),
                                         reason="the engine's native kernels do not run on this host")


@needs_native_engine
@pytest.mark.parametrize("chip_name", ["y1", "ideal"])
@pytest.mark.parametrize("op,kw", [c for c in ENGINE_CALLS if engine.native(c[0], "fp32")],
                         ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_engine_ops_on_host_arrays_run_directly_with_the_same_bits_and_charges(chip_name, op, kw):
    """Host (NumPy) operands call the native kernel straight (Chip.engine): NumPy results, no
    program at any of 20 row counts, the bits and the charges of the same op on JAX arrays (its
    custom call at the row bucket)."""
    chip = sc.Chip.create(chip_name)
    w = {"weight": np.linspace(0.5, 1.5, 37, dtype=np.float32)} if op in engine.NORMS and "ndim" not in kw else {}
    xs = [_x((rows, 37), rows, 3.0) for rows in range(1, 21)]
    hosts = [np.asarray(x) for x in xs]
    with compiles.record() as log:
        outs, marks = [], [chip.clock.counters]
        for x in hosts:
            outs.append(chip.engine(op, x, **kw, **w))
            marks.append(chip.clock.counters)
    assert not log.programs
    for x, out, c0, c1 in zip(xs, outs, marks, marks[1:]):
        before = chip.clock.counters
        ref = chip.engine(op, x, **kw, **{k: jnp.asarray(v) for k, v in w.items()})
        for got, want in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, ref))):
            assert isinstance(got, np.ndarray)
            np.testing.assert_array_equal(got, np.asarray(want))
        direct = {k: v - c0.as_dict()[k] for k, v in c1.as_dict().items()}
        via_xla = {k: v - before.as_dict()[k] for k, v in chip.clock.counters.as_dict().items()}
        assert direct == pytest.approx(via_xla, rel=1e-12, abs=1e-30)


def test_host_operands_give_host_results_and_jax_ones_jax_results():
    """Chip.linear and Chip.attention hand back what they were given where they run directly: a
    NumPy result for NumPy operands (no JAX array made), a jax.Array for JAX ones; elsewhere
    (XLA's programs) a jax.Array. The same bits either way."""
    chip = sc.Chip.create("y1")
    res = chip.program(np.asarray(_x((64, 32), 1, 0.05)))
    x = _x((5, 64), 2)
    reads = crossbar.direct(chip.snapshot(res), np.asarray(x))
    for a, host_kind in ((np.asarray(x), np.ndarray), (x, jax.Array)):
        assert isinstance(chip.linear(res, a), host_kind if reads else jax.Array)
        q = a.reshape(1, 5, 64)
        attends = chip.attends_directly(q, q, q)
        assert isinstance(chip.attention(q, q, q, scale=0.1), host_kind if attends else jax.Array)
    np.testing.assert_array_equal(chip.manual_seed(3) or chip.linear(res, np.asarray(x)),
                                  chip.manual_seed(3) or np.asarray(chip.linear(res, x)))


@pytest.mark.parametrize("chip_name", ["y1", "ideal"])
def test_batch_norm_padded_gives_the_unpadded_bits(chip_name, unpadded):
    chip = sc.Chip.create(chip_name)
    stats = {"mean": _x((4,), 1), "var": jnp.abs(_x((4,), 2)) + 0.5, "weight": _x((4,), 3), "bias": _x((4,), 4)}
    xs = [_x((n, 4, 5, 5), n) for n in (1, 3, 6)]
    padded, exact, marks = _twice(chip, unpadded, lambda c: [np.asarray(c.engine("batch_norm", x, **stats)) for x in xs])
    for a, b in zip(padded, exact):
        np.testing.assert_array_equal(a, b)
    _same_charges(marks)


@pytest.mark.parametrize("a_shape,b_shape", [((37, 16), (16, 29)), ((2, 3, 37, 16), (2, 3, 16, 29)),
                                             ((3, 5, 16), (16, 9)), ((1, 5, 16), (4, 16, 9))])
def test_engine_matmul_padded_gives_the_unpadded_bits_and_charges(a_shape, b_shape, unpadded):
    chip = sc.Chip.create("y1")
    a, b = _x(a_shape, 1), _x(b_shape, 2)
    padded, exact, marks = _twice(chip, unpadded, lambda c: np.asarray(c.matmul(a, b)))
    assert padded.shape == np.broadcast_shapes(a_shape[:-2], b_shape[:-2]) + (a_shape[-2], b_shape[-1])
    np.testing.assert_array_equal(padded, exact)
    _same_charges(marks)


def test_twenty_row_counts_compile_a_program_per_bucket(unpadded, monkeypatch):
    """20 distinct row counts (5-60) compile one MVM (XLA's read) and one GELU program per bucket;
    unpadded, 20 each."""
    monkeypatch.setattr(crossbar, "direct", lambda *a: False)
    chip = sc.Chip.create("y1")
    res = chip.program(np.asarray(_x((97, 45), 1, 0.05)))  # a shape no other test compiles
    counts = sorted({int(r) for r in np.linspace(5, 60, 20)})
    assert len(counts) == 20
    xs = [_x((rows, 97), rows) for rows in counts]
    with compiles.record() as bucketed:
        for x in xs:
            chip.engine("gelu", chip.linear(res, x))
    sizes = {buckets.size(r) for r in counts}
    assert bucketed.programs["jit(mvm)"] == len(sizes) <= 7
    assert bucketed.programs["jit(op)"] <= len({buckets.size(45 * r) for r in counts}) <= 8  # (some built before)
    unpadded()
    with compiles.record() as exact:
        for x in xs:
            chip.linear(res, x)
    assert exact.programs["jit(mvm)"] == 20 - len(set(counts) & sizes)  # a row count that is a bucket is built


@pytest.mark.skipif(not host.vnni_dots(), reason="reads go direct only to the VNNI kernel's packed "
                    "snapshots, which this host does not use (sidra_core.host.vnni_dots() is False)")
def test_direct_reads_compile_no_program_at_any_row_count():
    """Where the snapshot is packed for the VNNI kernel, an eager read calls the kernel on host
    buffers: no MVM program at any row count, and no padding."""
    chip = sc.Chip.create("y1")
    res = chip.program(np.asarray(_x((97, 45), 1, 0.05)))
    assert chip.snapshot(res).shape.packed
    with compiles.record() as log:
        for rows in range(1, 21):
            y = chip.linear(res, _x((rows, 97), rows))
            assert y.shape == (rows, 45)
    assert "jit(mvm)" not in log.programs


@pytest.mark.parametrize("read", ["direct", "xla"])
def test_a_refused_read_leaves_the_chip_as_it_was(read, monkeypatch):
    """Inputs of another K, or DAC codes wider than the snapshot's int8 weights: a clear error, and
    neither the clock nor the noise stream moves (on the direct read and on XLA's)."""
    if read == "xla":
        monkeypatch.setattr(crossbar, "direct", lambda *a: False)
    chip = sc.Chip.create("y1", seed=2)
    res = chip.program(np.asarray(_x((300, 40), 1, 0.05)))
    chip.linear(res, _x((3, 300), 1))
    counters, op = chip.clock.counters.as_dict(), chip._op_counter
    with pytest.raises(ValueError, match="mvm input has 299 features but the weight has K = 300"):
        chip.linear(res, _x((3, 299), 1))
    monkeypatch.setattr(crossbar, "mvm_kwargs", lambda spec: {"dac_bits": 10, "adc_bits": 8})
    with pytest.raises(ValueError, match="int8 weights for DAC codes of <= 8 bits, got dac_bits=10"):
        chip.linear(res, _x((3, 300), 1))
    assert chip.clock.counters.as_dict() == counters and chip._op_counter == op


def test_a_traced_op_runs_at_its_own_shape():
    """Inside a trace (the bridges' dry runs) shapes are abstract: nothing is padded or compiled."""
    import jax

    chip = sc.Chip.create("int8")
    res = chip.program(np.asarray(_x((16, 8), 1)))
    chip.snapshot(res)  # read before the trace (a snapshot's layout depends on its values)
    out = jax.eval_shape(lambda x: chip.engine("softmax", chip.linear(res, x), axis=0),
                         jax.ShapeDtypeStruct((3, 5, 16), jnp.float32))
    assert out.shape == (3, 5, 8)

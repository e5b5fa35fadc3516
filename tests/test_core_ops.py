"""The device ops' prices (sidra_core.ops): defined once, charged by the chip as the two graph
planners price them."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import sidra_core as sc
from sidra_core import cost, ops

Y1 = sc.preset("y1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("sidra_core", "sidra_torch", "sidra_jax")
# sidra_core.cost's pricing functions; its types and constants may be imported anywhere
PRICING = {"mvm", "conv", "engine", "engine_matmul", "attention", "attention_dims", "memory", "host_transfer",
           "chip_link", "programming"}


def _cost_imports(path: pathlib.Path) -> list[str]:
    """How a source file reaches sidra_core.cost's pricing: each import of the module, of a pricing
    function, or a call through the module (as 'line: what')."""
    tree = ast.parse(path.read_text(), str(path))
    in_core = path.parent.name == "sidra_core"
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name: a.asname or a.name for a in node.names}
            if module in ("sidra_core.cost",) or (in_core and node.level == 1 and module == "cost"):
                found += [f"{node.lineno}: from cost import {n}" for n in names if n in PRICING]
            elif module == "sidra_core" or (in_core and node.level == 1 and not module):
                if "cost" in names:
                    aliases.add(names["cost"])
                    found.append(f"{node.lineno}: imports the cost module")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name == "sidra_core.cost"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr in PRICING:
            found.append(f"{node.lineno}: calls cost.{node.attr}")
    return found


def test_only_the_op_layer_prices_device_ops():
    """No frontend (eager dispatch, the compiler, sidra_jax) and no other core module prices an op
    with sidra_core.cost: they all charge or plan with sidra_core.ops. (The package's __init__
    re-exports the cost module for dry runs.)"""
    allowed = {ROOT / "sidra_core" / "ops.py", ROOT / "sidra_core" / "__init__.py"}
    offenders = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            uses = _cost_imports(path)
            if uses and path not in allowed:
                offenders[str(path.relative_to(ROOT))] = uses
    assert not offenders, f"device ops priced outside sidra_core.ops: {offenders}"
    assert _cost_imports(ROOT / "sidra_core" / "ops.py"), "the scan no longer sees the op layer's own pricing"


def test_the_scan_catches_a_frontend_that_prices_an_op(tmp_path):
    bad = tmp_path / "frontend.py"
    bad.write_text("from sidra_core import cost as c\nfrom sidra_core.cost import engine, Cost\n"
                   "import sidra_core.cost\nx = c.mvm(1, 2, 3, None)\n")
    uses = _cost_imports(bad)
    assert any("engine" in u for u in uses) and any("import sidra_core.cost" in u for u in uses)
    assert any("calls cost.mvm" in u for u in uses) and any("cost module" in u for u in uses)
    fine = tmp_path / "fine.py"
    fine.write_text("from sidra_core.cost import ZERO, Cost\nx = spec.cost.tile_mvm_s + p.cost.memory\n")
    assert _cost_imports(fine) == []


def test_mvm_price_counts_the_tiles_read_and_streams_its_rows():
    p = ops.mvm(10, 768, 300, Y1)
    assert p.where == "crossbar" and p.cost == cost.mvm(10, 768, 300, Y1)
    assert dict(p.counts) == {"mvms": 1, "tile_reads": 10 * 3 * 2}  # 3 x 2 tiles of 256 x 256
    assert p.fixed_s == pytest.approx(2 * Y1.cost.accum_s_per_tile) and p.rows == 10 and not p.barrier


def test_prices_are_immutable_and_memoised():
    p = ops.engine("gelu", 4096, Y1, 16)
    assert ops.engine("gelu", 4096, Y1, 16) is p
    with pytest.raises(TypeError):
        p.counts["engine_ops"] = 5
    assert dict(p.counts) == {"engine_ops": 1} and p.fixed_s == Y1.engine.launch_s and p.rows == 16


def test_engine_matmul_and_attention_prices():
    plain = ops.engine_matmul(4, 8, 16, 32, Y1)
    with_bias = ops.engine_matmul(4, 8, 16, 32, Y1, bias=True)
    assert plain.barrier and plain.rows == 32 and dict(plain.counts) == {"engine_ops": 1}
    assert with_bias.cost == plain.cost + cost.engine("elementwise", 4 * 8 * 32, Y1)
    att = ops.attention_of((2, 3, 10, 16), (2, 3, 12, 16), (2, 3, 12, 8), Y1)
    parts = cost.attention(6, 10, 16, 12, 8, Y1)
    assert att.cost == sum(parts[1:], parts[0]) and dict(att.counts) == {"engine_ops": 4}
    assert att is ops.attention(6, 10, 16, 12, 8, Y1) and att.rows == 60 and att.barrier


def test_fused_op_is_counted_as_its_mvm_and_saves_the_epilogue_round_trips():
    head, act = ops.mvm(64, 256, 512, Y1), ops.engine("gelu", 64 * 512, Y1, 64)
    f = ops.fused([head, act])
    assert f.counts == head.counts and f.where == "crossbar" and (f.fixed_s, f.rows) == (head.fixed_s, head.rows)
    assert f.cost.latency_s == pytest.approx(max(head.cost.latency_s, act.cost.latency_s))
    assert f.cost.memory == pytest.approx(head.cost.memory)
    assert f.cost.engine == pytest.approx(act.cost.engine)


def test_host_prices():
    fb = ops.host_fallback(1000, Y1)
    assert dict(fb.counts) == {"host_transfers": 2, "host_bytes": 1000, "fallback_ops": 1}
    assert fb.cost == cost.host_transfer(1000, Y1, 2) and fb.where == "host"
    assert dict(ops.host_transfer(64, Y1).counts) == {"host_transfers": 1, "host_bytes": 64}
    assert dict(ops.memory(64, Y1, "sram").counts) == {"memory_ops": 1}


def test_chip_charges_the_op_layers_price():
    chip = sc.Chip(spec=Y1, seed=3)
    rng = np.random.default_rng(0)
    res = chip.program(rng.standard_normal((300, 70)).astype(np.float32))
    before = chip.clock.counters
    chip.linear(res, rng.standard_normal((5, 300)).astype(np.float32))
    after = chip.clock.counters
    price = ops.mvm(5, 300, 70, Y1)
    assert after.cost.latency_s - before.cost.latency_s == pytest.approx(price.cost.latency_s)
    assert after.cost.array - before.cost.array == pytest.approx(price.cost.array)
    for name, value in price.counts.items():
        assert getattr(after, name) - getattr(before, name) == value
    assert after.engine_ops == before.engine_ops


# ---------------------------------------------------------------------------
# placement: one rule for the three frontends


def test_a_matmul_with_one_weight_goes_to_the_crossbars_else_to_the_engine():
    from sidra_core import placement

    assert placement.matmul(False, True) == placement.matmul(True, False) == "crossbar"
    assert placement.matmul(False, False) == placement.matmul(True, True) == "engine"


def _sidra_core_names(path) -> set:
    """What a module imports from sidra_core (names and submodules)."""
    tree = ast.parse((ROOT / path).read_text())
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("sidra_core"):
            out |= {n.module.removeprefix("sidra_core").lstrip(".")} | {a.name for a in n.names}
    return out - {""}


def test_torch_compile_is_translated_to_sidra_jax_not_priced_or_rounded_itself():
    """The compiler lowers aten to JAX and hands the graph to sidra_jax's planner and executor:
    of sidra_core it reads only the placement table, none of the pricing or engine modules."""
    for path in sorted((ROOT / "sidra_torch/compiler").glob("*.py")):
        used = _sidra_core_names(path.relative_to(ROOT))
        assert not used & {"ops", "cost", "graph_cost", "engine", "crossbar", "conv"}, (path, used)
    program = (ROOT / "sidra_torch/compiler/program.py").read_text()
    assert "from sidra_jax import plan" in program and "from sidra_jax.execute import executor" in program


_UNIT_TABLES = {"CROSSBAR", "ENGINE", "ELEMENTWISE", "ELEMENTWISE_INPLACE", "MEMORY", "FREE", "NOT_ON_DEVICE",
                "ENGINE_PRIMS", "ENGINE_CALLS", "WEIGHT_VIEWS"}


def test_the_frontends_place_by_one_table():
    """Eager dispatch, torch.compile's lowering and sidra_jax's planner look units up in
    sidra_core.placement; none keeps an op-class table of its own."""
    for path, lookup in (("sidra_torch/dispatch.py", "aten_unit"), ("sidra_torch/compiler/lowering.py", "aten_unit"),
                         ("sidra_jax/plan.py", "jax_unit")):
        tree = ast.parse((ROOT / path).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "sidra_core"
                    for a in n.names}
        calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "placement"}
        assert "placement" in imported and lookup in calls, path
        defined = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        assert not defined & _UNIT_TABLES, (path, defined & _UNIT_TABLES)
    for path in ("sidra_torch/dispatch.py", "sidra_jax/plan.py"):
        assert "matmul" in {n.attr for n in ast.walk(ast.parse((ROOT / path).read_text()))
                            if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "placement"}, path


def test_the_placement_table_names_real_ops_and_eager_has_a_kernel_for_each_unit_op():
    """Every aten name in placement.ATEN is an op of this torch (a typo would silently send it to
    the host), the crossbar and engine ones are exactly the ops eager dispatch has kernels for, and
    every primitive class is one the planner handles."""
    import torch

    from sidra_core import placement
    from sidra_torch import dispatch

    def op_of(name):
        ns, _, rest = name.rpartition("::")
        base, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, ns or "aten"), base), overload or "default")

    missing = []
    for name in placement.ATEN:
        try:
            op_of(name)
        except AttributeError:
            missing.append(name)
    assert not missing
    kernels = {placement.ATEN.get(op.name().removeprefix("aten::")) for op in dispatch.KERNELS}
    assert kernels == {"crossbar", "engine"}
    units = {n for n, u in placement.ATEN.items() if u in ("crossbar", "engine")}
    assert units == {op.name().removeprefix("aten::") for op in dispatch.KERNELS}
    assert set(placement.JAX.values()) == {"free", "memory", "elementwise", "engine"}
    assert {n for n, u in placement.JAX.items() if u == "engine"} == set(placement.JAX_ENGINE)
    assert placement.JAX_WEIGHT_VIEWS <= {n for n, u in placement.JAX.items() if u == "free"}
    assert placement.aten_unit("aten::sort") == placement.jax_unit("sort") == "host"


def test_a_product_of_two_weights_runs_on_the_engine_in_every_frontend():
    """weight @ weight: the engine's MACs from eager PyTorch, torch.compile and sidra_jax alike."""
    import jax.numpy as jnp
    import torch

    import sidra_jax
    import sidra_torch

    a, b = np.random.default_rng(0).standard_normal((2, 16, 16)).astype(np.float32)

    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.from_numpy(a)), torch.nn.Parameter(torch.from_numpy(b))

        def forward(self, x):
            return x + torch.mm(self.a, self.b)

    m = Product().to("sidra:0")
    x = torch.zeros(16, 16).to("sidra:0")
    for run in (m, torch.compile(m, backend="sidra")):
        with torch.no_grad():
            run(x)  # a compiled graph's first call builds it
            before = sidra_torch.counters()
            run(x)
            after = sidra_torch.counters()
        assert after["mvms"] == before["mvms"] and after["fallback_ops"] == before["fallback_ops"]
        assert after["engine_ops"] >= before["engine_ops"] + 2  # the product and the add
    chip = sc.Chip.create("int8", seed=0)
    params = sidra_jax.program({"a": jnp.asarray(a), "b": jnp.asarray(b)}, chip)
    rep = sidra_jax.jit(lambda p: p["a"] @ p["b"]).report(params)
    assert rep.counts.get("mvms", 0) == 0 and rep.counts.get("engine_ops") == 1 and not rep.counts.get("fallback_ops")


# ---------------------------------------------------------------------------
# the engine's storage rounding: one rule


def test_the_frontends_round_engine_results_by_sidra_core_engine_store():
    """No frontend calls the engine's format conversion itself: sidra_jax (and so compiled graphs)
    goes through engine.store; eager PyTorch's torch twin is checked against it below."""
    for package in ("sidra_torch", "sidra_jax"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            assert "round_to(" not in text, path
    assert "engine.store" in (ROOT / "sidra_jax/execute.py").read_text()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_eager_torch_rounds_engine_results_as_engine_store(precision, dtype):
    """dispatch._round_engine (torch ops, on eager's hot path) gives engine.store's bits: overflow
    saturates, inf and NaN pass, subnormals and ties round alike."""
    import jax.numpy as jnp
    import torch

    import sidra_torch
    from sidra_core import engine
    from sidra_torch import dispatch

    rng = np.random.default_rng(0)
    # float32's own subnormals (below 1.2e-38) excepted: XLA:CPU flushes them to zero, torch keeps
    # them (a bf16 engine stores them in its subnormal range)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 7, 4000),
                        [np.inf, -np.inf, np.nan, 7e4, -7e4, 6.6e5, 3e38, 6e-8, -6e-8, 0.0, -0.0]]).astype(np.float32)
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    with sidra_torch.use_chip(sc.preset("int8").replace(name=f"round-{precision}", engine__precision=precision)):
        got = dispatch._round_engine(t).to(torch.float32).numpy()
    want = np.asarray(engine.store(jnp.asarray(t.to(torch.float32).numpy()).astype(dtype), precision)
                      .astype(jnp.float32))
    np.testing.assert_array_equal(got, want)

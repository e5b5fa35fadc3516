"""sidra_core.registry: a weight's crossbar copies, the one registry both bridges use."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
import torch

import sidra_core as sc
from sidra_core import from_int8
from sidra_core.registry import WeightCopies


@pytest.fixture
def chip():
    return sc.Chip.create("int8", seed=1)


def _matrix(seed: int, shape=(300, 40)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_a_copy_is_programmed_once_then_rewritten_when_its_version_moves(chip):
    copies, calls = WeightCopies(), []

    def contents(seed):
        def make():
            calls.append(seed)
            return _matrix(seed)
        return make

    res, done = copies.get(chip, "w", 0, contents(0), name="layer")
    assert done == "programmed" and res.name == "layer" and chip.residents == [res]
    assert copies.get(chip, "w", 0, contents(0)) == (res, None) and calls == [0]  # nothing to write: not asked
    before = res.state.codes.copy()
    again, done = copies.get(chip, "w", 1, contents(1))
    assert again is res and done == "reprogrammed" and calls == [0, 1] and chip.residents == [res]
    want = np.clip(np.rint(_matrix(1) / res.state.scale), -127, 127)  # the new weight in the kept scales
    assert res.version == 1 and np.array_equal(res.state.codes[:300, :40], want) and not np.array_equal(before, res.state.codes)


def test_each_way_and_each_chip_has_its_own_copy(chip):
    other = sc.Chip.create("int8", seed=1)
    copies = WeightCopies()
    a, _ = copies.get(chip, "as is", 0, lambda: _matrix(0))
    b, _ = copies.get(chip, "transposed", 0, lambda: _matrix(0).T.copy())
    c, _ = copies.get(other, "as is", 0, lambda: _matrix(0))
    assert len({id(a), id(b), id(c)}) == 3 and len(copies) == 3
    assert copies.on(chip) and copies.on(other) and not copies.on(sc.Chip.create("int8"))
    assert copies.fresh(chip, "as is", 0) is a and copies.fresh(chip, "as is", 1) is None
    assert copies.held(chip, "as is") and not copies.held(chip, "conv")


def test_a_freed_copy_is_programmed_again_and_freeing_releases_the_tiles(chip):
    copies = WeightCopies()
    res, _ = copies.get(chip, "w", 0, lambda: _matrix(0))
    chip.free(res)
    assert copies.fresh(chip, "w", 0) is None and not copies.held(chip, "w") and copies.residents() == []
    new, done = copies.get(chip, "w", 0, lambda: _matrix(0))
    assert done == "programmed" and new is not res and chip.tiles_in_use > 0
    copies.free()
    assert chip.tiles_in_use == 0 and len(copies) == 0
    copies.get(chip, "w", 0, lambda: _matrix(0))
    del copies
    gc.collect()
    assert chip.tiles_in_use == 0  # the tiles go with the weight


def test_int8_codes_are_written_as_they_are(chip):
    codes = np.random.default_rng(0).integers(-127, 128, (64, 16), dtype=np.int8)
    scale = np.full(16, 0.01, np.float32)
    res, _ = WeightCopies().get(chip, "q", None, lambda: from_int8(codes, scale))
    assert np.array_equal(res.state.codes[:64, :16], codes)


def test_a_copied_or_pickled_weight_is_a_new_weight(chip):
    copies = WeightCopies()
    copies.get(chip, "w", 0, lambda: _matrix(0))
    for clone in (copy.deepcopy(copies), pickle.loads(pickle.dumps(copies))):
        assert isinstance(clone, WeightCopies) and len(clone) == 0
    assert len(copies) == 1


def test_both_bridges_keep_their_weights_copies_here():
    import jax.numpy as jnp

    import sidra_jax
    import sidra_torch

    with sidra_torch.use_chip("int8") as chip:
        lin = torch.nn.Linear(300, 40).to("sidra:0")
        lin(torch.randn(2, 300).to("sidra:0"))
    from sidra_torch.weights import _TABLE

    torch_copies = lin.weight.__dict__[_TABLE]
    params = sidra_jax.program({"w": jnp.asarray(_matrix(0))}, chip, eager=True)
    jax_copies = params["w"].slot.copies
    assert isinstance(torch_copies, WeightCopies) and isinstance(jax_copies, WeightCopies)
    mine = torch_copies.residents() + jax_copies.residents()
    assert len(mine) == 2 and {id(r) for r in mine} <= {id(r) for r in chip.residents}

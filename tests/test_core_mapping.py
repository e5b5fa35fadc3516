"""Tile mapping: grids, padding waste, placement, capacity errors, multi-chip."""

from __future__ import annotations

import math

import pytest

import sidra_core as sc
from sidra_core import ChipCapacityError, chips_needed, map_weights, system_tiles, tile_grid

Y1 = sc.preset("y1")


@pytest.mark.parametrize("k,n", [(1, 1), (256, 256), (257, 256), (300, 700), (768, 3072), (1000, 1), (4096, 255)])
def test_tile_grid(k, n):
    g = tile_grid(k, n, Y1)
    gk, gn = math.ceil(k / 256), math.ceil(n / 256)
    assert (g.grid_k, g.grid_n) == (gk, gn)
    assert g.tiles == gk * gn
    assert (g.k_padded, g.n_padded) == (gk * 256, gn * 256)
    assert g.cells == gk * gn * 256 * 256
    assert g.used_cells == k * n
    assert g.waste == pytest.approx(1 - k * n / (gk * gn * 65536), abs=1e-15)
    assert 0 <= g.waste < 1


def test_tile_grid_exact_values():
    g = tile_grid(300, 700, Y1)
    assert (g.grid_k, g.grid_n, g.tiles) == (2, 3, 6)
    assert (g.k_padded, g.n_padded) == (512, 768)
    assert g.waste == pytest.approx(1 - 210000 / 393216)
    assert tile_grid(512, 512, Y1).waste == 0.0


def test_tile_grid_custom_geometry():
    spec = sc.preset("y1", tile__rows=128, tile__cols=64)
    g = tile_grid(300, 100, spec)
    assert (g.rows, g.cols, g.grid_k, g.grid_n) == (128, 64, 3, 2)
    assert g.waste == pytest.approx(1 - 30000 / (6 * 128 * 64))


@pytest.mark.parametrize("k,n", [(0, 5), (5, 0), (-1, 3)])
def test_tile_grid_rejects_empty(k, n):
    with pytest.raises(ValueError, match="K >= 1 and N >= 1"):
        tile_grid(k, n, Y1)


def test_map_weights_placement_and_utilisation():
    shapes = [(768, 768), (768, 3072), (3072, 768), (300, 10)]
    m = map_weights(shapes, Y1, tiles_in_use=5)
    tiles = [9, 36, 36, 2]
    assert m.tiles == sum(tiles)
    assert m.first_tile == (5, 14, 50, 86)
    assert m.names == ("w0", "w1", "w2", "w3")
    used = 768 * 768 + 2 * 768 * 3072 + 300 * 10
    assert m.utilisation == pytest.approx(used / (sum(tiles) * 65536))
    tab = m.table()
    assert [r["tiles"] for r in tab] == tiles
    assert [r["grid"] for r in tab] == [(3, 3), (3, 12), (12, 3), (2, 1)]
    assert tab[3]["waste"] == pytest.approx(1 - 3000 / (2 * 65536))
    assert all(r["chip"] == 0 for r in tab)


def test_map_weights_named():
    m = map_weights([("q", (512, 512)), ("k", (512, 256))], Y1)
    assert m.names == ("q", "k")
    assert m.first_tile == (0, 4)
    assert m.utilisation == 1.0
    assert [r["name"] for r in m.table()] == ["q", "k"]


def test_map_weights_empty():
    m = map_weights([], Y1)
    assert m.tiles == 0 and m.utilisation == 0.0 and m.chips == 0  # an empty placement touches no chip


def test_capacity_error_message_single_chip():
    spec = sc.preset("y1", tile__tiles_per_chip=10, tile__allow_multi_chip=False)
    with pytest.raises(ChipCapacityError) as ei:
        map_weights([(1024, 1024)], spec, tiles_in_use=3)  # 16 tiles needed, 7 free
    msg = str(ei.value)
    assert "needs 16 crossbar tiles" in msg
    assert "only 7 of the 10 are free" in msg
    assert "3 in use" in msg
    # the fix: allow multi-chip mapping with enough chips (19 tiles -> 2 chips of 10)
    assert "tile__allow_multi_chip=True" in msg and "tile__chips=2" in msg


def test_capacity_error_message_multi_chip_allowed():
    spec = sc.preset("y1", tile__tiles_per_chip=10)  # multi-chip allowed, but a 1-chip system
    assert spec.tile.allow_multi_chip and spec.tile.chips == 1
    with pytest.raises(ChipCapacityError) as ei:
        map_weights([(1024, 1024), (1024, 1024)], spec)  # 32 tiles
    msg = str(ei.value)
    assert "needs 32 crossbar tiles" in msg and "only 10 of the 10 are free" in msg
    assert "tile__chips=4" in msg
    # with the suggested system it fits
    assert map_weights([(1024, 1024), (1024, 1024)], spec.replace(tile__chips=4)).chips == 4


def test_multi_chip_allowed_vs_not():
    shapes = [(1024, 1024), (512, 512)]  # 16 + 4 = 20 tiles
    allowed = sc.preset("y1", tile__tiles_per_chip=10, tile__chips=2, tile__allow_multi_chip=True)
    m = map_weights(shapes, allowed)
    assert m.tiles == 20 and m.chips == 2
    assert [r["chip"] for r in m.table()] == [0, 1]
    # one more tile does not fit on 2 chips; the hint asks for 3
    with pytest.raises(ChipCapacityError) as ei:
        map_weights(shapes + [(1, 1)], allowed)
    msg = str(ei.value)
    assert "needs 21 crossbar tiles" in msg and "only 20 of the 20 are free" in msg
    assert "tile__chips=3" in msg
    # same system with multi-chip forbidden: only one chip's tiles count
    forbidden = allowed.replace(tile__allow_multi_chip=False)
    assert system_tiles(forbidden) == 10
    with pytest.raises(ChipCapacityError, match="tile__allow_multi_chip=True"):
        map_weights(shapes, forbidden)
    assert map_weights([(1024, 512)], forbidden).chips == 1


def test_chips_needed():
    spec = sc.preset("y1", tile__tiles_per_chip=10)
    assert chips_needed([(1, 1)], spec) == 1
    assert chips_needed([], spec) == 1
    assert chips_needed([(256 * 10, 256)], spec) == 1
    assert chips_needed([(256 * 10, 256), (1, 1)], spec) == 2
    assert chips_needed([(1024, 1024)] * 3, spec) == 5  # 48 tiles
    # no capacity check: works beyond the system size
    assert chips_needed([(256 * 1000, 256)], spec) == 100
    # Y1 default: BERT-base linear layers (12 x (4 x 768^2 + 2 x 768 x 3072)) fit on one chip
    bert = [(768, 768)] * 48 + [(768, 3072), (3072, 768)] * 12
    assert chips_needed(bert, Y1) == 1
    assert map_weights(bert, Y1).tiles <= Y1.tile.tiles_per_chip


def test_mapping_chips_counts_offset_placement():
    """Weights placed after `tiles_in_use` that spill onto a second chip: the table and `chips` must agree."""
    spec = sc.preset("y1", tile__tiles_per_chip=4, tile__chips=2)
    m = map_weights([(256, 512)], spec, tiles_in_use=3)  # 2 tiles at 3, 4: chip 0 and chip 1
    used_chips = {(m.first_tile[0] + i) // 4 for i in range(m.tiles)}
    assert used_chips == {0, 1}
    assert m.table()[0]["chip"] == 0
    assert m.chips >= max(used_chips) + 1

"""Graph-mode pricing (sidra_core.graph_cost) against worked examples, each figure computed by hand
in the comments: pipelined chains of row-wise stages, barriers, fused epilogues, graph totals."""

from __future__ import annotations

import pytest

from sidra_core.cost import Cost
from sidra_core.graph_cost import Stage, fused, graph_cost, pipelined_latency

MS, US = 1e-3, 1e-6


def test_three_equal_stages_pipeline_rows():
    # 3 stages of 1 ms over 100 rows: 10 us a row each. Row 1 crosses all three: 30 us; rows 2-100
    # follow at the pace of the slowest stage: 99 x 10 us = 990 us. Total 1.02 ms (eager: 3 ms).
    stages = [Stage(Cost(1 * MS), rows=100)] * 3
    assert pipelined_latency(stages) == pytest.approx(1.02 * MS, rel=1e-12)


def test_fixed_latency_is_paid_once_per_stage_and_the_slowest_stage_sets_the_pace():
    # A: 1 ms with a 0.1 ms fixed part (launch) over 10 rows: 90 us a row; B: 0.5 ms over 10 rows: 50 us.
    # Row 1: 100 + 90 + 50 = 240 us; rows 2-10 at A's pace: 9 x 90 = 810 us. Total 1.05 ms.
    a = Stage(Cost(1 * MS), fixed_s=0.1 * MS, rows=10)
    b = Stage(Cost(0.5 * MS), rows=10)
    assert pipelined_latency([a, b]) == pytest.approx(1.05 * MS, rel=1e-12)
    assert pipelined_latency([b, a]) == pytest.approx(1.05 * MS, rel=1e-12)  # the order does not matter


def test_stages_of_different_row_counts():
    # A: 0.8 ms over 8 rows (100 us a row); B: 0.2 ms over 1 row (a pooled row: 200 us).
    # Row 1: 100 + 200 = 300 us; the rest: max(7 x 100, 0 x 200) = 700 us. Total 1.0 ms.
    assert pipelined_latency([Stage(Cost(0.8 * MS), rows=8), Stage(Cost(0.2 * MS), rows=1)]) == \
        pytest.approx(1.0 * MS, rel=1e-12)


def test_a_barrier_ends_the_chain():
    # Chain 1: 2 x (0.4 ms over 4 rows): 100 + 100 + 3 x 100 = 500 us. The barrier (attention's
    # scores need every row) starts chain 2: itself (0.3 ms, 1 row: 300 us) and 0.4 ms over 4 rows
    # (100 us a row): 300 + 100 + max(0, 300) = 700 us. Total 1.2 ms (eager: 1.5 ms).
    row = Stage(Cost(0.4 * MS), rows=4)
    stages = [row, row, Stage(Cost(0.3 * MS), rows=1, barrier=True), row]
    assert pipelined_latency(stages) == pytest.approx(1.2 * MS, rel=1e-12)
    assert pipelined_latency([]) == 0.0


def test_a_fixed_part_longer_than_the_op_streams_nothing():
    # 50 us of latency, 80 us "fixed": nothing left to stream, so the stage adds its fixed 80 us per chain.
    st = Stage(Cost(50 * US), fixed_s=80 * US, rows=5)
    assert pipelined_latency([st]) == pytest.approx(80 * US, rel=1e-12)


def test_fused_epilogue_streams_beside_the_mvm_and_saves_its_sram_round_trips():
    # An MVM of 2 ms with bias (0.3 ms) and GELU (0.5 ms): the epilogue (0.8 ms) streams beside it: 2 ms.
    mvm = Cost(2 * MS, array=5e-6, adc=2e-6, memory=1e-6)
    bias, gelu = Cost(0.3 * MS, engine=1e-7, memory=4e-7), Cost(0.5 * MS, engine=3e-7, memory=4e-7)
    op = fused([mvm, bias, gelu], saved_io_j=6e-7)
    assert op.latency_s == pytest.approx(2 * MS, rel=1e-12)
    # energies add, less the SRAM traffic saved: memory 1.0 + 0.4 + 0.4 - 0.6 = 1.2 uJ
    assert op.array == pytest.approx(5e-6) and op.adc == pytest.approx(2e-6) and op.engine == pytest.approx(4e-7)
    assert op.memory == pytest.approx(1.2e-6, rel=1e-12)
    # an epilogue longer than the MVM sets the latency: 1 ms MVM, 0.7 + 0.6 ms epilogue -> 1.3 ms
    assert fused([Cost(1 * MS), Cost(0.7 * MS), Cost(0.6 * MS)]).latency_s == pytest.approx(1.3 * MS, rel=1e-12)
    # saved traffic never takes memory energy below zero
    assert fused([Cost(1 * MS, memory=1e-7)], saved_io_j=1e-6).memory == 0.0
    assert fused([]) == Cost()


def test_graph_cost_adds_energies_and_pipelines_latency():
    # Two stages of 1 ms over 10 rows (100 us a row): 100 + 100 + 900 = 1.1 ms; energies add.
    a = Stage(Cost(1 * MS, array=1e-6, engine=2e-6), rows=10)
    b = Stage(Cost(1 * MS, engine=3e-6, memory=1e-6), rows=10)
    g = graph_cost([a, b])
    assert g.latency_s == pytest.approx(1.1 * MS, rel=1e-12)
    assert (g.array, g.engine, g.memory) == pytest.approx((1e-6, 5e-6, 1e-6), rel=1e-12)

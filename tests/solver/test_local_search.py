"""The local search moves one table at a time: it never makes a plan slower, it spreads
memory at an equal step, and what it prices incrementally is what ``evaluate`` says."""

from __future__ import annotations

from dataclasses import replace

import pytest
from gemc.cost_model.types import RegionCost

from gemc.solver.evaluate import Pricer, evaluate
from gemc.solver.greedy import greedy
from gemc.solver.local_search import improve, plan_key
from gemc.solver.naive import naive
from gemc.solver.problem import Assignment, TableChoice
from tests.solver.synth import make_problem


@pytest.mark.parametrize("topology,seed", [("h200:1x8", 0), ("h200:2x4", 1), ("h200:4x8", 2)])
def test_never_worse_than_its_start_and_deterministic(topology, seed):
    p = make_problem(topology, n_tables=12, seed=seed)
    pricer = Pricer(p)
    for start in (greedy(p, pricer), naive(p)):
        before = evaluate(p, start, pricer)
        a = improve(p, pricer, start)
        after = evaluate(p, a, pricer)
        assert plan_key(after) <= plan_key(before)
        assert after.step_s <= before.step_s * (1 + 1e-9)
        assert a.dense == start.dense
        assert improve(p, pricer, start).tables == a.tables  # same inputs, same plan


def test_spreads_tables_piled_on_one_rank():
    """Eight light tables all on rank 0 (a dense region dominates the step): the search
    moves them apart, which lowers both the slowest rank's lookups and its memory."""
    p = make_problem("h200:1x8", n_tables=8, seed=3)
    p = replace(p, regions=(RegionCost("mlp", 10**6, 1e12, 5e-2),))
    start = Assignment(dense={}, tables={t.fqn: TableChoice("table_wise", (0,))
                                         for t in p.tables})
    pricer = Pricer(p)
    before = evaluate(p, start, pricer)
    a = improve(p, pricer, start)
    after = evaluate(p, a, pricer)
    assert after.step_s < before.step_s
    assert after.memory.max() < before.memory.max()
    assert len({r for c in a.tables.values() for r in c.ranks}) > 1


def test_move_budget_is_honoured():
    p = make_problem("h200:1x8", n_tables=8, seed=3)
    start = Assignment(dense={}, tables={t.fqn: TableChoice("table_wise", (0,))
                                         for t in p.tables})
    assert improve(p, Pricer(p), start, max_moves=0).tables == start.tables

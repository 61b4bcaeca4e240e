"""The local search moves one table at a time: it never makes a plan slower, it spreads
memory at an equal step, and what it prices incrementally is what ``evaluate`` says."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gemc.cost_model.types import RegionCost

from gemc.solver.evaluate import Pricer, evaluate
from gemc.solver.greedy import greedy
from gemc.solver.local_search import (
    SEARCH_FULL_WORLD,
    improve,
    move_budget,
    plan_key,
    spread_key,
)
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


def test_spread_key_prefers_even_ranks_at_an_equal_step():
    """What lets single-table moves leave a plateau: at the same step, the plan whose
    ranks carry more even lookup and all-to-all loads ranks lower."""
    p = make_problem("h200:1x4", n_tables=4, seed=0)
    pricer = Pricer(p)
    start = Assignment(dense={}, tables={t.fqn: TableChoice("table_wise", (0,))
                                         for t in p.tables})
    ev = evaluate(p, start, pricer)
    even = replace(ev, sparse=np.full(4, ev.sparse.max()), out=np.full(4, ev.out.max()))
    piled = replace(ev, sparse=np.array([ev.sparse.max()] * 2 + [0.0] * 2),
                    out=np.array([ev.out.max()] * 2 + [0.0] * 2))
    assert spread_key(even, pricer)[:2] == spread_key(piled, pricer)[:2]
    assert spread_key(piled, pricer) < spread_key(even, pricer)  # less load in all
    lopsided = replace(ev, sparse=np.array([4 * ev.sparse.max(), 0.0, 0.0, 0.0]),
                       out=np.array([4 * ev.out.max(), 0.0, 0.0, 0.0]))
    assert spread_key(even, pricer) < spread_key(lopsided, pricer)  # same total, spread


def test_two_phase_search_keeps_the_step_and_is_deterministic_at_scale():
    """A hosts x ranks problem with many tables: both phases (spread, then memory) never
    raise the step, and the move budget scales down beyond SEARCH_FULL_WORLD ranks."""
    p = make_problem("h200:4x8", n_tables=40, seed=5)
    pricer = Pricer(p)
    start = greedy(p, pricer)
    a = improve(p, pricer, start)
    assert plan_key(evaluate(p, a, pricer))[:2] <= plan_key(evaluate(p, start, pricer))[:2]
    assert improve(p, pricer, start).tables == a.tables
    assert move_budget(p) == p.settings.search_moves
    big = make_problem("h200:128x8", n_tables=4, seed=5)
    assert move_budget(big) == big.settings.search_moves * SEARCH_FULL_WORLD // 1024
    assert move_budget(big, 7) == 7

"""The local search's compound move (``local_search._relieve``): the slowest ranks'
one-rank tables moved off together, each to the rank where the plan prices best."""

from __future__ import annotations

import random
from dataclasses import replace

from gemc.solver.evaluate import Pricer, evaluate
from gemc.solver.local_search import improve
from gemc.solver.problem import Assignment, TableChoice
from tests.solver.synth import make_problem


def _stalled():
    """Six tables on four ranks, searched by single moves until they stop: a plan the
    sweep of one-table moves leaves as it is."""
    p = make_problem("h200:1x4", n_tables=6, seed=31)
    pricer = Pricer(p)
    rng = random.Random(31)
    start = Assignment(dense={}, tables={t.fqn: TableChoice("table_wise", (rng.randrange(4),))
                                         for t in p.tables})
    return p, pricer, improve(p, pricer, start, relieve=False)


def test_no_single_move_lowers_the_step_but_moving_two_together_does():
    p, pricer, a = _stalled()
    assert improve(p, pricer, a, relieve=False).tables == a.tables  # single moves: stuck
    step = evaluate(p, a, pricer).step_s
    for fqn, choice in a.tables.items():  # every one-table move to another rank, exactly
        for r in range(p.world):
            moved = replace(a, tables={**a.tables, fqn: replace(choice, ranks=(r,))})
            assert evaluate(p, moved, pricer).step_s >= step
    b = improve(p, pricer, a)
    assert evaluate(p, b, pricer).step_s < step
    assert sum(b.tables[f].ranks != a.tables[f].ranks for f in a.tables) >= 2
    assert improve(p, pricer, a).tables == b.tables  # deterministic

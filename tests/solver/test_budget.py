"""CP-SAT's budget: sized by the tables when none is given (small problems do not pay
for the search the local search already did), the user's when given; the wall-clock
safety net never cuts a short budget (which would make plans differ run to run)."""

from __future__ import annotations

import pytest

from gemc.solver import cpsat
from gemc.solver.planners import run_planner
from gemc.solver.problem import (
    BUDGET_FULL_TABLES,
    BUDGET_MAX_S,
    BUDGET_MIN_S,
    SolverSettings,
    default_budget_s,
)
from tests.solver.synth import make_problem


def test_default_budget_grows_with_the_tables_between_its_bounds():
    assert default_budget_s(26) == BUDGET_MIN_S
    assert default_budget_s(BUDGET_FULL_TABLES // 2) == pytest.approx(BUDGET_MAX_S / 2)
    assert default_budget_s(1040) == BUDGET_MAX_S
    sizes = [default_budget_s(n) for n in range(0, 2000, 37)]
    assert sizes == sorted(sizes)


def test_the_users_limit_wins_over_the_sized_budget():
    p = make_problem("h200:1x8", n_tables=6, settings=SolverSettings())
    assert p.budget_s == BUDGET_MIN_S
    r = run_planner(p, "cpsat")
    assert r.report["time_limit_s"] == BUDGET_MIN_S
    given = make_problem("h200:1x8", n_tables=6, settings=SolverSettings(time_limit_s=0.7))
    assert given.budget_s == 0.7


def test_the_wall_safety_net_has_a_floor():
    s = SolverSettings(time_limit_s=0.25)
    assert cpsat._wall(s, 0.25) == s.wall_limit_min_s  # 6 x 0.25 s would be 1.5 s
    assert cpsat._wall(s, 10.0) == 10.0 * s.wall_limit_factor


def test_default_settings_plan_deterministically():
    """The compile's own settings (sized budget, two interleaved workers, small batches):
    the same inputs give the same plan and report."""
    p = make_problem("h200:2x8", n_tables=30, seed=4, settings=SolverSettings())
    a, b = run_planner(p, "cpsat"), run_planner(p, "cpsat")
    assert a.assignment == b.assignment
    assert a.report == b.report
    assert not any("safety net" in n for n in a.notes)

"""The planners' report stage, typed (issue 20, item 3): a ``PlannerReport`` (with CP-SAT's
``CpsatFigures``) is what a planner returns and what the stages after it extend (the
exchange precision chosen, the table optimizer priced); its ``to_dict`` is the plan's
``solver`` block, with the keys each planner's block has always had."""

from __future__ import annotations

from dataclasses import fields

from gemc.solver.exchange_choice import plan_with_exchange
from gemc.solver.planners import CpsatFigures, PlannerReport, run_planner
from gemc.solver.problem import SolverSettings
from tests.solver.synth import make_problem

FAST = SolverSettings(time_limit_s=0.3, wall_limit_factor=200)
BASE = {"planner", "region_classes", "table_classes", "status", "predicted_step_ms",
        "max_memory_gb", "cap_gb"}


def test_a_heuristic_reports_its_step_and_classes_only():
    problem = make_problem("h200:1x4", n_tables=6, settings=FAST)
    result = run_planner(problem, "greedy")
    summary = result.summary
    assert isinstance(summary, PlannerReport) and summary.cpsat is None
    assert (summary.planner, summary.status) == ("greedy", "heuristic")
    assert summary.predicted_step_ms == round(result.evaluation.step_ms, 6)
    assert set(result.report) == BASE
    # the dict is a view of the typed report, not a second copy to keep in step
    result.report["status"] = "changed"
    assert result.report["status"] == "heuristic"


def test_cpsat_reports_its_figures_as_keys_of_the_block():
    problem = make_problem("h200:1x4", n_tables=6, settings=FAST)
    result = run_planner(problem, "cpsat")
    figures = result.summary.cpsat
    assert isinstance(figures, CpsatFigures)
    assert figures.kept in ("cpsat", "coarse", "greedy", "naive", "cpsat+search",
                            "coarse+search", "greedy+search", "naive+search")
    assert figures.time_limit_s == problem.budget_s and figures.workers == FAST.workers
    block = result.report
    assert set(block) == BASE | {f.name for f in fields(CpsatFigures)}
    assert block["kept"] == figures.kept and block["status"] == result.summary.status


def test_the_exchange_choice_extends_the_report_without_touching_the_planners():
    problem = make_problem("h200:2x4", n_tables=6, settings=FAST)
    plain = run_planner(problem, "greedy")
    fixed = plan_with_exchange(problem, "bf16", "greedy")
    assert fixed.summary.exchange["forward"] == "bf16"
    assert fixed.report["exchange"] == dict(fixed.summary.exchange)
    assert "exchange" not in plain.report and "table_optimizer" not in plain.report

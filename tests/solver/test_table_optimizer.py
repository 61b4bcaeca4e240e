"""The table optimizer is a plan choice: priced by the memory model (state bytes per row),
recorded in the plan, run by the runner; ``auto`` falls back to row-wise Adagrad."""

from __future__ import annotations

import json

import pytest
from gemc.backends.torch.optimizers import resolve_optimizers
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, TableCost
from gemc.passes.parallelize import plan_with_table_optimizer, step_options

from gemc.cli import main
from gemc.plan import TABLE_OPTIMIZERS, load_plan
from gemc.solver.infeasible import PlanInfeasibleError
from gemc.solver.problem import Problem, SolverSettings
from tests.conftest import TOY

MLP = RegionCost("mlp", 10**6, 1e12, 5e-3, activation_bytes=10**9, boundary_bytes=10**7)
SETTINGS = SolverSettings(time_limit_s=1, wall_limit_factor=50)


def _problem(rows: int, opt: str | None) -> Problem:
    tables = tuple(TableCost(f"t{i}", rows, 128, 4096, 4096) for i in range(8))
    return Problem((MLP,), tables, parse_topology("h200:1x8"), options=step_options(opt),
                   settings=SETTINGS)


def test_auto_takes_adam_where_it_fits_else_rowwise_adagrad():
    opt, r = plan_with_table_optimizer(lambda o: _problem(10_000_000, o), "auto", "greedy")
    assert opt == "adam"
    # 8 x 100M rows x 128: Adam's two fp32 moments do not fit on 8 GPUs, one value per row does
    opt, r = plan_with_table_optimizer(lambda o: _problem(100_000_000, o), "auto", "greedy")
    assert opt == "rowwise_adagrad" and r.result.evaluation.feasible
    with pytest.raises(PlanInfeasibleError):
        plan_with_table_optimizer(lambda o: _problem(100_000_000, o), "adam", "greedy")
    with pytest.raises(PlanInfeasibleError):  # too big for either: the error is the last's
        plan_with_table_optimizer(lambda o: _problem(400_000_000, o), "auto", "greedy")


def test_memory_model_prices_the_table_optimizer_per_row():
    """Same plan, three optimizers: the per-rank optimizer bytes differ by what each keeps
    (AdamW/Adam: 2 x 4 B per element; row-wise Adagrad: 4 B per row)."""
    _, adam_p = plan_with_table_optimizer(lambda o: _problem(10_000_000, o), "adam", "naive")
    _, rw_p = plan_with_table_optimizer(lambda o: _problem(10_000_000, o), "rowwise_adagrad",
                                        "naive")
    adam, rw = adam_p.result, rw_p.result
    assert adam.assignment == rw.assignment
    saved = float(adam.evaluation.memory.sum() - rw.evaluation.memory.sum())
    rows = 8 * 10_000_000
    assert saved == pytest.approx(rows * 128 * 8 - rows * 4, rel=1e-6)


@pytest.mark.parametrize("opt", TABLE_OPTIMIZERS)
def test_cli_records_the_choice_and_the_runner_runs_it(tmp_path, opt):
    out = tmp_path / "plan.json"
    assert main(["compile", f"{TOY}:build", "--topology", "h200:1x8", "--out", str(out),
                 "--planner", "greedy", "--table-optimizer", opt]) == 0
    plan = load_plan(out)
    assert plan["optimizer"] == {"embedding": {"kind": opt}}
    assert plan["solver"]["table_optimizer"] == opt
    _, emb = resolve_optimizers(plan.get("optimizer"))
    assert emb.kind == opt
    assert json.loads(out.read_text())["optimizer"]["embedding"]["kind"] == opt


def test_cli_refuses_an_optimizer_the_runner_cannot_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compile", f"{TOY}:build", "--out", str(tmp_path / "p.json"),
              "--table-optimizer", "lamb"])
    assert exc.value.code == 2


@pytest.mark.parametrize("planner", ["greedy", "default"])
def test_without_the_flag_the_plan_prices_and_records_the_runners_default(tmp_path, planner):
    """No --table-optimizer: the step model's default is the runner's, and the plan says
    which one it priced, so the runner runs that one whatever its own default becomes."""
    _, runner_default = resolve_optimizers(None)
    assert step_options(None).table_optimizer == runner_default.kind
    out = tmp_path / "plan.json"
    assert main(["compile", f"{TOY}:build", "--topology", "h200:1x8", "--out", str(out),
                 "--planner", planner]) == 0
    plan = load_plan(out)
    assert plan["optimizer"] == {"embedding": {"kind": runner_default.kind}}
    if planner != "default":
        assert plan["solver"]["table_optimizer"] == runner_default.kind
    _, emb = resolve_optimizers(plan.get("optimizer"))
    assert emb.kind == runner_default.kind

"""Table storage precision chosen with the sharding: priced (weights + state bytes, lookup
bytes), chosen by --table-precision's rule, recorded per table with the reason, and a case
where bf16 / fp8 tables fit a model on fewer GPUs than fp32 tables."""

from __future__ import annotations

import json

import pytest
from gemc.cost_model.memory import table_memory
from gemc.cost_model.op_cost import batched_embedding_time
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost
from gemc.passes.parallelize import step_options

from gemc.cli import main
from gemc.errors import GemcUserError
from gemc.plan import load_plan
from gemc.solver.infeasible import PlanInfeasibleError
from gemc.solver.planners import run_planner
from gemc.solver.precision_choice import plan_with_table_precision, with_precisions
from gemc.solver.problem import Problem, SolverSettings
from tests.conftest import TOY

MLP = RegionCost("mlp", 10**6, 1e12, 5e-3, activation_bytes=10**9, boundary_bytes=10**7)
SETTINGS = SolverSettings(time_limit_s=1, wall_limit_factor=50)
ROWS = 200_000_000  # x 128 x fp32: 102 GB a table (+ 0.8 GB of row-wise Adagrad state)


def _problem(gpus: int) -> Problem:
    """Eight 200M-row tables (rowwise Adagrad) on one host of ``gpus`` H200s. Sizes are real
    (the planners price them, nothing is allocated): fp32 needs 8 GPUs, bf16 4, fp8 2."""
    tables = tuple(TableCost(f"t{i}", ROWS, 128, 4096, 4096) for i in range(8))
    return Problem((MLP,), tables, parse_topology(f"h200:1x{gpus}"),
                   options=step_options("rowwise_adagrad"), settings=SETTINGS)


def test_pricing_per_precision():
    opts = StepOptions(table_optimizer="rowwise_adagrad")
    mem = {p: table_memory(TableCost("t", 1000, 64, 4096, 512, precision=p), 0, 1, opts)
           for p in ("fp32", "bf16", "fp8")}
    assert mem["fp32"].params == 1000 * 64 * 4
    assert mem["bf16"].params == 1000 * 64 * 2
    assert mem["fp8"].params == pytest.approx(1000 * 64 + 1000 * 4)  # + one fp32 scale a row
    assert mem["fp8"].optimizer == mem["fp32"].optimizer == 1000 * 4  # fp32 state: 1 a row
    gpu = parse_topology("h200:1x1").gpu
    fp32 = batched_embedding_time(1000, 64, 4096, 512, "fp32", gpu, None, "rowwise_adagrad")
    bf16 = batched_embedding_time(1000, 64, 4096, 512, "fp32", gpu, None, "rowwise_adagrad",
                                  TableCost("t", 1000, 64, 4096, 512,
                                            precision="bf16").storage_bytes)
    assert bf16 < fp32  # fewer bytes gathered and rewritten
    with pytest.raises(ValueError, match="precision"):
        TableCost("t", 10, 8, 1, 1, precision="int4")


@pytest.mark.parametrize(("mode", "fewest"), [("fp32", 8), ("bf16", 4), ("fp8", 2)])
def test_lower_precision_fits_on_fewer_gpus(mode, fewest):
    chosen = plan_with_table_precision(_problem(fewest), mode, "greedy")
    assert chosen.result.evaluation.feasible
    with pytest.raises(PlanInfeasibleError) as err:
        plan_with_table_precision(_problem(fewest // 2), mode, "greedy")
    assert ("--table-precision auto" in str(err.value)) == (mode == "fp32")
    if mode != "fp32":  # fp32 does not fit here: the plan's tables say so
        assert set(chosen.precision.values()) <= {"bf16", "fp8"} - ({"fp8"} if mode == "bf16"
                                                                     else set())
        assert all("fp32 tables do not fit" in r for r in chosen.reason.values())


def test_auto_lowers_only_the_tables_needed_to_fit():
    problem = _problem(4)
    with pytest.raises(PlanInfeasibleError):
        run_planner(problem, "greedy")  # fp32 does not fit on 4 GPUs
    chosen = plan_with_table_precision(problem, "auto", "greedy")
    lowered = sorted(f for f, p in chosen.precision.items() if p != "fp32")
    assert 0 < len(lowered) < 8 and set(chosen.precision[f] for f in lowered) == {"bf16"}
    assert all(chosen.reason[f].startswith("bf16: needed to fit") for f in lowered)
    assert all(chosen.reason[f].startswith("fp32:") for f in chosen.precision
               if f not in lowered)
    # minimal: one table fewer at bf16 does not fit
    fewer = {f: "bf16" for f in lowered[1:]}
    with pytest.raises(PlanInfeasibleError):
        run_planner(with_precisions(problem, fewer), "greedy")
    # where fp32 fits, auto keeps every table fp32
    full = plan_with_table_precision(_problem(8), "auto", "greedy")
    assert set(full.precision.values()) == {"fp32"}


def test_auto_goes_to_fp8_when_bf16_does_not_fit():
    chosen = plan_with_table_precision(_problem(2), "auto", "greedy")
    assert "fp8" in chosen.precision.values() and "fp32" not in chosen.precision.values()


def test_forced_level_keeps_fp32_unless_lower_is_faster():
    """--table-precision bf16 where fp32 fits: bf16 only if predicted > 1% faster."""
    problem = _problem(8)
    fp32 = run_planner(problem, "greedy").evaluation.step_s
    bf16 = run_planner(with_precisions(problem, dict.fromkeys(
        [t.fqn for t in problem.tables], "bf16")), "greedy").evaluation.step_s
    chosen = plan_with_table_precision(problem, "bf16", "greedy")
    want = "bf16" if bf16 < 0.99 * fp32 else "fp32"
    assert set(chosen.precision.values()) == {want}
    assert "ms" in next(iter(chosen.reason.values()))


def test_cli_records_precision_and_reason_per_table(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["compile", f"{TOY}:build", "--topology", "h200:1x2", "--out", str(out),
                 "--planner", "greedy", "--table-optimizer", "rowwise_adagrad",
                 "--table-precision", "fp8"]) == 0
    plan = load_plan(out)
    for table in plan["tables"]:
        assert table["precision"] in ("fp32", "bf16", "fp8") and table["precision_reason"]
    assert main(["explain", str(out)]) == 0
    assert "stored" in capsys.readouterr().out
    fp32 = tmp_path / "fp32.json"
    assert main(["compile", f"{TOY}:build", "--topology", "h200:1x2", "--out", str(fp32),
                 "--planner", "greedy", "--table-optimizer", "rowwise_adagrad"]) == 0
    capsys.readouterr()
    forced = json.loads(fp32.read_text())
    forced["tables"][0]["precision"] = "bf16"
    lowered = tmp_path / "bf16.json"
    lowered.write_text(json.dumps(forced))
    assert main(["diff", str(fp32), str(lowered)]) == 0
    assert "tables: 1 changed" in capsys.readouterr().out
    plan["tables"][0]["precision"] = "int4"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    with pytest.raises(GemcUserError, match="precision"):
        load_plan(bad)


def test_precision_needs_a_solver_planner(tmp_path):
    code = main(["compile", f"{TOY}:build", "--topology", "h200:1x2",
                 "--out", str(tmp_path / "p.json"), "--planner", "default",
                 "--table-precision", "bf16"])
    assert code == 2

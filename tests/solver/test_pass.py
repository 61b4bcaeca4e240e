"""The parallelize pass in the pipeline: plans of every planner validate, carry the solver's
report, predict what the solver optimised, and compile to the same bytes twice."""

from __future__ import annotations

import json

import pytest
from gemc.cost_model.topology import parse_topology

from gemc.cli import main
from gemc.plan import load_plan
from gemc.replan import annotate, replan
from tests.conftest import REPO, TOY

GEM = f"{REPO}/examples/gem/model.py:build"


@pytest.fixture(scope="module")
def gem_tiny():
    from gemc.api import load_model
    from gemc.capture import capture

    spec = load_model(GEM, {"preset": "tiny"})
    captured = capture(spec, entrypoint=GEM)
    gm, ctx = annotate(captured, parse_topology("h200:2x4"), entrypoint=GEM,
                       args={"preset": "tiny"})
    return gm, ctx, captured


@pytest.fixture(scope="module")
def plans(gem_tiny):
    gm, ctx, captured = gem_tiny
    topo = parse_topology("h200:2x4")
    return {p: replan(gm, ctx, captured, topo, p, {"time_limit_s": 1.0})[0]
            for p in ("naive", "greedy", "cpsat")}


def test_every_planner_writes_a_valid_plan_with_its_report(plans):
    for name, plan in plans.items():
        solver = plan["solver"]
        # CP-SAT keeps a heuristic's plan when it ties or beats its own (a host-bound tiny
        # step prices every placement alike); the plan then names the planner of its plan
        kept = solver.get("kept") if name == "cpsat" else None
        assert plan["planner"] == (kept if kept in ("greedy", "naive") else name)
        assert solver["planner"] == name
        # the plan's prediction (predict_step on the written plan) is what the planner saw,
        # plus the host's exposed syncs (gemc.costing.host_s: the same for every placement)
        pred = plan["predicted"]
        assert pred["step_ms"] - pred["breakdown_ms"]["host"] == pytest.approx(
            solver["predicted_step_ms"], rel=1e-6)
        # and the plan states the device step beside it, so the two figures agree on sight
        assert pred["device_step_ms"] == pytest.approx(solver["predicted_step_ms"], rel=1e-6)
        assert plan["predicted"]["max_memory_gb"] * 1e9 <= 141 * 2**30
        assert all("cost" in t for t in plan["tables"])
    cpsat = plans["cpsat"]["solver"]
    assert cpsat["status"] in ("optimal", "feasible")
    assert cpsat["bound_ms"] <= cpsat["objective_ms"]
    assert plans["cpsat"]["predicted"]["step_ms"] <= \
        plans["greedy"]["predicted"]["step_ms"] * (1 + 1e-9)  # a tie may differ by rounding


def test_cli_compiles_cpsat_by_default_to_identical_bytes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert main(["compile", f"{TOY}:build", "--topology", "h200:2x4", "--out", str(path),
                     "--time-limit", "2", "--quiet"]) == 0
    assert a.read_bytes() == b.read_bytes()
    plan = load_plan(a)
    # CP-SAT ran (the default); on the toy's one table greedy's plan may already be optimal,
    # and a tie keeps it (plan["planner"] then names greedy)
    assert plan["solver"]["planner"] == "cpsat"
    assert plan["solver"]["status"] in ("optimal", "feasible")


def test_explain_and_diff(plans, tmp_path, capsys):
    from gemc.plan import write_plan

    paths = {}
    for name, plan in plans.items():
        paths[name] = tmp_path / f"{name}.json"
        write_plan(paths[name], plan)
    assert main(["explain", str(paths["cpsat"])]) == 0
    out = capsys.readouterr().out
    assert "solver     CP-SAT" in out and "per rank" in out and "shards" in out
    assert "shard ms" in out
    pred = plans["cpsat"]["predicted"]
    assert (f"= device {pred['device_step_ms']:.3f} ms (the planner's objective" in out
            and f"+ host {pred['breakdown_ms']['host']:.3f} ms" in out)
    assert main(["diff", str(paths["naive"]), str(paths["cpsat"])]) == 0
    out = capsys.readouterr().out
    assert "planner: naive -> cpsat" in out
    assert "predicted step:" in out and "why the predicted step differs" in out
    assert "dense strategies" in out and "tables:" in out
    json.loads(paths["cpsat"].read_text())


def test_bad_planner_and_time_limit_are_user_errors(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    with pytest.raises(SystemExit) as exc:
        main(["compile", f"{TOY}:build", "--out", out, "--planner", "magic"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # checked with the arguments, before the compile
        main(["compile", f"{TOY}:build", "--out", out, "--time-limit", "-1", "--quiet"])
    assert exc.value.code == 2
    assert "--time-limit: must be a number > 0" in capsys.readouterr().err


def test_replan_writes_the_plan_a_compile_writes(gem_tiny):
    """One emission for both drivers: the table optimizer and the exchange precision the
    compile's options fix reach a replanned plan and its prediction, as they reach a
    compile's."""
    gm, ctx, captured = gem_tiny
    topo = parse_topology("h200:2x4")
    plan, _ = replan(gm, ctx, captured, topo, "greedy", exchange_precision="bf16",
                     table_optimizer="rowwise_adagrad")
    assert plan["exchange"]["forward"] == "bf16", plan["exchange"]
    assert plan["optimizer"] == {"embedding": {"kind": "rowwise_adagrad"}}
    plain, _ = replan(gm, ctx, captured, topo, "greedy")
    assert plain["exchange"]["forward"] == "fp32"
    assert plan["predicted"]["breakdown_ms"] != plain["predicted"]["breakdown_ms"]


def test_several_ranks_next_to_kernels_are_planned_as_the_runner_executes(plans, gem_tiny):
    """On several ranks the runner's graph mode runs replicated regions only
    (check_graph_mode refuses fsdp/hsdp/tp beside kernels); the planners search only what
    the runner executes (gemc.sharding.runner_executes), so every plan passes that check.
    With the filter off the naive planner's FSDP plan is the one the runner refused."""
    from gemc.backends.torch.graph_mode import check_graph_mode

    from gemc.errors import PlanError
    from gemc.graph_summary import runs_graph_mode
    from gemc.kernel_kinds import graph_kinds

    def check(plan: dict) -> None:
        check_graph_mode([k for k in plan["kernels"] if k["kind"] in graph_kinds()],
                         world_size=plan["mesh"]["world_size"], regions=plan["regions"])

    gm, ctx, captured = gem_tiny
    assert runs_graph_mode(gm)
    for name, plan in plans.items():
        assert {r["strategy"] for r in plan["regions"]} == {"ddp"}, name
        check(plan)
    unfiltered, _ = replan(gm, ctx, captured, parse_topology("h200:2x4"), "naive",
                           {"runner_only": False})
    assert "fsdp" in {r["strategy"] for r in unfiltered["regions"]}
    with pytest.raises(PlanError, match="are not ddp"):
        check(unfiltered)

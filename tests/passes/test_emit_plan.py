"""emit-plan, the pipeline's last pass (issue 20, item 3): it builds the plan of the placed
graph into ``gm.meta[gemc.ir.PLAN]`` and leaves the graph as it is; ``gemc.compile`` and
``gemc.replan`` both end with it, so a replanned plan is the plan a compile writes; its
fields are the compile's options the plan records."""

from __future__ import annotations

import json

import pytest
from gemc.cost_model.topology import parse_topology

from gemc import ir
from gemc.api import compile as gemc_compile
from gemc.api import load_model, resolve_calibration
from gemc.capture import capture
from gemc.config import CompileConfig
from gemc.context import PassContext
from gemc.errors import GemcUserError
from gemc.pipeline import default_pipeline
from gemc.plan_builder import EmitPlan, take_plan
from gemc.replan import annotate, replan
from tests.conftest import TOY
from tests.passes.helpers import run_until

ENTRY = f"{TOY}:build"


def test_the_pipeline_ends_with_emission_carrying_the_compiles_options():
    assert default_pipeline("greedy")[-1] == EmitPlan("greedy")
    assert [p.name for p in default_pipeline()[-2:]] == ["place-default", "emit-plan"]
    config = CompileConfig(planner="cpsat", table_optimizer="adam", exchange_precision="bf16")
    assert config.pipeline()[-1] == EmitPlan("cpsat", "adam", "bf16", predict=True)
    unpriced = CompileConfig(disabled_passes=("predict-time",))
    assert unpriced.pipeline()[-1].predict is False


def test_emission_cannot_be_disabled():
    with pytest.raises(GemcUserError, match="'emit-plan' cannot be disabled") as err:
        CompileConfig(disabled_passes=("emit-plan",)).validate()
    assert "--disable-pass" in str(err.value)


def test_the_pass_leaves_the_graph_and_the_plan_beside_it():
    topo = parse_topology("h200:1x2")
    gm = run_until("place-default", topology=topo)
    before = [(n.name, dict(n.meta.get(ir.PLACEMENT) or {})) for n in gm.graph.nodes]
    ctx = PassContext(entrypoint="toy", fingerprint="f00d", topology=topo)
    out, changed = EmitPlan("default", table_optimizer="adam").run(gm, ctx)
    assert out is gm and not changed
    assert [(n.name, dict(n.meta.get(ir.PLACEMENT) or {})) for n in gm.graph.nodes] == before
    plan = take_plan(gm)
    assert ir.PLAN not in gm.meta  # taken: a graph planned again emits its own
    assert plan["model"]["fingerprint"] == "f00d" and plan["planner"] == "default"
    assert plan["optimizer"] == {"embedding": {"kind": "adam"}}  # the pass's field
    assert plan["predicted"]["step_ms"] > 0
    with pytest.raises(RuntimeError, match="did not end with emit-plan"):
        take_plan(gm)


def test_compile_times_and_dumps_emission_as_its_last_pass(tmp_path):
    gemc_compile(ENTRY, topology="h200:1x2", planner="greedy", dump_dir=tmp_path)
    passes = json.loads((tmp_path / "manifest.json").read_text())["passes"]
    assert [p["name"] for p in passes[-2:]] == ["parallelize", "emit-plan"]
    assert passes[-1]["changed"] is False and passes[-1]["verifier"] == "ok"
    assert (tmp_path / passes[-1]["dump"]).read_text().startswith(
        f"# gemc dump {passes[-1]['index']:03d} pass=emit-plan")


def test_a_replanned_plan_is_the_compiled_plan():
    """One driver: replan runs the compile's last two passes on the annotated graph."""
    compiled = gemc_compile(ENTRY, topology="h200:1x2", planner="greedy")
    captured = capture(load_model(ENTRY), entrypoint=ENTRY)
    topo = parse_topology("h200:1x2")
    gm, ctx = annotate(captured, topo, entrypoint=ENTRY,
                       calibration=resolve_calibration("auto", topo.gpu.name))
    replanned, seconds = replan(gm, ctx, captured, topo, "greedy")
    assert set(seconds) == {"plan", "predict"} and min(seconds.values()) > 0
    assert replanned["model"]["batch_size"] == 4  # the toy's stated batch, from its capture
    # the planner's typed report as the plan's solver block: the optimizer priced beside
    # it; the exchange precision's choice moved to the plan's own block
    assert replanned["solver"]["table_optimizer"] == replanned["optimizer"]["embedding"]["kind"]
    assert "exchange" not in replanned["solver"] and replanned["exchange"]["forward"] == "fp32"
    assert json.dumps(replanned, sort_keys=True) == json.dumps(compiled, sort_keys=True)

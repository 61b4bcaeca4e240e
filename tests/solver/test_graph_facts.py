"""The planner's facts stage (issue 20, item 3): each table and dense region of the graph
is one typed object (``graph_summary.TableFacts`` / ``RegionFacts``) that the solver
prices (``gemc.costing`` -> ``TableCost`` / ``RegionCost``) and the plan records
(``entry()``), read once per emission; before the placement it says table-wise on rank 0
and DDP, after it what the placement chose."""

from __future__ import annotations

import pytest
from gemc.cost_model.topology import parse_topology
from gemc.passes.predict_time import PredictTime
from torch import nn

from gemc import graph_summary, plan_builder
from gemc.capture import capture
from gemc.context import PassContext
from gemc.costing import predicted_block, region_costs, table_costs
from gemc.graph_summary import RegionFacts, TableFacts, graph_facts
from gemc.pass_manager import PassManager
from gemc.plan import validate_plan
from gemc.plan_builder import emit_plan
from gemc.solver.problem import Assignment, DenseChoice, TableChoice, apply_assignment
from gemc.spec import ModelSpec
from tests.passes.helpers import annotated
from tests.passes.recsys_model import Recsys, inputs


@pytest.fixture()
def recsys():
    """Recsys annotated and priced (predict-time) for two ranks, nothing placed yet:
    (graph, context, capture)."""
    return _priced(Recsys)


def _priced(model: type[nn.Module]):  # noqa: ANN202
    batch = inputs()
    spec = ModelSpec(model=model(), example_inputs=batch, make_batch=lambda step, dev: batch)
    captured = capture(spec, entrypoint="test")
    ctx = PassContext(entrypoint="test", param_fqns=captured.param_fqns,
                      param_shapes=captured.param_shapes, param_dtypes=captured.param_dtypes,
                      topology=parse_topology("h200:1x2"), fingerprint=captured.fingerprint)
    gm = PassManager(annotated(PredictTime())).run(captured.gm, ctx)
    return gm, ctx, captured


def test_facts_before_placement_are_the_solvers_starting_point(recsys):
    gm, ctx, _ = recsys
    facts = graph_facts(gm, ctx.param_dtypes)
    bag, emb = facts.tables
    assert [t.fqn for t in facts.tables] == ["bag.weight", "emb.weight"]  # sorted
    assert (bag.rows, bag.dim, bag.nnz, bag.batch, bag.pooling) == (50, 8, 10, 3, "mean")
    assert (emb.nnz, emb.batch, emb.pooling, emb.lookups) == (15, 15, "none", 1)
    for t in facts.tables:  # no placement yet: table-wise on rank 0, the whole table
        assert (t.sharding, t.ranks, t.precision, t.cost) == ("table_wise", (0,), None, None)
        assert [(s["rows"], s["cols"]) for s in t.shards] == [(t.rows, t.dim)]
        assert t.predicted_ms is not None and t.predicted_ms > 0  # priced by predict-time
    assert facts.regions and all(r.strategy == "ddp" and r.shard_group is None
                                 and r.checkpoint is None for r in facts.regions)
    # the tables' weights are not a region's parameters
    assert sum(r.params for r in facts.regions) == sum(
        p.numel() for n, p in Recsys().named_parameters() if n.startswith(("tower", "head")))
    # priced by the solver's bridge: pooling and placement carried over
    costs = {c.fqn: c for c in table_costs(facts.tables)}
    assert costs["bag.weight"].pooled and not costs["emb.weight"].pooled
    assert costs["emb.weight"].ranks == (0,) and costs["emb.weight"].precision == "fp32"


def test_facts_after_placement_carry_the_choice_to_cost_and_plan(recsys):
    gm, ctx, _ = recsys
    regions = [r.name for r in graph_facts(gm, ctx.param_dtypes).regions]
    choice = Assignment(
        dense={regions[0]: DenseChoice("hsdp", shard_group=2, checkpoint=True)},
        tables={"bag.weight": TableChoice("row_wise", (1, 0)),
                "emb.weight": TableChoice("data_parallel", (0, 1))})
    apply_assignment(gm, choice, table_cost={"bag.weight": {"compute_ms": 0.25}})
    facts = graph_facts(gm, ctx.param_dtypes)
    bag, emb = facts.tables
    assert (bag.sharding, bag.ranks, bag.cost) == ("row_wise", (1, 0), {"compute_ms": 0.25})
    assert sum(s["rows"] for s in bag.shards) == 50  # rows split over the two holders
    assert (emb.sharding, emb.ranks, emb.cost) == ("data_parallel", (0, 1), None)
    placed = facts.regions[0]
    assert (placed.strategy, placed.shard_group, placed.checkpoint) == ("hsdp", 2, True)
    assert all(r.strategy == "ddp" for r in facts.regions[1:])
    # the cost model sees the choice ...
    (cost, *_) = region_costs(facts.regions, {})
    assert (cost.strategy, cost.shard_group, cost.checkpoint) == ("hsdp", 2, True)
    tcost = {c.fqn: c for c in table_costs(facts.tables)}
    assert tcost["bag.weight"].ranks == (1, 0) and tcost["emb.weight"].replicated
    # ... and so does the plan: the placement's keys only where it set them
    assert placed.entry()["shard_group"] == 2 and placed.entry()["checkpoint"] is True
    assert "shard_group" not in facts.regions[1].entry()
    assert bag.entry()["cost"] == {"compute_ms": 0.25} and "cost" not in emb.entry()


def test_entries_are_plain_json_with_optional_facts_absent():
    """What the plan writes: lists, not tuples (a plan read back compares equal), and an
    optional fact that is None (or no lookup's live bytes) absent, not null."""
    shard = {"rank": 0, "row_offset": 0, "rows": 4, "col_offset": 0, "cols": 2}
    table = TableFacts(fqn="t", rows=4, dim=2, nnz=3, batch=3, pooling="sum", weighted=False,
                       dtype="float32", lookups=1, predicted_ms=None, sharding="table_wise",
                       shards=(shard,), lookup="batched", padded_nnz=0, padding_row=False,
                       routed=False)
    entry = table.entry()
    assert entry["shards"] == [shard] and isinstance(entry["shards"], list)
    assert not {"cost", "precision", "precision_reason", "route_ms",
                "lookup_alive_bytes"} & set(entry)
    assert entry["predicted_ms"] is None  # the plan states "not priced" as null
    stored = TableFacts(**{**table.__dict__, "precision": "bf16", "precision_reason": "fits",
                           "lookup_alive_bytes": (7, 9), "route_ms": {"sparse": 1.0}}).entry()
    assert (stored["precision"], stored["precision_reason"]) == ("bf16", "fits")
    assert stored["lookup_alive_bytes"] == [7, 9] and stored["route_ms"] == {"sparse": 1.0}
    region = RegionFacts("r", 0, 0, 0, 0, {"gemm": 1}, "ddp", None)
    assert set(region.entry()) == {"name", "params", "param_bytes", "fwd_flops", "fwd_bytes",
                                   "ops", "strategy", "predicted_ms"}


def test_emission_records_and_prices_one_summary(recsys, monkeypatch):
    """emit_plan reads the placed graph's facts once: the plan's tables and regions are
    their entries, and its ``predicted`` block prices those same objects."""
    gm, ctx, _ = recsys
    apply_assignment(gm, Assignment(tables={"bag.weight": TableChoice("table_wise", (1,)),
                                            "emb.weight": TableChoice("table_wise", (0,))}))
    calls = []

    def counted(*args):
        calls.append(args)
        return graph_facts(*args)

    monkeypatch.setattr(graph_summary, "graph_facts", counted)
    monkeypatch.setattr(plan_builder, "graph_facts", counted)
    plan = emit_plan(gm, ctx, "default")
    assert len(calls) == 1
    facts = graph_facts(gm, ctx.param_dtypes)
    assert plan["tables"] == [t.entry() for t in facts.tables]
    assert plan["regions"] == [r.entry() for r in facts.regions]
    assert [s["rank"] for t in plan["tables"] for s in t["shards"]] == [1, 0]
    expected = predicted_block(gm, facts.regions, facts.tables, ctx.topology, None,
                               None)
    assert plan["predicted"]["device_step_ms"] == pytest.approx(expected["device_step_ms"])
    validate_plan(plan, source="test")


class _ComputedTokens(Recsys):
    """Recsys whose plain lookup reads ids the model computes."""

    def forward(self, ids, offsets, tokens, labels):  # noqa: ANN001, ANN201
        return super().forward(ids, offsets, tokens % 30, labels)


@pytest.mark.parametrize("model, fed", [(Recsys, {"bag.weight": True, "emb.weight": True}),
                                        (_ComputedTokens, {"bag.weight": True,
                                                           "emb.weight": False})])
def test_batch_fed_says_whether_the_ids_are_graph_inputs(model, fed):
    """A table looked up once with the batch's own tensors is ``batch_fed`` (a replica
    group member the runner looks up ahead of the compiled graph, priced no launch); ids
    computed in the model are not (its lookup stays in the graph, priced as such)."""
    gm, ctx, _ = _priced(model)
    facts = graph_facts(gm, ctx.param_dtypes)
    assert {t.fqn: t.batch_fed for t in facts.tables} == fed
    assert {c.fqn: c.batch_fed for c in table_costs(facts.tables)} == fed

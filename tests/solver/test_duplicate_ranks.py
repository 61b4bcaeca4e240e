"""A rank holding two shards of one table pays for two (memory, lookups, pooled sends) in
every pricer, and a plan that says so is refused by the validator, as by the runner."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from gemc.cost_model.kernels import SHARD_STEP_FLOOR_S
from gemc.cost_model.memory import table_memory
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost

from gemc.errors import PlanError
from gemc.plan import validate_plan
from gemc.solver.evaluate import evaluate
from gemc.solver.problem import Assignment, Problem, TableChoice, predict

ADAM = StepOptions(table_optimizer="adam")
MLP = RegionCost("mlp", 10**6, 1e12, 5e-3, activation_bytes=10**9, boundary_bytes=10**7)


def _problem() -> Problem:
    # 256 ids a bag: a shard's lookup bytes past the floor of its rank's batched kernel
    # (step_model.batched_floor_s), so two shards' seconds add visibly. Lazy Adam: its
    # column shards run in the owners' batched kernel (gemc.table_lookup.sharded_route;
    # under row-wise Adagrad they take the sparse route)
    return Problem((MLP,), (TableCost("t", 4_000_000, 128, 4096 * 256, 4096),),
                   parse_topology("h200:1x8"), options=ADAM)


def test_two_shards_on_one_rank_cost_twice_one():
    """evaluate (the solver's pricer) and predict_step (the plan's) both charge rank 0
    for the two column shards it holds, and rank 1 for none."""
    sharding = "column_wise"
    p = _problem()
    once = Assignment(tables={"t": TableChoice(sharding, (0, 1, 2, 3))})
    twice = Assignment(tables={"t": TableChoice(sharding, (0, 0, 2, 3))})
    e1, e2 = evaluate(p, once), evaluate(p, twice)
    t = p.tables[0]
    shard = table_memory(replace_ranks(t, sharding, (0, 1, 2, 3)), 0, 8, ADAM).total
    assert e2.memory[0] - e1.memory[0] == pytest.approx(shard, rel=1e-9)
    assert e2.memory[1] == pytest.approx(e1.memory[1] - shard, rel=1e-9)
    assert e1.sparse[0] > SHARD_STEP_FLOOR_S
    assert e2.sparse[0] == pytest.approx(2 * e1.sparse[0])
    assert e2.out[0] == pytest.approx(2 * e1.out[0])
    assert e2.shards[0] == 2 and e2.shards[1] == 0
    # the reference (predict_step) agrees with the solver's evaluate
    ref = predict(p, twice)
    np.testing.assert_allclose([r.memory_bytes for r in ref.per_rank], e2.memory, rtol=1e-9)
    assert ref.per_rank[0].sparse_compute_s == pytest.approx(2 * ref.per_rank[3].sparse_compute_s)


def test_predict_charges_two_row_shards_on_one_rank():
    p = _problem()
    once = predict(p, Assignment(tables={"t": TableChoice("row_wise", (0, 1, 2, 3))}))
    twice = predict(p, Assignment(tables={"t": TableChoice("row_wise", (0, 0, 2, 3))}))
    m1 = [r.memory_bytes for r in once.per_rank]
    m2 = [r.memory_bytes for r in twice.per_rank]
    assert m2[0] - m1[0] == pytest.approx(m1[1] - m2[1]) and m2[0] > m1[0]
    assert once.per_rank[0].sparse_compute_s > SHARD_STEP_FLOOR_S
    assert twice.per_rank[0].sparse_compute_s == pytest.approx(
        2 * once.per_rank[0].sparse_compute_s)


def replace_ranks(t: TableCost, sharding: str, ranks: tuple[int, ...]) -> TableCost:
    from dataclasses import replace

    return replace(t, sharding=sharding, ranks=ranks)


def test_validator_refuses_two_shards_of_a_table_on_one_rank(tmp_path):
    from gemc.cli import main
    from gemc.plan import load_plan
    from tests.conftest import TOY

    out = tmp_path / "plan.json"
    assert main(["compile", f"{TOY}:build", "--topology", "h200:1x4", "--out", str(out),
                 "--planner", "naive"]) == 0
    plan = load_plan(out)
    validate_plan(plan, source="ok")
    bad = copy.deepcopy(plan)
    table = next(t for t in bad["tables"] if len(t["shards"]) >= 1
                 and t["sharding"] != "data_parallel")
    s0 = dict(table["shards"][0])
    half = s0["rows"] // 2
    table["shards"] = [dict(s0, rows=half), dict(s0, row_offset=s0["row_offset"] + half,
                                               rows=s0["rows"] - half)]
    table["sharding"] = "row_wise"
    with pytest.raises(PlanError, match="at most one per rank"):
        validate_plan(bad, source="bad")

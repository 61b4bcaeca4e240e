"""parallelize, intent on a small graph (the planner's choices themselves are the solver
tests'): it writes ``gemc.placement`` where place-default does (tables: sharding and ranks,
now with their storage precision and why; dense compute: a strategy; views: nothing) and the
planner's report on the graph; a table that cannot fit one GPU is spread over the ranks; one
that no plan can fit is a user error naming it; a bad solver option is a user error.

The planners (optimality against brute force, budgets, balance, infeasibility) are tested
in tests/solver/; the pass in the full pipeline on GEM tiny, every planner, CLI and replan:
tests/solver/test_pass.py."""

from __future__ import annotations

import pytest
import torch
from gemc.passes.parallelize import EXCHANGE_META, SOLVER_META, TABLE_OPTIMIZER_META, Parallelize
from gemc.passes.predict_time import PredictTime
from torch import nn

from gemc import ir
from gemc.config import CompileConfig
from gemc.errors import GemcUserError
from gemc.solver.problem import SolverSettings
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of


class _Tables(nn.Module):
    def __init__(self, big_rows: int) -> None:
        super().__init__()
        self.small = nn.EmbeddingBag(1000, 64, mode="sum")
        self.big = nn.EmbeddingBag(big_rows, 64, mode="sum")
        self.fc = nn.Linear(128, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = torch.cat([self.small(ids, offsets), self.big(ids, offsets)], 1)
        return self.fc(pooled).sum()


def _planned(big_rows: int, planner: str = "greedy"):
    with torch.device("meta"):  # the big table is ~150 GB: never allocated
        model = _Tables(big_rows)
    return graph_of(model, (torch.zeros(64, dtype=torch.long), torch.arange(0, 64, 4)),
                    annotated(PredictTime(), Parallelize(planner, SolverSettings(time_limit_s=2.0))),
                    topology="h200:1x2")


@pytest.mark.parametrize("planner", ["greedy", "cpsat"])
def test_placements_where_place_default_writes_them_and_the_report(planner: str):
    # 600M rows x 64 fp32 = 154 GB: more than one H200 holds, so it spans both ranks
    gm, _ = _planned(600_000_000, planner)
    check_graph(gm, """
        CHECK: aten.embedding_bag.padding_idx(%p_small_weight
        CHECK-SAME: placement={sharding:
        CHECK-SAME: precision:fp32,
        CHECK-NEXT: getitem(
        CHECK-NOT: placement=
        CHECK: aten.embedding_bag.padding_idx(%p_big_weight
        CHECK-SAME: placement={sharding:
        CHECK: %cat = aten.cat.default(
        CHECK-SAME: placement={strategy:
        CHECK-NEXT: aten.linear.default(
        CHECK-SAME: placement={strategy:
    """)
    tables = {n.meta[ir.TABLE]["fqn"]: n.meta[ir.PLACEMENT] for n in gm.graph.nodes
              if ir.TABLE in n.meta}
    big = tables["big.weight"]
    assert big["sharding"] != "table_wise" and len(set(big["ranks"])) == 2, big
    assert all(set(p["ranks"]) <= {0, 1} and p["precision_reason"] for p in tables.values())
    assert gm.meta[SOLVER_META].planner == planner
    assert gm.meta[TABLE_OPTIMIZER_META] == "rowwise_adagrad"
    assert EXCHANGE_META in gm.meta


def test_a_table_no_plan_can_hold_is_a_user_error_naming_it():
    # 2.4B rows x 64 fp32 = 614 GB: more than both H200s together
    with pytest.raises(GemcUserError) as info:
        _planned(2_400_000_000)
    assert "big.weight" in str(info.value), str(info.value)


def test_a_bad_solver_option_is_a_user_error_before_capture():
    """The pass takes typed settings; the user's mapping is checked when the driver builds
    the pipeline (CompileConfig.validate, before any capture)."""
    with pytest.raises(GemcUserError, match="unknown solver option"):
        CompileConfig(planner="greedy", solver={"time_limit": 1}).validate()
    placement = CompileConfig(planner="greedy", solver={"time_limit_s": 3.0},
                              table_precision="auto").pipeline()[-2]
    assert placement == Parallelize("greedy", SolverSettings(time_limit_s=3.0),
                                    table_precision="auto")

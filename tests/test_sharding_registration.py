"""A table sharding type registered from outside gemc (here, this file) flows through every
layer from its one ``Sharding`` object (gemc.sharding): the solver offers and prices its
candidates, picks it where it is the fastest, the plan builder writes its shards, the
plan validator accepts it, and the cost model prices the plan with it.

The toy type splits a table's columns over every rank, which no built-in type does
(``column_wise`` stops at 16 distinct ranks): on 4 hosts of 8 GPUs a 256-wide table too
large for 16 ranks then has two placements that fit, row-wise over 32 ranks and the toy's
32 column shards, whose pooled exchange carries 1/32 of the bytes row-wise's partials
would, 1/4 of what they carry summed in each host of 8 before they cross (s22); at 4 ids
a bag the toy's smaller exchange still outweighs its column pieces' lookups of every id.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, TableCost
from torch import nn

import gemc
from gemc.errors import GemcUserError
from gemc.plan import load_plan, validate_plan, write_plan
from gemc.sharding import Sharding, register, unregister
from gemc.solver.candidates import table_options
from gemc.solver.planners import run_planner
from gemc.solver.problem import Problem, SolverSettings

ENTRY = f"{__file__}:build"
BATCH, IDS, ROWS, DIM = 8192, 8192 * 4, 2_400_000_000, 256  # 2.5 TB of fp32 rows
TOPOLOGY = "h200:4x8"  # 32 ranks: more than the built-in column split reaches (16)
SPREAD = Sharding("spread_columns", "columns", "every_rank")


class Wide(nn.Module):
    """One table too large for 16 GPUs (built on meta: gemc compiles without its weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum", include_last_offset=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.table(ids, offsets)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, labels)


def build() -> object:
    from gemc.spec import ModelSpec

    def batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(step)
        return (torch.randint(0, ROWS, (IDS,), generator=gen).to(device),
                torch.arange(0, IDS + 1, IDS // BATCH).to(device),
                torch.randint(0, 2, (BATCH,), generator=gen).float().to(device))

    example = (torch.zeros(IDS, dtype=torch.long), torch.arange(0, IDS + 1, IDS // BATCH),
               torch.zeros(BATCH))
    return ModelSpec(model=Wide(), example_inputs=example, make_batch=batch)


@pytest.fixture
def spread():
    register(SPREAD)
    try:
        yield SPREAD
    finally:
        unregister(SPREAD.name)


def _problem() -> Problem:
    region = RegionCost("", params=DIM + 1, fwd_flops=1e9, compute_s=1e-3,
                        activation_bytes=10**8, boundary_bytes=10**6)
    table = TableCost("table", rows=ROWS, dim=DIM, nnz=IDS, batch=BATCH)
    return Problem((region,), (table,), parse_topology(TOPOLOGY),
                   settings=SolverSettings(time_limit_s=0.5))


def test_the_solver_offers_prices_and_picks_a_registered_type(spread) -> None:
    problem = _problem()
    options = {o.label: o for o in table_options(problem, problem.tables[0])}
    # what fits: 32 shards, either way (16 ranks' shards would not)
    assert sorted(options) == ["row_wise", "spread_columns/32"]
    toy, rows = options["spread_columns/32"], options["row_wise"]
    assert (toy.ranks, toy.uniform, toy.replicated) == (32, True, False)
    # the same share of the weights, but a column shard keeps every row's optimizer state
    # (row-wise Adagrad: one value per row) where a row shard keeps 1/32 of them
    assert rows.memory < toy.memory <= problem.cap_bytes
    # 8 columns of 256 back, against row-wise's partials summed by the 8 owners of a host
    assert toy.out_bytes == pytest.approx(rows.out_bytes * 8 / 32)
    # both run (and are priced) in their owners' batched kernel (gemc.table_lookup.
    # sharded_route): a column split under row-wise Adagrad in two phases, its squares
    # all-reduced over the column group (step_model.column_squares_s)
    assert toy.in_kernel and rows.in_kernel
    assert toy.compute_s > toy.kernel_s  # the all-reduce, outside the kernel
    from gemc.solver.evaluate import evaluate
    from gemc.solver.problem import Assignment, TableChoice

    steps = {o.sharding: evaluate(problem, Assignment(tables={"table": TableChoice(
        o.sharding, tuple(range(o.ranks)))})).step_s for o in (toy, rows)}
    chosen = run_planner(problem, "cpsat").assignment.tables["table"]
    assert chosen.sharding == min(steps, key=steps.get) == "spread_columns"
    assert chosen.ranks == tuple(range(32))


def test_without_it_the_solver_keeps_the_built_in_types() -> None:
    problem = _problem()
    assert [o.label for o in table_options(problem, problem.tables[0])] == ["row_wise"]
    assert run_planner(problem, "greedy").assignment.tables["table"].sharding == "row_wise"


def test_a_compile_plans_it_and_the_plan_carries_its_shards(spread, tmp_path) -> None:
    plan = gemc.compile(ENTRY, topology=TOPOLOGY, planner="cpsat",
                         solver={"time_limit_s": 0.5})
    (table,) = plan["tables"]
    assert table["sharding"] == "spread_columns"
    # the plan builder cut the shards through the type: 32 column ranges on every rank
    assert [(s["rank"], s["col_offset"], s["cols"], s["rows"]) for s in table["shards"]] == [
        (r, 8 * r, 8, ROWS) for r in range(32)]
    # the cost model priced it: each rank holds 1/32 of the table
    assert plan["predicted"]["max_memory_gb"] * 1e9 >= ROWS * DIM * 4 / 32
    path = tmp_path / "plan.json"
    write_plan(path, plan)
    assert load_plan(path)["tables"][0]["sharding"] == "spread_columns"  # validated
    # once the type is gone, the same plan is refused by name
    unregister(SPREAD.name)
    try:
        with pytest.raises(GemcUserError, match="'spread_columns', not one of"):
            validate_plan(plan)
    finally:
        register(SPREAD)

"""Problems no plan fits end in PlanInfeasibleError (a GemcUserError: exit 2) naming the
binding constraint (which rank, which tables, how many GB over) and the fixes."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, TableCost

from gemc.errors import GemcUserError
from gemc.solver.infeasible import PlanInfeasibleError, batch_flag, violation
from gemc.solver.planners import run_planner
from gemc.solver.problem import Problem, SolverSettings
from tests.solver.synth import ADAMW_TABLES

MLP = RegionCost("mlp", 10**6, 1e12, 5e-3, activation_bytes=10**9, boundary_bytes=10**7)
SETTINGS = SolverSettings(time_limit_s=5, wall_limit_factor=50)


def problem(topology: str, regions, tables) -> Problem:
    return Problem(tuple(regions), tuple(tables), parse_topology(topology), settings=SETTINGS,
                   options=ADAMW_TABLES)


@pytest.mark.parametrize("planner", ["naive", "greedy", "cpsat"])
def test_dense_part_too_large(planner):
    blocks = [RegionCost(f"blocks.{i}", 10**8, 1e14, 1e-1, activation_bytes=1000 * 10**9,
                         boundary_bytes=10**9) for i in range(2)]
    p = problem("h200:1x8", blocks, [TableCost("t", 1000, 64, 100, 100)])
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(p, planner)
    text = str(err.value)
    assert isinstance(err.value, GemcUserError)
    assert "dense part alone" in text and "GB" in text and "'blocks.0'" in text
    assert "smaller batch" in text and "activation checkpointing" in text
    assert "more GPUs do not help" in text


def test_tables_too_large_on_average_names_how_many_gpus():
    tables = [TableCost(f"t{i}", 60_000_000, 128, 4096, 4096) for i in range(8)]
    p = problem("h200:1x4", [MLP], tables)
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(p, "cpsat")
    text = str(err.value)
    assert "tables need at least" in text and "over the" in text
    assert "more GPUs" in text and "--topology h200:" in text


def test_one_table_larger_than_any_shard_can_hold():
    p = problem("h200:1x1", [MLP], [TableCost("huge", 200_000_000, 128, 4096, 4096)])
    with pytest.raises(PlanInfeasibleError, match="table huge does not fit"):
        run_planner(p, "greedy")


def test_packing_infeasible_is_proven_by_cpsat_and_names_the_rank():
    """Three tables whose shards fit on average but never together: pooled outputs of a
    huge batch make every sharding heavy (dim 127: no column split)."""
    tables = [TableCost(f"t{i}", 18_400_000 + i, 127, 27_500_000, 27_500_000) for i in range(3)]
    p = problem("h200:1x2", [MLP], tables)
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(p, "cpsat")
    text = str(err.value)
    assert "CP-SAT proved that no assignment fits" in text
    assert "rank " in text and "GB over" in text and re.search(r"its tables: t\d \(", text)
    assert "more GPUs" in text


def _suggested_hosts(text: str) -> int:
    m = re.search(r"--topology h200:(\d+)x(\d+)", text)
    assert m, text
    return int(m.group(1))


def test_suggested_topology_is_checked_to_fit_and_is_the_smallest():
    """The fix's size passes the same floor and a heuristic plan fits there; one host
    fewer does not pass the floor (or is the size tried)."""
    tables = [TableCost(f"t{i}", 60_000_000, 128, 4096, 4096) for i in range(8)]
    p = problem("h200:1x4", [MLP], tables)
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(p, "greedy")
    text = str(err.value)
    hosts = _suggested_hosts(text)
    assert "checked: a heuristic plan fits there" in text
    bigger = replace(p, topology=parse_topology(f"h200:{hosts}x4"))
    assert violation(bigger) is None
    run_planner(bigger, "greedy")  # no PlanInfeasibleError: the suggestion is true
    if hosts > 2:
        assert violation(replace(p, topology=parse_topology(f"h200:{hosts - 2}x4"))) is not None


def test_fix_names_the_entrypoints_own_batch_parameter(tmp_path):
    own = tmp_path / "own.py"
    own.write_text("def build(preset='x', local_batch: int = 8):\n    pass\n")
    none = tmp_path / "none.py"
    none.write_text("def build(preset='x', seed=0):\n    pass\n")
    assert batch_flag(f"{own}:build") == "--set local_batch=..."
    assert batch_flag(f"{none}:build") is None
    blocks = [RegionCost(f"blocks.{i}", 10**8, 1e14, 1e-1, activation_bytes=1000 * 10**9,
                         boundary_bytes=10**9) for i in range(2)]
    for entry, expect in ((f"{own}:build", "--set local_batch=..."),
                          (f"{none}:build", "takes no batch parameter")):
        p = replace(problem("h200:1x8", blocks, [TableCost("t", 1000, 64, 100, 100)]),
                    entrypoint=entry)
        with pytest.raises(PlanInfeasibleError) as err:
            run_planner(p, "greedy")
        text = str(err.value)
        assert expect in text and "batch_size" not in text
        # --precision changes GEMM precision only: no fix may promise it halves state bytes
        assert "precision" not in text


def test_rowwise_adagrad_is_suggested_only_when_it_fits():
    """AdamW tables 2x over what fits: row-wise Adagrad (1 value per row) does fit."""
    tables = [TableCost(f"t{i}", 100_000_000, 128, 4096, 4096) for i in range(8)]
    p = problem("h200:1x8", [MLP], tables)
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(p, "greedy")
    assert "--table-optimizer rowwise_adagrad" in str(err.value)
    lean = replace(p, options=replace(p.options, table_optimizer="rowwise_adagrad"))
    run_planner(lean, "greedy")  # fits
    huge = [TableCost(f"t{i}", 300_000_000, 128, 4096, 4096) for i in range(8)]
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(problem("h200:1x8", [MLP], huge), "greedy")
    assert "--table-optimizer" not in str(err.value)


@pytest.mark.parametrize("planner", ["greedy", "cpsat"])
def test_lookup_gradients_that_fit_no_rank_are_refused_before_solving(planner):
    """Sparse lookups hold a gradient row per id the rank's batch looks up, whatever the
    sharding: 8 tables x 40M ids a rank x 516 B is 165 GB a rank at any GPU count (data
    parallel, whose gradient is dense, costs 41 GB a table). The steady-state floors do
    not see it; the gradients' floor refuses the problem before any planner runs, names the
    term, and does not offer more GPUs (they do not help). Looked up twice a step, the
    tables stay on the sparse route at every sharding (gemc.table_lookup.sharded_route)."""
    tables = [TableCost(f"t{i}", 20_000_000, 128, 40_000_000, 4096, lookup="sparse",
                        lookups=2) for i in range(8)]
    p = problem("h200:1x4", [MLP], tables)
    assert violation(p) == "gradients"
    with pytest.raises(PlanInfeasibleError) as err:
        run_planner(p, planner)
    text = str(err.value)
    assert "at the end of the backward" in text and "lookups' gradients" in text
    assert "more GPUs do not help" in text and "smaller batch" in text
    # looked up once, their owners' batched kernel holds no gradient (48 B a received id
    # of sort buffers): they fit
    batched = replace(p, tables=tuple(replace(t, lookups=1) for t in tables))
    assert violation(batched) is None

"""The planners' contracts: memory caps hold in every plan, CP-SAT is never worse than
greedy, greedy and naive do what they say, CP-SAT is reproducible."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gemc.solver.evaluate import evaluate
from gemc.solver.infeasible import PlanInfeasibleError
from gemc.solver.naive import naive
from gemc.solver.planners import run_planner
from gemc.solver.problem import SolverSettings, predict
from tests.solver.synth import make_problem

FAST = SolverSettings(time_limit_s=0.3, wall_limit_factor=200)


@pytest.mark.parametrize("planner", ["naive", "greedy", "cpsat"])
@pytest.mark.parametrize(("topology", "seed"), [("h200:1x4", 0), ("h200:1x8", 1),
                                                ("h200:2x4", 2)])
def test_memory_cap_holds_in_every_plan(planner, topology, seed):
    """A cap between the average and the fullest rank of the naive plan: it binds."""
    loose = make_problem(topology, n_tables=10, seed=seed, big=8.0, settings=FAST)
    mem = evaluate(loose, naive(loose)).memory
    cap = (mem.mean() + mem.max()) / 2
    gpu = loose.topology.gpu
    reserve = (gpu.usable_hbm_bytes - cap) / gpu.hbm_bytes
    p = replace(loose, settings=replace(FAST, memory_reserve=reserve))
    assert p.cap_bytes == pytest.approx(cap) and mem.max() > p.cap_bytes
    try:
        r = run_planner(p, planner)
    except PlanInfeasibleError as exc:  # refusing is allowed; exceeding the cap is not
        assert planner != "cpsat" and "GB over" in str(exc) and "fix:" in str(exc)
        return
    assert r.evaluation.memory.max() <= p.cap_bytes
    assert max(s.memory_bytes for s in predict(p, r.assignment).per_rank) <= p.cap_bytes


@pytest.mark.parametrize(("topology", "seed"), [("h200:1x8", 0), ("h200:4x8", 3)])
def test_cpsat_never_worse_than_greedy(topology, seed):
    p = make_problem(topology, n_tables=12, seed=seed, settings=FAST)
    greedy = run_planner(p, "greedy").evaluation.step_s
    cpsat = run_planner(p, "cpsat")
    assert cpsat.evaluation.step_s <= greedy
    assert cpsat.report["greedy_step_ms"] == pytest.approx(1e3 * greedy)
    bound = cpsat.report["bound_ms"]
    assert bound is not None and bound <= cpsat.report["objective_ms"] + 1e-9


def test_cpsat_is_deterministic_under_a_deterministic_time_limit():
    """A search cut by its deterministic budget (not solved to optimality) twice."""
    settings = SolverSettings(time_limit_s=0.3, gap_limit=0.0, wall_limit_factor=200)
    p = make_problem("h200:2x4", n_tables=40, seed=11, settings=settings)
    a, b = run_planner(p, "cpsat"), run_planner(p, "cpsat")
    assert a.report["status"] == "feasible"  # cut by the budget, not proven optimal
    assert a.report == b.report
    assert a.assignment == b.assignment


def test_naive_is_fsdp_and_round_robin():
    p = make_problem("h200:1x4", n_tables=6, seed=0)
    r = run_planner(p, "naive")
    dense = r.assignment.dense
    assert {c.strategy for n, c in dense.items() if next(x for x in p.regions
                                                       if x.name == n).params} == {"fsdp"}
    ranks = [r.assignment.tables[t.fqn] for t in p.tables]
    assert [c.sharding for c in ranks] == ["table_wise"] * 6
    assert [c.ranks[0] for c in ranks] == [0, 1, 2, 3, 0, 1]


def test_greedy_places_largest_first_on_the_least_loaded_rank():
    p = make_problem("h200:1x4", n_tables=8, seed=4)
    r = run_planner(p, "greedy")
    # dense parts stay DDP while memory allows (TorchRec leaves them to DDP)
    assert {c.strategy for c in r.assignment.dense.values()} == {"ddp"}
    # the largest table takes the first rank (all are empty), the next an empty rank
    by_size = sorted(p.tables, key=lambda t: (-t.rows * t.dim * t.dtype_bytes, t.fqn))
    first, second = (r.assignment.tables[t.fqn] for t in by_size[:2])
    if first.sharding == second.sharding == "table_wise":
        assert first.ranks == (0,) and second.ranks != first.ranks


def test_greedy_shards_a_table_too_large_for_one_gpu():
    p = make_problem("h200:1x4", n_tables=4, seed=5)
    huge = replace(p.tables[0], rows=150_000_000, dim=128)  # 230 GB with its Adam state
    p = replace(p, tables=(huge, *p.tables[1:]))
    r = run_planner(p, "greedy")
    assert r.assignment.tables[huge.fqn].sharding != "table_wise"
    assert r.evaluation.memory.max() <= p.cap_bytes


@pytest.mark.parametrize("planner", ["naive", "greedy", "cpsat"])
def test_a_table_only_a_replica_runs_right_plans_on_one_gpu(planner):
    """A table read outside its lookups (a tied output projection) may only be a full
    replica. On one GPU data_parallel has no candidate; every planner crashed with
    ``min() arg is an empty sequence`` (CP-SAT and greedy through ``table_options``), where
    the table on its one rank *is* the replica."""
    base = make_problem("h200:1x1", n_tables=3, settings=FAST)
    tied = replace(base.tables[0], replicated_only=True)
    p = replace(base, tables=(tied, *base.tables[1:]))
    r = run_planner(p, planner)
    assert r.assignment.tables[tied.fqn].ranks == (0,)

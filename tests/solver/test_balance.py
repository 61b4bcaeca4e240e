"""Memory balance: CP-SAT's lexicographic second objective (``balance_share``, off by
default since the local search polishes the balance of every plan) never costs step; the
local balance search (``local_search.balance``) reaches the 1.3x bound on a small set,
and the planner keeps its plan only within ``balance_tolerance`` of the step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gemc.solver.evaluate import Pricer, dense_sums, evaluate
from gemc.solver.greedy import greedy
from gemc.solver.local_search import balance, cap_memory, improve, mean_floor
from gemc.solver.planners import run_planner
from gemc.solver.problem import SolverSettings
from tests.solver.synth import make_problem


def test_balancing_never_slows_the_step_and_lowers_the_fullest_rank():
    """16 tables on 8 ranks: without the second solve the fullest rank holds 63 GB
    (mean 36); with it 47 GB, at the same step (measured: 21.232 -> 21.231 ms, before the
    local search polished both). The step held is the model's: the local search then
    polishes the two expanded plans from different places, so the final steps may differ
    by a hair either way (21.3569 vs 21.3583 ms since the search's spread phase). The cap
    search (``balance_ratio``) and the balance search (``balance_tolerance``) are off
    here: they trade step on their own terms (below). Since a rank's batched kernel has a
    floor (issue 19) every rank's lookup here sits at it, and the balance search traded
    1.5% of step (within its 2%) for 45.9 -> 35.9 GB on one of the two plans only.
    Measured with the floor (h200 model, CPU): 47.4 GB off, 45.9 GB on, both 21.4621 ms."""
    settings = SolverSettings(time_limit_s=2, wall_limit_factor=100, gap_limit=0.0,
                              balance_share=0.2, balance_ratio=0.0, balance_tolerance=0.0)
    p = make_problem("h200:2x4", n_tables=16, seed=1, big=4.0, settings=settings)
    off = run_planner(replace(p, settings=replace(settings, balance_share=0.0)), "cpsat")
    on = run_planner(p, "cpsat")
    assert on.report["objective_ms"] == off.report["objective_ms"]  # the first solve's
    assert on.evaluation.step_s <= off.evaluation.step_s * (1 + 1e-3)
    assert on.evaluation.memory.max() <= off.evaluation.memory.max()
    assert off.report["balanced_max_gb"] is None
    assert on.report["balanced_max_gb"] is not None


def test_local_balance_meets_the_bound_within_its_tolerance_and_is_deterministic():
    """Eight ranks, sixteen tables of up to 4x the synthetic sizes: the step-first plan
    holds 2.36x the mean on its fullest rank; the balance search (step let rise 10%,
    then won back with the fullest rank held) ends at <= 1.3x within those 10% of the step
    (measured 1.00x at +0.6% until s21; +7.5% since the batched lookup's price has a per-id
    term: the splits that spread the bytes each see every id of their table), twice the
    same."""
    p = make_problem("h200:2x4", n_tables=16, seed=1, big=4.0, settings=SolverSettings())
    pricer = Pricer(p)
    start = improve(p, pricer, greedy(p, pricer))
    before = evaluate(p, start, pricer)
    assert before.memory.max() / before.memory.mean() > 1.3
    a = balance(p, pricer, start, 0.1)
    after = evaluate(p, a, pricer)
    assert after.memory.max() / after.memory.mean() <= 1.3
    assert after.step_s <= before.step_s * 1.10
    assert balance(p, pricer, start, 0.1).tables == a.tables
    held = evaluate(p, balance(p, pricer, start, 0.0), pricer)
    assert held.step_s <= before.step_s * (1 + 1e-9)  # no tolerance: the step is held


def test_the_planner_trades_step_for_balance_only_within_its_tolerance():
    """``balance_tolerance`` bounds what the kept plan may cost against the step-first
    plan (reported as ``unbalanced_step_ms``); 0 never trades (the cap search off: it has
    its own tolerance, below)."""
    p = make_problem("h200:2x4", n_tables=16, seed=1, big=4.0,
                     settings=SolverSettings(time_limit_s=0.3, wall_limit_factor=200,
                                             balance_ratio=0.0))
    on = run_planner(p, "cpsat")
    off = run_planner(replace(p, settings=replace(p.settings, balance_tolerance=0.0)),
                      "cpsat")
    assert on.report["balance_tolerance"] == 0.02
    if on.report["unbalanced_step_ms"] is not None:
        assert on.report["predicted_step_ms"] <= on.report["unbalanced_step_ms"] * 1.02 + 1e-9
        assert 1e9 * on.report["unbalanced_max_gb"] > on.evaluation.memory.max()
    if off.report["unbalanced_step_ms"] is not None:  # only a faster, better-balanced plan
        assert off.report["predicted_step_ms"] <= off.report["unbalanced_step_ms"] + 1e-9
    assert on.evaluation.memory.max() <= off.evaluation.memory.max()


def test_explain_states_the_balance_trade():
    """A plan whose balance search replaced the step-first plan says so, with both steps
    and the fullest rank it had; one that did not, says nothing."""
    from gemc.explain import solver_lines

    block = {"status": "feasible", "planner": "cpsat", "kept": "cpsat+search",
             "predicted_step_ms": 6.73, "unbalanced_step_ms": 6.77,
             "unbalanced_max_gb": 27.364, "balance_tolerance": 0.02}
    text = "\n".join(solver_lines(block))
    assert "6.770 ms" in text and "27.364 GB" in text and "6.730 ms" in text
    assert "balance" not in "\n".join(solver_lines({**block, "unbalanced_step_ms": None}))
    capped = "\n".join(solver_lines({**block, "balanced_by": "cap", "balance_ratio": 1.3,
                                      "balance_cap_tolerance": 0.05}))
    assert "under max/mean 1.3 within balance_cap_tolerance 0.05" in capped


def _unbalanced_start(p):
    """(pricer, the step-first plan, its evaluation, ``mean_floor``); the plan is above
    1.3 max/mean, or the test would prove nothing."""
    pricer = Pricer(p)
    start = improve(p, pricer, greedy(p, pricer))
    before = evaluate(p, start, pricer)
    assert before.memory.max() / before.memory.mean() > 1.3
    return pricer, start, before, mean_floor(p, dense_sums(p, pricer, start.dense).memory, {})


def test_cap_search_brings_every_rank_under_the_ratio_of_the_least_mean():
    """``cap_memory`` on step-first plans at 2.36x, 2.82x and 1.44x max/mean (sixteen or
    twelve tables on eight ranks): every rank ends under 1.3 x ``mean_floor``, which no
    plan's mean is below, so max/mean <= 1.3 (measured 1.12, 1.18, 1.29, each within
    0.1% of the step); the same plan twice."""
    for n, seed in ((16, 1), (12, 2), (16, 3)):
        p = make_problem("h200:2x4", n_tables=n, seed=seed, big=4.0,
                         settings=SolverSettings())
        pricer, start, before, floor = _unbalanced_start(p)
        assert floor <= before.memory.mean() * (1 + 1e-12)
        a = cap_memory(p, pricer, start, 1.3)
        after = evaluate(p, a, pricer)
        assert after.memory.max() <= 1.3 * floor
        assert after.memory.max() / after.memory.mean() <= 1.3
        assert after.step_s <= before.step_s * 1.01
        assert cap_memory(p, pricer, start, 1.3).tables == a.tables


def test_the_planner_meets_the_ratio_only_within_its_cap_tolerance():
    """The planner keeps the capped plan where it reaches ``balance_ratio`` within
    ``balance_cap_tolerance`` of the step-first plan's step (reported as
    ``unbalanced_step_ms``); a plan already under the ratio, or the ratio 0, leaves the
    cap search off."""
    from gemc.solver.planners import capped_plan

    settings = SolverSettings(time_limit_s=0.3, wall_limit_factor=200)
    p = make_problem("h200:2x4", n_tables=12, seed=2, big=4.0, settings=settings)
    on = run_planner(p, "cpsat")
    assert on.evaluation.memory.max() / on.evaluation.memory.mean() <= 1.3
    pricer = Pricer(p)
    start = improve(p, pricer, greedy(p, pricer))
    before = evaluate(p, start, pricer)
    capped = capped_plan(p, pricer, start, before)
    assert capped is not None
    assert capped[1].memory.max() / capped[1].memory.mean() <= 1.3
    assert capped[1].step_s <= before.step_s * (1 + settings.balance_cap_tolerance)
    assert capped_plan(p, pricer, capped[0], capped[1]) is None   # already under the ratio
    off = replace(p, settings=replace(settings, balance_ratio=0.0))
    assert capped_plan(off, Pricer(off), start, before) is None
    with pytest.raises(ValueError, match="balance_ratio"):
        SolverSettings(balance_ratio=0.5)


def test_priced_cap_search_keeps_the_hot_table_cheap_where_the_hard_cap_does_not():
    """Five 80M-row tables on 8 ranks, one at pooling 400: with the bytes above the cap as
    the first key, the cap search's first move unloads most whatever it costs (3.5x the
    step here, past ``balance_cap_tolerance``); with that excess priced in step
    (``penalty``) it reaches the same cap within 2% of the step-first plan (+1.8% since
    the batched lookup's price has a per-id term, s21; 1% under it before),
    and ``capped_plan`` falls back to it (its plan, not the hard search's, is kept).
    (Pooling 100 until the id all-to-all carried a copy per column piece, issue 19: the
    step-first plan changed, and both searches then found the same plan, 1% faster.
    Pooling 200 until column splits under row-wise Adagrad were priced on the sparse route
    they run on, issue 21: both searches then ended over the cap. ``b2`` at pooling 27
    until those splits joined the owners' fused kernel (issues 19, 21): the step-first
    plan then split ``b2`` by columns, and from it both searches ended 2.2x the step.)"""
    from gemc.cost_model.topology import parse_topology
    from gemc.cost_model.types import RegionCost, StepOptions, TableCost

    from gemc.solver.planners import CAP_PENALTY, capped_plan
    from gemc.solver.problem import Problem

    batch = 8192
    pooling = {"hot": 400, "b0": 3, "b1": 12, "b2": 54, "b3": 12}
    tables = [TableCost(n, rows=80_000_000, dim=128, nnz=batch * k, batch=batch)
              for n, k in pooling.items()]
    tables += [TableCost("s0", rows=100_000, dim=128, nnz=batch * 4, batch=batch),
               TableCost("s1", rows=100_000, dim=128, nnz=batch * 8, batch=batch),
               TableCost("s2", rows=1000, dim=128, nnz=batch * 9, batch=batch)]
    region = RegionCost("r0", params=10**7, fwd_flops=1e12, compute_s=1e-3,
                        activation_bytes=10**9, boundary_bytes=10**8)
    p = Problem((region,), tuple(tables), parse_topology("h200:1x8"),
                options=StepOptions(table_optimizer="rowwise_adagrad"),
                settings=SolverSettings())
    pricer, start, before, floor = _unbalanced_start(p)
    hard = evaluate(p, cap_memory(p, pricer, start, 1.3), pricer)
    assert hard.step_s > before.step_s * (1 + p.settings.balance_cap_tolerance)
    priced = cap_memory(p, pricer, start, 1.3, penalty=CAP_PENALTY)
    after = evaluate(p, priced, pricer)
    assert after.memory.max() <= 1.3 * floor
    assert after.step_s <= before.step_s * 1.02
    kept = capped_plan(p, pricer, start, before)
    assert kept is not None and kept[0].tables == priced.tables
    assert cap_memory(p, pricer, start, 1.3, penalty=CAP_PENALTY).tables == priced.tables


# DLRMv2's 26 tables (rows, pooling) at a local batch of 1,024 (global 65,536 over 64 ranks),
# and the step-first plan the CP-SAT planner hands the balance stage there (issue 19, s13;
# re-recorded when the batched lookup's price was refitted to its measured steps, s21):
# sharding and ranks (None: every rank)
_DLRMV2_64 = {
    "bags.0.weight": (40_000_000, 3, "table_wise", (0,)),
    "bags.1.weight": (39_060, 2, "table_wise", (8,)),
    "bags.2.weight": (17_295, 1, "table_wise", (10,)),
    "bags.3.weight": (7_424, 2, "table_wise", (9,)),
    "bags.4.weight": (20_265, 6, "table_wise", (26,)),
    "bags.5.weight": (3, 1, "table_wise", (25,)),
    "bags.6.weight": (7_122, 1, "table_wise", (14,)),
    "bags.7.weight": (1_543, 1, "table_wise", (27,)),
    "bags.8.weight": (63, 1, "table_wise", (20,)),
    "bags.9.weight": (40_000_000, 7, "table_wise", (49,)),
    "bags.10.weight": (3_067_956, 3, "table_wise", (5,)),
    "bags.11.weight": (405_282, 8, "table_wise", (57,)),
    "bags.12.weight": (10, 1, "table_wise", (23,)),
    "bags.13.weight": (2_209, 6, "table_wise", (50,)),
    "bags.14.weight": (11_938, 9, "table_wise", (1,)),
    "bags.15.weight": (155, 5, "table_wise", (58,)),
    "bags.16.weight": (4, 1, "table_wise", (24,)),
    "bags.17.weight": (976, 1, "table_wise", (51,)),
    "bags.18.weight": (14, 1, "table_wise", (22,)),
    "bags.19.weight": (40_000_000, 12, "table_wise", (48,)),
    "bags.20.weight": (40_000_000, 100, "table_row_wise", (32, 33, 34, 35, 36, 37, 38, 39)),
    "bags.21.weight": (40_000_000, 27, "table_row_wise", (40, 41, 42, 43, 44, 45, 46, 47)),
    "bags.22.weight": (590_152, 10, "table_wise", (56,)),
    "bags.23.weight": (12_973, 3, "table_wise", (2,)),
    "bags.24.weight": (108, 1, "table_wise", (59,)),
    "bags.25.weight": (36, 1, "table_wise", (21,)),
}


# the same tables at a local batch of 16 on 4,096 ranks, and that step-first plan
# (``_hosts``: a grid's host blocks of 8 ranks, by their first rank)
def _hosts(*starts: int) -> tuple[int, ...]:
    return tuple(r for s in starts for r in range(s, s + 8))


_DLRMV2_4096 = {
    "bags.0.weight": (40_000_000, 3, "column_wise", (368, 376)),
    "bags.1.weight": (39_060, 2, "table_wise", (432,)),
    "bags.10.weight": (3_067_956, 3, "column_wise", (352, 360)),
    "bags.11.weight": (405_282, 8, "column_wise", (320, 328, 336, 344)),
    "bags.12.weight": (10, 1, "data_parallel", None),
    "bags.13.weight": (2_209, 6, "column_wise", (128, 136)),
    "bags.14.weight": (11_938, 9, "column_wise", (272, 280)),
    "bags.15.weight": (155, 5, "grid", _hosts(0, 8, 16, 24, 32, 40, 48, 56)),
    "bags.16.weight": (4, 1, "data_parallel", None),
    "bags.17.weight": (976, 1, "table_wise", (448,)),
    "bags.18.weight": (14, 1, "data_parallel", None),
    "bags.19.weight": (40_000_000, 12, "column_wise", (224, 232, 240, 248, 384, 392, 400, 408)),
    "bags.2.weight": (17_295, 1, "table_wise", (456,)),
    "bags.20.weight": (40_000_000, 100, "grid", _hosts(80, 88, 96, 104, 112, 120, 256, 264)),
    "bags.21.weight": (40_000_000, 27, "grid", _hosts(160, 168, 176, 184, 192, 200, 208, 216)),
    "bags.22.weight": (590_152, 10, "column_wise", (560, 568, 576, 584, 592, 600, 608, 616)),
    "bags.23.weight": (12_973, 3, "table_wise", (424,)),
    "bags.24.weight": (108, 1, "table_wise", (464,)),
    "bags.25.weight": (36, 1, "column_wise", (64, 72)),
    "bags.3.weight": (7_424, 2, "table_wise", (440,)),
    "bags.4.weight": (20_265, 6, "column_wise", (144, 152)),
    "bags.5.weight": (3, 1, "data_parallel", None),
    "bags.6.weight": (7_122, 1, "table_wise", (472,)),
    "bags.7.weight": (1_543, 1, "table_wise", (480,)),
    "bags.8.weight": (63, 1, "table_wise", (416,)),
    "bags.9.weight": (40_000_000, 7, "column_wise", (288, 296, 304, 312)),
}


def _dlrmv2_64():
    """DLRMv2 x 64 ranks as ``benchmarks/vs_torchrec.gemc_problem`` captures it (its six
    dense regions, every table on the sparse route, row-wise Adagrad, the H200
    calibration), without the capture; and that step-first plan."""
    return _dlrmv2("h200:8x8", 1024, _DLRMV2_64, (
        (0.000152606, 15473408, 14155776),
        (0.000163888, 15211264, 28311552),
        (0.000163888, 15211264, 28311552)),
        (("", 1.2803e-05, 2048, 16130256), ("bottom", 0.000162684, 2204416, 53248),
         ("top", 0.000287491, 16259074, 14155776)))


def _dlrmv2_4096():
    """DLRMv2 x 4,096 ranks (512 hosts of 8), as ``_dlrmv2_64``."""
    return _dlrmv2("h200:512x8", 16, _DLRMV2_4096, (
        (7.5961e-05, 7215872, 221184),
        (7.6302e-05, 7211776, 442368),
        (7.6302e-05, 7211776, 442368)),
        (("", 8.694e-06, 32, 252240), ("bottom", 9.3045e-05, 371872, 832),
         ("top", 0.000166649, 10582018, 221184)))


def _dlrmv2(topology: str, batch: int, plan: dict, cross: tuple, ends: tuple):
    """DLRMv2's problem at a local ``batch`` on ``topology`` (``cross``: the cross
    layers' (seconds, activation bytes, boundary bytes); ``ends``: the same of the input,
    bottom and top regions), and the step-first ``plan``."""
    from gemc.cost_model.calibration import default_calibration
    from gemc.cost_model.topology import parse_topology
    from gemc.cost_model.types import RegionCost, StepOptions, TableCost

    from gemc.solver.problem import Assignment, DenseChoice, Problem, TableChoice

    (_, c0, a0, b0), (_, cb, ab, bb), (_, ct, at, bt) = ends
    regions = (
        RegionCost("", 0, 3538950.0 * batch / 1024, c0, activation_bytes=a0,
                   boundary_bytes=b0),
        RegionCost("bottom", 171392, 350093312.0 * batch / 1024, cb, activation_bytes=ab,
                   boundary_bytes=bb),
        *(RegionCost(f"cross.{i}", 3542400, 7254835200.0 * batch / 1024, c,
                     activation_bytes=a, boundary_bytes=b)
          for i, (c, a, b) in enumerate(cross)),
        RegionCost("top", 5245953, 10740826112.0 * batch / 1024, ct, activation_bytes=at,
                   boundary_bytes=bt),
    )
    tables = tuple(TableCost(fqn, rows=rows, dim=128, nnz=batch * pool, batch=batch,
                             lookup="sparse")
                   for fqn, (rows, pool, _, _) in plan.items())
    topo = parse_topology(topology)
    p = Problem(regions, tables, topo, default_calibration("h200"),
                options=StepOptions(table_optimizer="rowwise_adagrad"),
                settings=SolverSettings(), placeable=frozenset(r.name for r in regions),
                graph_mode=True)
    start = Assignment(
        dense={r.name: DenseChoice() for r in regions},
        tables={fqn: TableChoice(kind, ranks or tuple(range(topo.world_size)),
                                 (8, 8) if kind == "grid" else None)
                for fqn, (_, _, kind, ranks) in plan.items()})
    return p, start


def test_priced_cap_search_meets_the_ratio_on_dlrmv2_at_64_ranks_within_its_tolerance():
    """DLRMv2 x 64 ranks from its step-first plan (3.170 ms, max / mean 7.04 with the
    lookups' gradients in the memory: the 40M-row tables table-wise or over one host's
    rows): the hard cap search costs 2.9x the step (9.177 ms, past
    ``balance_cap_tolerance``); the priced one, swept until it moves nothing, stops at
    max / mean 1.33 (3.326 ms); from the starts with the three whole 40M-row tables
    re-sharded (``split_oversized``) the priced search meets 1.3 at +0.15% (3.175 ms,
    1.29), and that is the plan ``capped_plan`` keeps. (s22: since the row shards'
    partials are summed in their host, ``cost_model.step_model.host_reduce_owners``; in
    s21, with the lookup's refitted price, the priced search alone met it at +1.6%, 3.747
    ms; before, from a plan of 4.604 ms at 6.27: hard +21.6%, priced +1.9%.) Failed
    before s13-balance (four priced sweeps, then the hard phases: 8.456 ms, 1.52) and with
    the gradients' bytes counted above the cap (s13-memory's merge: the priced phase paid
    step for them, +7.7%)."""
    from gemc.solver.local_search import split_oversized
    from gemc.solver.planners import CAP_PENALTY, capped_plan

    p, start = _dlrmv2_64()
    pricer = Pricer(p)
    before = evaluate(p, start, pricer)
    assert before.max_over_mean > 6
    tol = p.settings.balance_cap_tolerance
    hard = evaluate(p, cap_memory(p, pricer, start, 1.3), pricer)
    assert hard.step_s > before.step_s * (1 + tol)
    priced = evaluate(p, cap_memory(p, pricer, start, 1.3, penalty=CAP_PENALTY), pricer)
    assert priced.max_over_mean > 1.3
    splits = split_oversized(p, pricer, start, 1.3)
    assert splits and all(b.tables["bags.0.weight"].sharding != "table_wise" for b in splits)
    kept = capped_plan(p, pricer, start, before)
    assert kept is not None
    a, after = kept
    assert after.max_over_mean <= 1.3
    assert after.step_s <= before.step_s * 1.025
    assert any(a.tables == cap_memory(p, pricer, b, 1.3, penalty=CAP_PENALTY).tables
               for b in splits)


def test_cap_search_meets_the_ratio_on_dlrmv2_at_4096_ranks_with_fused_column_pieces():
    """DLRMv2 x 4,096 ranks from its step-first plan (4.58 ms, 11.86 GB on a 1.45-GB
    mean, 8.2): the hard try meets 1.3 at once and at a faster step (4.355 ms, 1.27), the
    pooling-100 40M-row table on an 8 x 8 grid. Before its column pieces joined their
    owners' fused kernel (the two-phase row-wise Adagrad update) each piece carried 0.29
    GB of sparse gradient and row update on a rank whose dense part is 1.43 GB: the hard
    try stopped at 1.42 and only a last try counting every byte, with the 16 x 16 grid,
    met the ratio."""
    from gemc.solver.planners import balanced_plan, cap_search

    p, start = _dlrmv2_4096()
    pricer = Pricer(p)
    before = evaluate(p, start, pricer)
    assert before.max_over_mean > 8
    met, unmet = cap_search(p, pricer, start, before)
    assert not unmet and met is not None  # the hard try met it: nothing refused
    a, after = met
    assert after.max_over_mean <= 1.3
    assert after.step_s <= before.step_s
    assert a.tables["bags.20.weight"].sharding == "grid"
    assert balanced_plan(p, pricer, start, before)[1].tables == a.tables


def test_where_no_plan_meets_the_ratio_the_cap_searchs_plan_still_balances_within_tolerance(
        ) -> None:
    """Asked for a ratio no plan meets (1.0: every rank exactly the mean), the cap search
    refuses all its tries (the hard one, then the one counting every byte); they still
    compete in ``balanced_plan`` by their fullest rank within the tolerance, and the
    kept plan is one of them at about 1.04 where ``balance`` alone, with its 78 moves
    (the budget scaled to 4,096 ranks), moves nothing (the planner once kept 12.10 GB
    so)."""
    from gemc.solver.planners import balanced_plan, cap_search

    p, start = _dlrmv2_4096()
    p = replace(p, settings=replace(p.settings, balance_ratio=1.0))
    pricer = Pricer(p)
    before = evaluate(p, start, pricer)
    met, unmet = cap_search(p, pricer, start, before)
    # the hard try, the re-sharded starts' (``split_oversized``), then counting every byte
    assert met is None and len(unmet) >= 2
    replaced, a, after, by = balanced_plan(p, pricer, start, before)
    assert replaced is before and by == "cap"
    assert after.memory.max() < 0.2 * before.memory.max() and after.max_over_mean < 1.1
    assert after.step_s <= before.step_s * (1 + p.settings.balance_tolerance)
    assert any(a.tables == b.tables for b, _ in unmet)


def test_cap_search_with_a_budget_under_one_sweep_moves_only_tables_above_the_cap():
    """Where its budget is under one sweep over every table's options, the hard cap
    search's excess-first phase prices only tables on a rank above the cap (moving any
    other cannot lower the excess), and so still reaches 1.3 (measured 1.30, 1.26, 1.19 within 1% of
    the step; within 2% since the batched lookup's price has a per-id term, s21, where pricing every table in turn left 2.15, 1.56, 1.49;
    s22, the row shards' partials summed in their host: 1.30, 1.29, and 1.24 for the third
    case with 80 moves, still under one sweep of its 165 options: 40 left 1.48). The budget stands
    in for 1,040 tables x 512 ranks, whose 5,000 moves were under one sweep of ~9,400
    and left 1.56 (now 1.29, BENCHMARKS.md issue 19, s13)."""
    from gemc.solver.candidates import table_options

    for n, seed, moves in ((16, 1, 40), (16, 3, 30), (24, 1, 80)):
        p = make_problem("h200:2x4", n_tables=n, seed=seed, big=4.0,
                         settings=SolverSettings())
        pricer, start, before, floor = _unbalanced_start(p)
        assert moves < sum(len(table_options(p, t)) for t in p.tables)  # under one sweep
        a = cap_memory(p, pricer, start, 1.3, max_moves=moves)
        after = evaluate(p, a, pricer)
        assert after.max_over_mean <= 1.3
        assert after.step_s <= before.step_s * 1.02
        assert cap_memory(p, pricer, start, 1.3, max_moves=moves).tables == a.tables

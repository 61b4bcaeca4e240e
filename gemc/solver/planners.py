"""Run a planner on a problem: enumerate, estimate, propose, partition, report.

Every planner's assignment goes through the same ``evaluate`` (the step model's
arithmetic), so their plans compare; a plan over the memory cap is never returned, it
becomes a :class:`PlanInfeasibleError` that names the rank. The CP-SAT planner starts from
greedy's plan improved by the local search, and keeps whichever plan the step model
predicts faster (then the better balanced), so it is never worse than greedy; then a
better-balanced plan may replace it: one with every rank under ``balance_ratio`` x the
mean within ``balance_cap_tolerance`` of its step, else one with an emptier fullest rank
within ``balance_tolerance`` (the report gives the step and fullest rank it replaced).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .candidates import TableClass, region_classes, table_classes
from .evaluate import Evaluation, Pricer, evaluate
from .expand import Layout, choose_layout, expand
from .greedy import greedy
from .infeasible import (
    PlanInfeasibleError,
    SolverCrashError,
    check_lower_bound,
    error_from_evaluation,
)
from .local_search import (
    balance,
    cap_memory,
    improve,
    move_budget,
    plan_key,
    sends_key,
    split_oversized,
    spread_sends,
)
from .naive import naive
from .problem import Assignment, Problem, host_step_s

PLANNERS = ("cpsat", "greedy", "naive")


@dataclass(frozen=True)
class CpsatFigures:
    """What the CP-SAT planner adds to its report (reproducible values only): which
    planner's plan it kept, its model's objective, bound and size, the heuristics' steps,
    its settings, and what the memory balance did."""

    kept: str  # the plan kept: "cpsat", "coarse", "greedy", "naive", each maybe "+search"
    objective_ms: float | None
    bound_ms: float | None
    gap: float | None
    greedy_step_ms: float | None  # None where the plan did not fit
    naive_step_ms: float | None
    deterministic_seconds: float | None
    time_limit_s: float
    gap_limit: float
    workers: int
    seed: int
    bin_size: int
    coarse_status: str | None  # the first, one-bin model's status, where it ran
    variables: int
    constraints: int
    crashed: bool
    # the fullest rank's (a bin's mean) GB in the model after the memory-balance solve
    # (lexicographic second objective, the step held), None if it did not run
    balanced_max_gb: float | None
    balance_tolerance: float
    # the max / mean cap searched (``capped_plan``), its tolerance, and which search made
    # the plan kept ("cap", "search"; None: the step-first plan). "cap" with a max / mean
    # above ``balance_ratio``: no plan the cap search found met it within its tolerance,
    # and its plan had the emptiest fullest rank within ``balance_tolerance``
    balance_ratio: float
    balance_cap_tolerance: float
    balanced_by: str | None
    # the step and fullest rank before the balance trade (None: not traded)
    unbalanced_step_ms: float | None
    unbalanced_max_gb: float | None
    # the most pooled all-to-all MB one rank sends (a step's mean of forward and backward),
    # and before ``spread_sends`` re-placed the tables (None: it did not)
    max_rank_sends_mb: float
    unspread_max_rank_sends_mb: float | None


@dataclass(frozen=True)
class PlannerReport:
    """The planners' report stage, typed: the planner asked for, its status (CP-SAT's, or
    ``heuristic`` for greedy / naive, ``crashed``), the classes it planned over, the
    predicted device step, CP-SAT's own figures, and what the stages after the planner
    add (the exchange precision chosen, the table optimizer priced). ``to_dict`` is the
    plan's ``solver`` block (reproducible values only)."""

    planner: str
    region_classes: int
    table_classes: int
    status: str
    predicted_step_ms: float | None
    cpsat: CpsatFigures | None = None
    # the exchange precision's choice (gemc.solver.exchange_choice); the parallelize pass
    # moves it to the plan's own ``exchange`` block
    exchange: Mapping[str, Any] | None = None
    table_optimizer: str | None = None  # the optimizer priced (the parallelize pass)
    # the fullest rank's GB as the planner fitted it and the per-GPU GB it fitted under:
    # the plan's ``predicted.max_memory_gb`` is priced by the same memory model, so it
    # equals the first and never exceeds the second
    max_memory_gb: float | None = None
    cap_gb: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON values: every field but ``cpsat``, whose figures are keys of
        their own; ``exchange`` and ``table_optimizer`` only where set."""
        out: dict[str, Any] = {"planner": self.planner, "region_classes": self.region_classes,
                               "table_classes": self.table_classes, "status": self.status,
                               "predicted_step_ms": self.predicted_step_ms,
                               "max_memory_gb": self.max_memory_gb, "cap_gb": self.cap_gb}
        if self.cpsat is not None:
            out.update(asdict(self.cpsat))
        if self.exchange is not None:
            out["exchange"] = self.exchange
        if self.table_optimizer is not None:
            out["table_optimizer"] = self.table_optimizer
        return out


@dataclass
class PlannerResult:
    planner: str
    assignment: Assignment
    evaluation: Evaluation
    summary: PlannerReport
    wall_s: float = 0.0                 # not in the plan: it differs run to run
    notes: list[str] = field(default_factory=list)
    table_cost: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase

    @property
    def report(self) -> dict[str, Any]:
        """The report as the plan's ``solver`` block (a new dict each time: change the
        typed ``summary``)."""
        return self.summary.to_dict()


def table_costs(problem: Problem, a: Assignment, pricer: Pricer) -> dict[str, dict[str, float]]:
    """Per table: what each of its shards costs the rank holding it (for explain)."""
    out = {}
    for t in problem.tables:
        o = pricer.table(t, a.tables[t.fqn])
        out[t.fqn] = {"shard_compute_ms": round(1e3 * o.compute_s, 6),
                      "shard_memory_gb": round(o.memory / 1e9, 6),
                      "shard_a2a_mb": round(o.out_bytes / 1e6, 6)}
    return out


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(float(x), digits)


def _memory_figures(ev: Evaluation) -> dict[str, float | None]:
    """The report's fullest rank and cap (GB) of the plan's evaluation."""
    return {"max_memory_gb": _round(float(ev.memory.max(initial=0.0)) / 1e9),
            "cap_gb": _round(ev.cap / 1e9)}


def run_planner(problem: Problem, planner: str) -> PlannerResult:
    """The chosen planner's assignment, checked against the memory cap."""
    if planner not in PLANNERS:
        raise ValueError(f"unknown planner {planner!r}; known: {', '.join(PLANNERS)}")
    start = time.perf_counter()
    regions, tables = region_classes(problem), table_classes(problem)
    pricer = Pricer(problem)
    check_lower_bound(problem, regions, tables)
    if planner in ("naive", "greedy"):
        a = naive(problem) if planner == "naive" else greedy(problem, pricer)
        ev = evaluate(problem, a, pricer)
        if not ev.feasible:
            raise error_from_evaluation(problem, a, ev, pricer, regions, tables,
                                        planner=planner, proven=False)
        report = PlannerReport(planner, len(regions), len(tables), "heuristic",
                               _round(ev.step_ms), **_memory_figures(ev))
        return PlannerResult(planner, a, ev, report, time.perf_counter() - start,
                             table_cost=table_costs(problem, a, pricer))
    return _cpsat(problem, regions, tables, pricer, start)


# how far the balance search may let the step rise while it spreads memory (it then wins
# the step back with the fullest rank held); its plan is kept only within
# ``balance_tolerance`` of the step: on DLRMv2 at 16 ranks it ended 0.6% *faster* and at
# 1.15 max/mean instead of 3.37 (the detour leaves the search's local optimum)
BALANCE_EXPLORE = 0.1
BALANCE_MIN_GAIN = 0.05
BALANCE_MOVES_SHARE = 4  # each balance phase prices a quarter of the search's moves
# the cap search's second try (``cap_memory``'s ``penalty``): one mean rank of bytes above
# the cap is worth this share of the step. On DLRMv2 x 64 ranks (s8's pricing) 0.025 and
# 0.075 found the same plan (4.092 ms), 0.22 the hard search's (4.418): the share a
# balanced plan may cost (balance_cap_tolerance, 0.05 then) is in that range. Under s13's
# pricing only 0.05 of those three meets 1.3 there (4.692 ms; 0.025 and 0.075 end at
# 8.418 and 8.271 ms, 1.33): the search is sensitive to it (BENCHMARKS.md, issue 19)
CAP_PENALTY = 0.05


def balanced_plan(problem: Problem, pricer: Pricer, a: Assignment, ev: Evaluation
              ) -> tuple[Evaluation | None, Assignment, Evaluation, str | None]:
    """(the evaluation before, if a better-balanced plan replaced ``a``; the plan; its
    evaluation; which search replaced it: "cap" or "search"). First the cap search to
    ``balance_ratio`` (``capped_plan``); where it does not pay, balanced plans are searched with the step let rise BALANCE_EXPLORE and
    ``balance_tolerance``; the one with the emptiest fullest rank (then the fastest)
    within ``balance_tolerance`` of ``a``'s step wins, if it empties that rank (by
    BALANCE_MIN_GAIN at least, where it costs step). The cap search's plans that missed
    the ratio are among them ("cap"; ``cap_search`` says why)."""
    capped, unmet = cap_search(problem, pricer, a, ev)
    if capped is not None:
        return ev, *capped, "cap"
    tol = problem.settings.balance_tolerance
    limit = int(round(ev.step_s * (1 + tol) * 1e9))
    best_mem, step = int(ev.memory.max() // 2**20), int(round(ev.step_s * 1e9))
    best: tuple[int, int] = (best_mem, step)
    chosen = None
    tries = [(balance(problem, pricer, a, explore,
                      max_moves=move_budget(problem) // BALANCE_MOVES_SHARE), "search")
             for explore in sorted({BALANCE_EXPLORE, tol} - {0.0})]
    # the cap search's refused plans last: on a tie the balance search's stays
    for b, by, b_ev in [*((b, by, evaluate(problem, b, pricer)) for b, by in tries),
                        *((b, "cap", b_ev) for b, b_ev in unmet)]:
        key = (int(b_ev.memory.max() // 2**20), int(round(b_ev.step_s * 1e9)))
        # step spent only for a fullest rank BALANCE_MIN_GAIN emptier
        pays = key[1] <= step or key[0] <= (1 - BALANCE_MIN_GAIN) * best_mem
        if b_ev.feasible and key[1] <= limit and pays and key < best:
            best, chosen = key, (b, b_ev, by)
    if chosen is None:
        return None, a, ev, None
    return ev, *chosen


def _sent(problem: Problem, pricer: Pricer, a: Assignment, ev: Evaluation
          ) -> tuple[Assignment, Evaluation, bool]:
    """``a`` with its pooled all-to-all sends spread over the ranks (``spread_sends``)
    where that keeps its step, its fullest rank and its memory balance, and the most one
    rank sends drops; whether it replaced ``a``. Last, so the plans the step and the
    balance searches chose are only re-placed, never traded."""
    b = spread_sends(problem, pricer, a,
                     max_moves=move_budget(problem) // BALANCE_MOVES_SHARE)
    if b.tables == a.tables:
        return a, ev, False
    b_ev = evaluate(problem, b, pricer)
    keeps = (b_ev.feasible and int(round(b_ev.step_s * 1e9)) <= int(round(ev.step_s * 1e9))
             and b_ev.memory.max() <= ev.memory.max()
             and b_ev.max_over_mean <= max(ev.max_over_mean, problem.settings.balance_ratio or 0.0)
             and sends_key(b_ev) < sends_key(ev))
    return (b, b_ev, True) if keeps else (a, ev, False)


def capped_plan(problem: Problem, pricer: Pricer, a: Assignment, ev: Evaluation
            ) -> tuple[Assignment, Evaluation] | None:
    """The plan ``cap_memory`` finds with every rank under ``balance_ratio`` x the least
    mean, if ``a`` is above that ratio and the capped plan reaches it within
    ``balance_cap_tolerance`` of ``a``'s step; else None (``balanced_plan``'s search goes on).
    Measured on DLRMv2 (BENCHMARKS.md, s7): 1,040 tables x 64 ranks 1.53 -> 1.29 for
    +0.4% of step, x 512 ranks 2.03 -> 1.25 for +1.2%. Where the hard cap search costs
    more than the tolerance, it runs again with the excess priced in step
    (``CAP_PENALTY``): 26 tables x 64 ranks, 12.8% -> 4.5% of step (s8); 21.6% -> 1.9%
    under s13's pricing (the id exchange per column piece, ddp-only dense parts)."""
    return cap_search(problem, pricer, a, ev)[0]


def cap_search(problem: Problem, pricer: Pricer, a: Assignment, ev: Evaluation
                ) -> tuple[tuple[Assignment, Evaluation] | None,
                           list[tuple[Assignment, Evaluation]]]:
    """(``capped_plan``'s answer; the plans the cap search found that it refused): the
    hard and the priced tries on the steady bytes, then, where none met the ratio, a
    priced try counting the gradient terms too (``cap_memory``'s ``gradients``).
    Why the refused ones: ``balanced_plan`` weighs them with its own searches' plans by the
    fullest rank within ``balance_tolerance``. DLRMv2 x 4096 ranks: no plan meets 1.3
    there without the pooling-100 40M-row table row-wise over every rank (+36.6% of
    step): its finest other shard, an 8 x 8 grid piece, is 0.35 GB and its lookup's
    sparse gradient and row update 0.29 GB on a rank whose dense part alone is 1.43 GB
    of a 1.46-GB mean (before ``gemc.sharding`` offered the 16 x 16 grid). The cap
    search still reached 1.42 at the same step (12.10 -> 2.07 GB), where ``balance``'s
    78 moves (the budget scaled to 4096 ranks) moved nothing."""
    s = problem.settings
    if not s.balance_ratio or problem.world <= 1 or ev.max_over_mean <= s.balance_ratio:
        return None, []
    limit = ev.step_s * (1 + s.balance_cap_tolerance)
    met: tuple[Assignment, Evaluation] | None = None
    unmet: list[tuple[Assignment, Evaluation]] = []

    def cap(start: Assignment, penalty: float, gradients: bool = False) -> Evaluation:
        """One try from ``start``, kept as met (the fastest) or refused."""
        nonlocal met
        # the search's budget unscaled by ranks: at 1,040 tables x 512 ranks the scaled
        # one (2,500 moves, under one sweep) left 1.83, 5,000 reached 1.25
        b = cap_memory(problem, pricer, start, s.balance_ratio, max_moves=s.search_moves,
                       penalty=penalty, gradients=gradients)
        b_ev = evaluate(problem, b, pricer)
        if not (b_ev.feasible and b_ev.max_over_mean <= s.balance_ratio
                and b_ev.step_s <= limit):
            unmet.append((b, b_ev))
        elif met is None or round(b_ev.step_s * 1e9) < round(met[1].step_s * 1e9):
            met = b, b_ev
        return b_ev

    hard = cap(a, 0.0)
    # the priced try where the hard one met the ratio (the faster plan is kept: at 26
    # tables x 16 ranks the hard one meets it at 9.608 ms, the priced one at 9.364) or
    # cost too much step; not where it kept the step and missed only the ratio: the
    # priced try clears the same steady cap (1,040 tables x 4096 ranks: both 1.303,
    # 12.8 s for the priced one)
    if met is not None or hard.step_s > limit:
        cap(a, CAP_PENALTY)
    # the tables too large for the ratio re-sharded first, each way (``split_oversized``),
    # fastest start first, until a priced try meets it
    for split in (split_oversized(problem, pricer, a, s.balance_ratio) if met is None else []):
        cap(split, CAP_PENALTY)
        if met is not None:
            break
    if met is None and unmet:
        # no try met the ratio by every byte although they cleared the steady cap: the
        # gradient terms tip the fullest ranks over (DLRMv2 x 4096: a 3M-row table's
        # 4-way column pieces, 0.42 GB and 0.11 GB of gradient terms on a 1.43-GB dense
        # part, 1.34). A last try from the emptier plan counts every byte against the
        # cap raised by the start's mean gradient term: 1.22 at +0.1% there
        near, _ = min(unmet, key=lambda x: (float(x[1].memory.max()), x[1].step_s))
        cap(near, CAP_PENALTY, gradients=True)
    return met, unmet


def _without_replicas(tables: list[TableClass]) -> list[TableClass]:
    """The classes with their data-parallel options dropped (one kept where a class has
    nothing else)."""
    return [replace(tc, options=tuple(o for o in tc.options if not o.replicated)
                    or tc.options) for tc in tables]


def _cpsat(problem: Problem, regions, tables, pricer: Pricer, start: float) -> PlannerResult:
    """The finest model the variable budget allows, hinted with the best heuristic plan
    (greedy or naive) after the local search improved it. When that model's bins hold
    several ranks anyway, a first model with every rank in one bin (only shardings and
    strategies: small, solved fast) takes 30% of the budget and hints the second. CP-SAT's
    solution is expanded to ranks and polished by the same local search; every plan is
    checked exactly and the best that fits wins (step, then memory balance)."""
    from . import cpsat

    clock = {"prepare": time.perf_counter() - start}
    t = time.perf_counter()
    g = greedy(problem, pricer)
    g_ev = evaluate(problem, g, pricer)
    n = naive(problem)
    n_ev = evaluate(problem, n, pricer)
    tried: list[tuple[str, Assignment, Evaluation]] = [("greedy", g, g_ev), ("naive", n, n_ev)]
    clock["heuristics"] = time.perf_counter() - t

    def search(name: str, a: Assignment) -> None:
        """Local search from a plan (``local_search``), kept among the tried ones."""
        t = time.perf_counter()
        better = improve(problem, pricer, a)
        tried.append((name, better, evaluate(problem, better, pricer)))
        clock[name] = time.perf_counter() - t

    def best() -> tuple[str, Assignment, Evaluation]:
        # fitting first, then the step, then memory balance (local_search.plan_key)
        return min(tried, key=lambda x: plan_key(x[2]))

    def run(layout: Layout, budget: float, name: str,
            classes: list[TableClass] | None = None) -> cpsat.CpSatResult:
        t = time.perf_counter()
        classes = tables if classes is None else classes
        hint = cpsat.to_model_solution(problem, layout, regions, classes, best()[1], pricer)
        res = cpsat.solve(problem, layout, regions, classes, pricer, hint, budget)
        for key, s in ((f"{name}_build", res.build_s), (name, res.wall_s)):
            clock[key] = clock.get(key, 0.0) + s  # a model run twice: both runs
        if res.solution is not None:
            a = expand(problem, layout, regions, classes, res.solution, pricer)
            tried.append((name, a, evaluate(problem, a, pricer)))
        clock[f"{name}_total"] = clock.get(f"{name}_total", 0.0) + time.perf_counter() - t
        return res

    start_name, start_plan, _ = best()
    search(f"{start_name}+search", start_plan)  # CP-SAT's hint: one table moved at a time
    layout = choose_layout(problem, tables)
    total = problem.budget_s
    coarse = None
    if 1 < layout.bin_size < problem.world:  # the fine model is fluid anyway: start cheap
        one_bin = Layout(problem.world, layout.local, problem.world)
        coarse = run(one_bin, 0.3 * total, "coarse")
        if any(x[0] == "coarse" and not x[2].feasible for x in tried) \
                and any(o.replicated for tc in tables for o in tc.options):
            # the one-bin model sees memory summed, not packed: where its replicas left the
            # other tables too little room to pack (DLRMv2 x 40 at 64 ranks: 280 replicas,
            # the 20.7-GB tables over the cap by 6 GB), it runs again without replicas, so
            # the fine model starts from a plan that fits (and may replicate from there)
            coarse = run(one_bin, 0.3 * total, "coarse", _without_replicas(tables))
    res = run(layout, total - (0.3 * total if coarse else 0.0), "cpsat")
    for name in ("cpsat", "coarse"):  # CP-SAT's expanded plan, polished by the same moves
        found = [x for x in tried if x[0] == name]
        if found:
            search(f"{name}+search", found[0][1])
            break
    # the plan kept: fitting first, then the step with the host's exposed time (the
    # searches price the device step; the tables' routes set the step's launches, so on a
    # host-bound step the least device time may lose: GEM tiny on 8 ranks, every table a
    # replica at 1.28 ms of device step, 38.8 ms with its eager lookups' launches, against
    # greedy's 1.76 and 26.5), then plan_key
    source, a, ev = min(tried, key=lambda x: (
        x[2].over_bytes, int(round(host_step_s(problem, x[1], x[2].step_s) * 1e9)),
        plan_key(x[2])))
    crashes = [r.crash for r in (coarse, res) if r is not None and r.crash]
    if not ev.feasible and crashes and not any(
            r is not None and r.solution is not None for r in (coarse, res)):
        raise SolverCrashError(
            f"CP-SAT could not plan this model: {'; '.join(crashes)}; and neither "
            "heuristic planner (greedy, naive) found a plan that fits in memory",
            where=f"the parallelize pass, {len(problem.tables)} tables on "
                  f"{problem.topology.spec}",
            fix="compile again with another --time-limit (another search path), or use an "
                "OR-Tools release where google/or-tools#5025 is fixed; if the abort persists, "
                "report it with this message")
    if not ev.feasible:
        proven = res.status == "infeasible" and layout.bin_size == 1
        raise error_from_evaluation(problem, a, ev, pricer, regions, tables, planner="cpsat",
                                    proven=proven)
    t = time.perf_counter()
    unbalanced, a, ev, balanced_by = balanced_plan(problem, pricer, a, ev)
    clock["balance"] = time.perf_counter() - t
    t = time.perf_counter()
    unsent = ev
    a, ev, sent = _sent(problem, pricer, a, ev)
    clock["spread_sends"] = time.perf_counter() - t
    wall_stopped = res.wall_stopped or bool(coarse and coarse.wall_stopped)
    if res.solution is None and coarse is not None and coarse.solution is not None:
        res = coarse  # the status, objective and bound of the model that found a plan
    notes: list[str] = [
        f"parallelize: WARNING {c}; the plan is {source}'s (the best of the planners that "
        "ran); CP-SAT runs in a child process so the compile goes on" for c in crashes]
    gap = None
    if res.objective_s and res.bound_s is not None:
        gap = max(0.0, (res.objective_s - res.bound_s) / res.objective_s)
    figures = CpsatFigures(
        kept=source,
        objective_ms=_round(res.objective_s and 1e3 * res.objective_s),
        bound_ms=_round(res.bound_s and 1e3 * res.bound_s),
        gap=_round(gap),
        greedy_step_ms=_round(g_ev.step_ms) if g_ev.feasible else None,
        naive_step_ms=_round(n_ev.step_ms) if n_ev.feasible else None,
        deterministic_seconds=_round(
            res.deterministic_s + (coarse.deterministic_s if coarse else 0.0), 3),
        time_limit_s=problem.budget_s,
        gap_limit=problem.settings.gap_limit,
        workers=problem.settings.workers,
        seed=problem.settings.seed,
        bin_size=layout.bin_size,
        coarse_status=coarse.status if coarse else None,
        variables=res.variables,
        constraints=res.constraints,
        crashed=bool(crashes),
        balanced_max_gb=round(res.balanced[1] * cpsat.MEM_UNIT_B / 1e9, 3)
        if res.balanced else None,
        balance_tolerance=problem.settings.balance_tolerance,
        balance_ratio=problem.settings.balance_ratio,
        balance_cap_tolerance=problem.settings.balance_cap_tolerance,
        balanced_by=balanced_by,
        unbalanced_step_ms=_round(unbalanced.step_ms) if unbalanced else None,
        unbalanced_max_gb=round(float(unbalanced.memory.max()) / 1e9, 3)
        if unbalanced else None,
        max_rank_sends_mb=round(float(ev.out.max(initial=0.0)) / 1e6, 3),
        unspread_max_rank_sends_mb=round(float(unsent.out.max(initial=0.0)) / 1e6, 3)
        if sent else None,
    )
    report = PlannerReport("cpsat", len(regions), len(tables), res.status,
                           _round(ev.step_ms), figures, **_memory_figures(ev))
    if wall_stopped:
        notes.append("parallelize: CP-SAT was stopped by the wall-clock safety net "
                     f"({problem.settings.wall_limit_factor:g} x its budget, at least "
                     f"{problem.settings.wall_limit_min_s:g} s), not by its "
                     "deterministic budget: compiling again may give another plan")
    if res.status == "feasible":
        notes.append(f"parallelize: CP-SAT stopped at its time limit; its best solution is "
                     f"{100 * (gap or 0):.1f}% above the model's bound (--time-limit to search "
                     "longer)")
    elif res.status in ("unknown", "infeasible") and not res.crash:
        why = ("found no solution in its time limit" if res.status == "unknown" else
               "found its model infeasible (multi-rank bins keep a packing slack)")
        notes.append(f"parallelize: CP-SAT {why}; the plan is {source}'s")
    elif source not in ("cpsat", "coarse", "cpsat+search", "coarse+search"):
        notes.append(f"parallelize: {source}'s plan predicts faster than CP-SAT's expanded "
                     f"solution; the plan is {source}'s")
    return PlannerResult("cpsat", a, ev, report, time.perf_counter() - start, notes,
                         table_costs(problem, a, pricer), clock)


__all__ = ["PLANNERS", "CpsatFigures", "PlanInfeasibleError", "PlannerReport", "PlannerResult",
           "balanced_plan", "cap_search", "run_planner"]

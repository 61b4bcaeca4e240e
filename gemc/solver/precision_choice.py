"""Each table's storage precision, decided with its sharding under the memory cap.

A table stored bf16 or fp8 (gemc.table_precision) takes a half or a quarter of the bytes,
which changes which shardings fit and where; so the precision is not picked before the
sharding nor after it: every precision assignment considered here is planned in full (the
planner places every table at that precision under the cap) and the rule below picks among
the planned results. The precision is an attribute of the problem's tables
(``TableCost.precision``); the candidates price it (weights + state bytes, lookup bytes),
the planners stay as they are.

The rule (``--table-precision``), quality first:

``fp32`` (default)
    every table fp32.
``bf16`` / ``fp8``
    the lowest precision the user allows. Every table is planned at each allowed level
    (fp32, bf16, and fp8 if allowed) and the fastest plan that fits is kept; a plan within
    ``TIE`` of a higher-precision one loses to it (precision is not spent for noise).
``auto``
    fp32 where it fits. Otherwise the fewest tables are lowered, largest first (they free
    the most bytes per table lowered): the smallest ``k`` such that the ``k`` largest
    tables at bf16 fit, found by bisection (fitting is monotone in ``k`` up to the
    planner's heuristics: lowering one more table only frees memory); if every table at
    bf16 does not fit, the same over fp8 with the rest at bf16. Lower precision is never
    chosen for speed alone under ``auto``.

Every table's entry in the plan carries its precision and the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gemc.table_precision import TABLE_PRECISIONS

from .infeasible import PlanInfeasibleError
from .planners import PlannerResult, run_planner
from .problem import Problem

TABLE_PRECISION_MODES = (*TABLE_PRECISIONS, "auto")
TIE = 0.01  # a lower precision must predict > 1% faster to be chosen for speed


@dataclass
class PrecisionResult:
    result: PlannerResult
    precision: dict[str, str]   # fqn -> fp32 / bf16 / fp8
    reason: dict[str, str]      # fqn -> why


def with_precisions(problem: Problem, precision: dict[str, str]) -> Problem:
    """The problem with each table at ``precision[fqn]`` (fp32 where not named)."""
    return replace(problem, tables=tuple(replace(t, precision=precision.get(t.fqn, "fp32"))
                                         for t in problem.tables))


def plan_with_table_precision(problem: Problem, mode: str | None, planner: str,
                              run: Callable[[Problem, str], PlannerResult] = run_planner,
                              ) -> PrecisionResult:
    """Plan ``problem`` with every table's storage precision chosen by ``mode``'s rule."""
    mode = mode or "fp32"
    if mode not in TABLE_PRECISION_MODES:
        raise ValueError(f"table precision must be one of {TABLE_PRECISION_MODES}, "
                         f"got {mode!r}")
    fqns = [t.fqn for t in problem.tables]
    if mode == "auto":
        return _auto(problem, planner, run)
    allowed = TABLE_PRECISIONS[: TABLE_PRECISIONS.index(mode) + 1]
    planned: list[tuple[str, PlannerResult]] = []
    failures: dict[str, PlanInfeasibleError] = {}
    for level in allowed:
        try:
            planned.append((level, run(with_precisions(problem, dict.fromkeys(fqns, level)),
                                       planner)))
        except PlanInfeasibleError as exc:
            failures[level] = exc
    if not planned:
        exc = failures[allowed[-1]]
        if mode == "fp32" and problem.tables:  # the lever this module adds, named
            raise PlanInfeasibleError(
                exc.what, exc.where,
                f"{exc.fix + '; or ' if exc.fix else ''}store the tables narrower: "
                "--table-precision auto (bf16 / fp8 only where needed to fit)") from None
        raise exc
    best_level, best = planned[0]
    for level, res in planned[1:]:
        if res.evaluation.step_s < best.evaluation.step_s * (1 - TIE):
            best_level, best = level, res
    times = ", ".join(f"{lv} {res.evaluation.step_ms:.3f} ms" for lv, res in planned)
    if best_level == "fp32":
        why = f"fp32: fastest of the levels --table-precision {mode} allows ({times})"
    elif "fp32" in failures:
        why = (f"{best_level}: fp32 tables do not fit in memory; --table-precision {mode} "
               f"allows {best_level} ({times})")
    else:
        why = (f"{best_level}: --table-precision {mode} allows it and it is predicted more "
               f"than {TIE:.0%} faster ({times})")
    return PrecisionResult(best, dict.fromkeys(fqns, best_level), dict.fromkeys(fqns, why))


def _auto(problem: Problem, planner: str,
          run: Callable[[Problem, str], PlannerResult]) -> PrecisionResult:
    fqns = [t.fqn for t in problem.tables]
    try:
        res = run(with_precisions(problem, {}), planner)
        return PrecisionResult(res, dict.fromkeys(fqns, "fp32"),
                               dict.fromkeys(fqns, "fp32: the plan fits at full precision"))
    except PlanInfeasibleError as exc:
        fp32_error = exc
    # largest first: the most bytes freed per table lowered
    order = [t.fqn for t in sorted(problem.tables,
                                   key=lambda t: (-t.rows * t.dim * t.dtype_bytes, t.fqn))]
    base: dict[str, str] = {}
    last: PlanInfeasibleError = fp32_error
    for level in ("bf16", "fp8"):
        tried: dict[int, PlannerResult | None] = {}

        def attempt(k: int, level: str = level, base: dict[str, str] = base,
                    tried: dict[int, PlannerResult | None] = tried) -> PlannerResult | None:
            nonlocal last
            if k not in tried:
                precision = {**base, **dict.fromkeys(order[:k], level)}
                try:
                    tried[k] = run(with_precisions(problem, precision), planner)
                except PlanInfeasibleError as exc:
                    last, tried[k] = exc, None
            return tried[k]

        if attempt(len(order)) is None:
            base = dict.fromkeys(order, level)
            continue
        lo, hi = 0, len(order)  # lo: known not to fit (0 lowered: the previous level's)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if attempt(mid) is None:
                lo = mid
            else:
                hi = mid
        result = tried[hi]
        assert result is not None
        lowered = order[:hi]
        precision = {**dict.fromkeys(fqns, "fp32"), **base, **dict.fromkeys(lowered, level)}
        prev = "fp32" if level == "bf16" else "bf16"
        reason: dict[str, str] = {}
        for fqn in fqns:
            if fqn in lowered:
                reason[fqn] = (f"{level}: needed to fit in memory (with every table {prev} no "
                               f"plan fits; the {hi} largest of {len(fqns)} tables lowered "
                               f"to {level} fit, {hi - 1} do not)")
            elif precision[fqn] == "bf16":
                reason[fqn] = "bf16: needed to fit (no plan fits with every table fp32)"
            else:
                reason[fqn] = (f"fp32: the plan fits with only the {hi} largest tables "
                               f"lowered")
        return PrecisionResult(result, precision, reason)
    raise last

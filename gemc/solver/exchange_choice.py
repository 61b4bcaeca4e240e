"""The pooled exchange's wire precision, chosen with the plan (``--exchange-precision``).

A sharded table's pooled rows cross ranks forward and their gradients backward; sent bf16
or fp8 (gemc.exchange_precision) they take a half or about a quarter of the bytes, at the
price of the cast kernels and of rounding. The step model prices both
(``StepOptions.exchange``: the wire's bytes in the all-to-all, the casts' HBM bytes and
launches), so the planners see a cheaper exchange and may shard differently for it.

The rule:

``fp32`` (default) / ``bf16`` / ``fp8``
    fixed by the user; the plan is made with the exchange priced at it. fp8 sends the
    gradients back bf16 (gemc.exchange_precision.backward_of says why).
``auto``
    quality first, then speed. A lower precision is a candidate only when the SQNR of its
    cast and back on representative rows of the model's widest table meets
    ``MIN_SQNR_DB`` (bf16 40 dB, fp8 25 dB; its backward's too). The plan made at fp32 is
    priced at each candidate, and one is chosen only where it predicts the step more than
    ``TIE`` faster than the last kept (bf16 over fp32, then fp8 over that): on one host
    the casts usually cost what NVLink saves, across hosts the network bytes dominate.
    The planner then runs again at the chosen precision (cheaper rows can change which
    sharding wins) and the faster of the two plans at that precision is kept.

The plan's ``exchange`` block records the forward and backward precision, the reason, the
measured SQNRs and the step the planner predicts at each precision considered
(``solver_step_ms``: its step model, without the plan's activation and host terms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gemc.exchange_codec import representative_sqnr_db
from gemc.exchange_precision import (
    EXCHANGE_MODES,
    EXCHANGE_PRECISIONS,
    MIN_SQNR_DB,
    WirePrecision,
    fixed_exchange,
)

from .evaluate import Pricer, evaluate
from .infeasible import PlanInfeasibleError
from .planners import PlannerResult, run_planner, table_costs
from .problem import Problem

TIE = 0.01  # a lower precision must predict > 1% faster than the one it replaces


def with_exchange(problem: Problem, wire: WirePrecision) -> Problem:
    return replace(problem, options=replace(problem.options, exchange=wire))


def _repriced(result: PlannerResult, problem: Problem) -> PlannerResult:
    """``result``'s assignment priced under ``problem`` (another exchange precision)."""
    pricer = Pricer(problem)
    ev = evaluate(problem, result.assignment, pricer)
    summary = replace(result.summary, predicted_step_ms=round(ev.step_ms, 6))
    return replace(result, evaluation=ev, summary=summary,
                   table_cost=table_costs(problem, result.assignment, pricer))


def measured_sqnr(problem: Problem) -> dict[str, float]:
    """SQNR (dB) of each lower wire precision on representative rows as wide as the
    model's widest table (rowwise fp8 loses a little with width; bf16 does not care)."""
    dim = max((t.dim for t in problem.tables), default=1)
    return {p: round(representative_sqnr_db(p, dim), 2) for p in EXCHANGE_PRECISIONS
            if p != "fp32"}


def plan_with_exchange(problem: Problem, mode: str | None, planner: str,
                       run: Callable[[Problem, str], PlannerResult] = run_planner
                       ) -> PlannerResult:
    """Plan ``problem`` with the exchange precision ``mode``'s rule picks; the choice is
    the result's ``summary.exchange``."""
    mode = mode or "fp32"
    if mode not in EXCHANGE_MODES:
        raise ValueError(f"exchange precision must be one of {EXCHANGE_MODES}, got {mode!r}")
    if mode != "auto":
        result = run(with_exchange(problem, WirePrecision.of(mode)), planner)
        return replace(result, summary=replace(result.summary, exchange=fixed_exchange(mode)))
    sqnr = measured_sqnr(problem)
    base = run(with_exchange(problem, WirePrecision()), planner)
    steps = {"fp32": base.evaluation.step_s}
    kept, notes = "fp32", []
    for level in ("bf16", "fp8"):
        wire = WirePrecision.of(level)
        short = [f"{p} {sqnr[p]:.1f} dB < {MIN_SQNR_DB[p]:.0f} dB"
                 for p in sorted({wire.forward, wire.backward}) if sqnr[p] < MIN_SQNR_DB[p]]
        if short:
            notes.append(f"{level} not taken: SQNR {', '.join(short)}")
            continue
        steps[level] = _repriced(base, with_exchange(problem, wire)).evaluation.step_s
        if steps[level] < steps[kept] * (1 - TIE):
            kept = level
        else:
            notes.append(f"{level} not taken: predicts {1e3 * steps[level]:.3f} ms, not "
                         f"{TIE:.0%} under {kept}'s {1e3 * steps[kept]:.3f} ms")
    times = ", ".join(f"{p} {1e3 * s:.3f} ms" for p, s in steps.items())
    if kept == "fp32":
        return _recorded(base, WirePrecision(),
                         f"fp32: no lower precision pays ({'; '.join(notes)})", steps, sqnr)
    wire = WirePrecision.of(kept)
    chosen = _repriced(base, with_exchange(problem, wire))
    try:
        again = run(with_exchange(problem, wire), planner)
        if again.evaluation.step_s < chosen.evaluation.step_s:
            chosen = again
            steps[f"{kept} (re-planned)"] = again.evaluation.step_s
    except PlanInfeasibleError:  # the fp32 plan fits and is priced at the same precision
        pass
    why = (f"{kept}: SQNR {sqnr[kept]:.1f} dB meets {MIN_SQNR_DB[kept]:.0f} dB and the plan "
           f"predicts more than {TIE:.0%} faster ({times})"
           + (f"; {'; '.join(notes)}" if notes else ""))
    return _recorded(chosen, wire, why, steps, sqnr)


def _recorded(result: PlannerResult, wire: WirePrecision, why: str,
              steps: dict[str, float], sqnr: dict[str, float] | None = None) -> PlannerResult:
    block: dict[str, Any] = {"forward": wire.forward, "backward": wire.backward,
                             "reason": why}
    if steps:
        block["solver_step_ms"] = {p: round(1e3 * s, 6) for p, s in steps.items()}
    if sqnr:
        block["sqnr_db"] = sqnr
    return replace(result, summary=replace(result.summary, exchange=block))

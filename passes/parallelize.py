"""parallelize: choose every dense region's strategy and every table's sharding and ranks.

The solver pass. It reads the annotated graph (kinds, regions, tables, the cost model's
per-node times from predict-time) into a planning problem, runs the planner named by
``planner`` (``cpsat``, the default, or the ``greedy`` / ``naive`` baselines; see
``gemc.solver``) and writes ``gemc.placement`` exactly as place-default does, so the plan
builder and ``gemc.costing`` need nothing new. The planner's report (status, objective,
bound, gap: a typed ``gemc.solver.planners.PlannerReport``) goes to
``gm.meta["gemc.solver"]`` and from there into the plan.

Its options are its dataclass fields, which the driver sets from the compile's
``CompileConfig`` (``CompileConfig.placement_pass``): ``solver`` (``SolverSettings``;
``settings_from`` turns the user's mapping of field names, e.g. ``{"time_limit_s": 10}``,
into one, naming a bad one), ``table_optimizer`` (one of ``gemc.plan.TABLE_OPTIMIZERS``,
``auto``, or None: the runner's default), and the two below. A problem no plan can fit
ends in ``PlanInfeasibleError`` (a GemcUserError: exit 2).

``table_precision`` (fp32 | bf16 | fp8 | auto) lets the tables' storage precision be
chosen with their sharding (``gemc.solver.precision_choice``); each table's placement then
carries ``precision`` and ``precision_reason`` into the plan.

``exchange_precision`` (fp32 | bf16 | fp8 | auto) sets or lets the planner choose the
pooled exchange's wire precision (``gemc.solver.exchange_choice``), under each table
precision tried; the choice goes to ``gm.meta["gemc.exchange"]`` (the plan's ``exchange``
block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from gemc.cost_model.types import StepOptions
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.errors import GemcUserError
from gemc.solver.exchange_choice import plan_with_exchange
from gemc.solver.planners import PLANNERS, PlanInfeasibleError, PlannerResult
from gemc.solver.precision_choice import PrecisionResult, plan_with_table_precision
from gemc.solver.problem import Problem, SolverSettings, apply_assignment, problem_from_graph

SOLVER_META = "gemc.solver"  # gm.meta key: the planner's report, copied into the plan
TABLE_OPTIMIZER_META = ir.TABLE_OPTIMIZER  # gm.meta key: the table optimizer priced
EXCHANGE_META = "gemc.exchange"  # gm.meta key: the exchange precision chosen, and why


def step_options(table_optimizer: str | None) -> StepOptions:
    """The step model's options for a table optimizer (None: the model's default,
    ``StepOptions.table_optimizer``, which is the runner's default, row-wise Adagrad)."""
    return StepOptions() if table_optimizer is None else StepOptions(
        table_optimizer=table_optimizer)


def settings_from(options: dict[str, Any] | None) -> SolverSettings:
    """SolverSettings from user options; unknown or bad values are the user's to fix."""
    options = dict(options or {})
    known = {f.name for f in fields(SolverSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise GemcUserError(f"unknown solver option(s) {', '.join(unknown)}",
                            where="solver options", fix=f"use only {', '.join(sorted(known))}")
    try:
        return SolverSettings(**options)
    except (TypeError, ValueError) as exc:
        raise GemcUserError(f"bad solver option: {exc}", where="solver options",
                            fix="e.g. --time-limit 10 (seconds > 0)") from None


def plan_with_table_optimizer(build: Callable[[str | None], Problem], wanted: str | None,
                              planner: str, table_precision: str | None = None,
                              exchange_precision: str | None = None,
                              ) -> tuple[str | None, PrecisionResult]:
    """(the table optimizer priced, the planner's result with each table's precision).
    ``auto``: Adam (two moments per element) where a plan fits, else row-wise Adagrad (one
    value per row), the optimizer DLRMv2 trains with; an error names the last one tried.
    Under each optimizer the tables' precision follows ``table_precision``'s rule, and
    every plan tried has its exchange precision by ``exchange_precision``'s."""
    tries: list[str | None] = ["adam", "rowwise_adagrad"] if wanted == "auto" else [wanted]

    def run(problem: Problem, name: str) -> PlannerResult:
        return plan_with_exchange(problem, exchange_precision, name)

    for i, opt in enumerate(tries):
        try:
            return opt, plan_with_table_precision(build(opt), table_precision, planner, run)
        except PlanInfeasibleError:
            if i + 1 == len(tries):
                raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Parallelize:
    """Annotates ``gemc.placement`` on compute and embedding nodes."""

    name: ClassVar[str] = "parallelize"
    requires: ClassVar[tuple[str, ...]] = (
        "classify-ops", "collect-tables", "assign-regions", "predict-time")
    planner: str = "cpsat"
    solver: SolverSettings = field(default_factory=SolverSettings)
    table_optimizer: str | None = None
    table_precision: str | None = None
    exchange_precision: str | None = None

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"unknown planner {self.planner!r}; known: {', '.join(PLANNERS)}")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.topology is None:
            raise ValueError("parallelize needs ctx.topology")
        opt, chosen = plan_with_table_optimizer(
            lambda o: problem_from_graph(gm, ctx, self.solver, step_options(o)),
            self.table_optimizer, self.planner, self.table_precision,
            self.exchange_precision)
        result = chosen.result
        gm.meta[EXCHANGE_META] = result.summary.exchange  # the plan's own exchange block
        # recorded even when not asked for: the plan states what it priced, so the runner
        # runs that and not its own default (tests hold the two defaults equal)
        opt = opt or step_options(None).table_optimizer
        gm.meta[TABLE_OPTIMIZER_META] = opt
        apply_assignment(gm, result.assignment, result.table_cost)
        for node in gm.graph.nodes:
            facts = node.meta.get(ir.TABLE)
            if facts is not None:
                node.meta[ir.PLACEMENT]["precision"] = chosen.precision[facts["fqn"]]
                node.meta[ir.PLACEMENT]["precision_reason"] = chosen.reason[facts["fqn"]]
        gm.meta[SOLVER_META] = replace(result.summary, exchange=None, table_optimizer=opt)
        for note in result.notes:
            ctx.warn(note)
        return PassResult(gm, True)

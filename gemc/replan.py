"""Plan an already captured and annotated graph again, for another topology or planner.

Capture is the slow part of a compile at GEM scale (about a minute on a small machine);
the planners only need the annotated graph. The solver benchmark and the tests capture a
model once and call this per (topology, planner): the last two passes of
``gemc.compile``'s pipeline, the placement pass and emit-plan (the plan builder and the
``predicted`` block), run by the same pass manager, so the plan is the one a compile
writes.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import fx

from gemc.api import pass_context
from gemc.capture import Captured
from gemc.context import PassContext
from gemc.cost_model.topology import Topology
from gemc.pass_manager import PassManager
from gemc.passes.parallelize import settings_from
from gemc.passes.precision import PrecisionOptions
from gemc.pipeline import placement_pass, planning_passes
from gemc.plan import validate_plan
from gemc.plan_builder import EmitPlan, take_plan


def annotate(captured: Captured, topology: Topology, *, entrypoint: str,
             args: dict[str, Any] | None = None, calibration: Any = None,
             precision: PrecisionOptions | None = None
             ) -> tuple[fx.GraphModule, PassContext]:
    """Every pass of the default pipeline before the placement (op times and precisions
    depend on the GPU, not on the mesh)."""
    ctx = pass_context(entrypoint, dict(args or {}), captured, topology)
    ctx.calibration = calibration
    gm = PassManager(planning_passes(precision=precision)[:-1]).run(captured.gm, ctx)
    return gm, ctx


def replan(gm: fx.GraphModule, ctx: PassContext, captured: Captured, topology: Topology,
           planner: str, solver: dict[str, Any] | None = None, *,
           table_optimizer: str | None = None, table_precision: str | None = None,
           exchange_precision: str | None = None,
           ) -> tuple[dict[str, Any], dict[str, float]]:
    """(validated plan, wall seconds of the placement pass and of the plan's emission with
    its prediction). ``solver`` and the keywords are the compile's options of the same
    names (``CompileConfig``); ``captured`` is the capture ``ctx`` was made from."""
    ctx = copy.copy(ctx)
    ctx.topology, ctx.warnings = topology, []
    ctx.fingerprint = ctx.fingerprint or captured.fingerprint
    ctx.batch_size = ctx.batch_size or captured.batch_size
    manager = PassManager([
        placement_pass(planner, settings_from(solver), table_optimizer, table_precision,
                       exchange_precision),
        EmitPlan(planner, table_optimizer, exchange_precision)])
    gm = manager.run(gm, ctx)
    plan = take_plan(gm)
    validate_plan(plan, source="replan")
    gm.meta.pop("gemc.solver", None)  # the next planner writes its own report
    placed, emitted = (r.seconds for r in manager.records[1:])
    return plan, {"plan": placed, "predict": emitted}

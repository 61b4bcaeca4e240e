"""The public Python API: ``gemc.compile`` and friends."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import fx

from gemc.capture import Captured, capture
from gemc.context import PassContext
from gemc.entrypoint import build_spec, load_entrypoint
from gemc.errors import GemcUserError
from gemc.pass_manager import PassManager
from gemc.pipeline import annotation_passes, default_pipeline
from gemc.plan import PLANNERS, TABLE_OPTIMIZERS, write_plan
from gemc.plan_builder import build_plan
from gemc.spec import BATCH_SIZE_MISSING, ModelSpec, batch_size_of


def load_model(
    entrypoint: str, args: dict[str, Any] | None = None, *, device: str = "meta"
) -> ModelSpec:
    """Build a user's model through its entrypoint (on the meta device by default)."""
    return build_spec(
        load_entrypoint(entrypoint), dict(args or {}), entrypoint=entrypoint, device=device
    )


def _context(
    entrypoint: str, args: dict[str, Any], captured: Captured, topology: Any
) -> PassContext:
    return PassContext(
        entrypoint=entrypoint,
        args=dict(args),
        param_fqns=captured.param_fqns,
        param_shapes=captured.param_shapes,
        param_dtypes=captured.param_dtypes,
        topology=topology,
    )


def annotate_model(
    spec: ModelSpec, topology: Any = None, *, entrypoint: str = "model"
) -> fx.GraphModule:
    """Capture and annotate (kind, FLOPs, bytes, region, tables) without planning."""
    captured = capture(spec, entrypoint=entrypoint)
    ctx = _context(entrypoint, {}, captured, topology)
    return PassManager(annotation_passes()).run(captured.gm, ctx)


def _calibration(choice: str | None, gpu_name: str) -> Any:
    from gemc.cost_model.calibration import default_calibration, load_calibration

    if choice is None or choice == "none":
        return None
    if choice == "auto":
        return default_calibration(gpu_name)
    return load_calibration(choice)


def compile(  # noqa: A001 - the public name users expect
    entrypoint: str,
    args: dict[str, Any] | None = None,
    *,
    topology: str = "h200:1x8",
    out: str | Path | None = None,
    dump_dir: str | Path | None = None,
    dump_mode: str = "all",
    disabled_passes: Sequence[str] = (),
    planner: str = "default",
    calibration: str | None = "auto",
    solver: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    table_optimizer: str | None = None,
) -> dict[str, Any]:
    """Compile a model entrypoint into a validated plan (and write it to ``out``).

    ``calibration``: "auto" (the file gemc ships for the topology's GPU, if any), a path
    to a file written by ``gemc calibrate``, or None (roofline only).
    ``planner``: cpsat (the CP-SAT solver), greedy, naive, or default (place-default);
    ``solver``: the planners' settings (``gemc.solver.problem.SolverSettings`` fields, e.g.
    ``{"time_limit_s": 10}``).
    ``table_optimizer``: one of ``gemc.plan.TABLE_OPTIMIZERS`` or "auto" (the planner picks
    adam where it fits, else rowwise_adagrad); priced, written to the plan's
    ``optimizer.embedding.kind`` and run by the runner. None: the runner's default
    (``StepOptions.table_optimizer``, row-wise Adagrad), priced and recorded the same way.
    """
    from gemc.cost_model.topology import parse_topology
    from gemc.costing import predicted_block
    from gemc.passes.parallelize import TABLE_OPTIMIZER_META, step_options

    if planner not in PLANNERS:
        raise GemcUserError(f"unknown planner {planner!r}", where="planner",
                            fix=f"use one of: {', '.join(PLANNERS)}")
    args = dict(args or {})
    topo = parse_topology(topology)
    calib = _calibration(calibration, topo.gpu.name)
    manager = PassManager(
        default_pipeline(planner),
        disabled=tuple(disabled_passes),
        dump_dir=Path(dump_dir) if dump_dir is not None else None,
        dump_mode=dump_mode,
        progress=progress,
    )
    if progress:
        progress("build model")
    spec = load_model(entrypoint, args)
    if progress:
        progress("capture")
    start = time.perf_counter()
    captured = capture(spec, entrypoint=entrypoint)
    ctx = _context(entrypoint, args, captured, topo)
    ctx.calibration = calib
    ctx.options["solver"] = dict(solver or {})
    if table_optimizer is not None:
        if table_optimizer not in (*TABLE_OPTIMIZERS, "auto"):
            raise GemcUserError(f"unknown table optimizer {table_optimizer!r}",
                                where="table_optimizer",
                                fix=f"use one of: {', '.join((*TABLE_OPTIMIZERS, 'auto'))}")
        ctx.options["table_optimizer"] = table_optimizer
    batch_size, _ = batch_size_of(spec)
    if batch_size is None:
        ctx.warn(BATCH_SIZE_MISSING)
    gm = manager.run(captured.gm, ctx, capture_seconds=time.perf_counter() - start)
    try:
        if progress:
            progress("predict step")
        plan = build_plan(gm, ctx, captured, planner=planner)
        plan["model"]["batch_size"] = batch_size  # stated by the model; null when not
        chosen = gm.meta.get(TABLE_OPTIMIZER_META) or (
            step_options(None).table_optimizer if table_optimizer in (None, "auto")
            else table_optimizer)
        plan["optimizer"] = {"embedding": {"kind": chosen}}
        if "predict-time" not in disabled_passes:
            plan["predicted"] = predicted_block(gm, plan["regions"], plan["tables"], topo, calib,
                                                step_options(chosen))
        if dump_dir is not None:
            _write_kernel_sources(plan, Path(dump_dir))
        if dump_dir is not None and dump_mode != "failure":
            _dump_for_report(gm, plan, Path(dump_dir), progress)
    except KeyboardInterrupt:
        manager.interrupted("plan emission and the report dumps, after every pass")
        raise
    if out is not None:  # last: an interrupted compile never leaves a plan behind
        write_plan(out, plan)
    return plan


def _dump_for_report(
    gm: fx.GraphModule, plan: dict[str, Any], dump_dir: Path, progress: Callable[[str], None] | None
) -> None:
    """Besides the pass dumps: the plan (``gemc report DUMP_DIR`` reads it from there) and
    the graph as MLIR. The MLIR export never fails a compile: torch-mlir is optional, and
    an op it cannot lower is listed in ``mlir/unsupported.txt``."""
    from gemc.backends.mlir.export import dump_mlir

    status = dump_mlir(gm, dump_dir, progress)
    if progress:
        progress(status)
    # after the export: an interrupt there leaves none. A copy of the model section: the
    # dump's plan names the model file from the dump folder, the returned plan (and --out)
    # from theirs (write_plan locates the model in the plan it is given)
    write_plan(dump_dir / "plan.json", {**plan, "model": dict(plan["model"])})


def _write_kernel_sources(plan: dict[str, Any], dump_dir: Path) -> None:
    """``D/kernels/<sha>.py``: each generated source once, as the plan's entries name it."""
    from gemc.dump import write_atomic

    for entry in plan["kernels"]:
        if entry.get("code") is not None:
            write_atomic(dump_dir / entry["file"], entry["code"])

"""The public Python API: ``gemc.compile`` and friends."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import fx

from gemc import probe, shape_stability
from gemc.capture import Captured, capture, frozen_draws_warning
from gemc.config import CompileConfig
from gemc.context import PassContext
from gemc.entrypoint import load_model
from gemc.pass_manager import PassManager
from gemc.pipeline import annotation_passes
from gemc.plan import write_plan
from gemc.plan_builder import take_plan
from gemc.spec import BATCH_SIZE_MISSING, ModelSpec


def pass_context(
    entrypoint: str, args: dict[str, Any], captured: Captured, topology: Any
) -> PassContext:
    """The context a compile's passes read (also what gemc.replan and tests build)."""
    return PassContext(
        entrypoint=entrypoint,
        args=dict(args),
        param_fqns=captured.param_fqns,
        param_shapes=captured.param_shapes,
        param_dtypes=captured.param_dtypes,
        param_aliases=captured.param_aliases,
        constant_fqns=captured.constant_fqns,
        fingerprint=captured.fingerprint,
        batch_size=captured.batch_size,
        topology=topology,
        precision_probe=probe.opener(entrypoint, args),
        sample_inputs=captured.example_inputs,
    )


def annotate_model(
    spec: ModelSpec, topology: Any = None, *, entrypoint: str = "model"
) -> fx.GraphModule:
    """Capture and annotate (kind, FLOPs, bytes, region, tables) without planning."""
    captured = capture(spec, entrypoint=entrypoint)
    ctx = pass_context(entrypoint, {}, captured, topology)
    return PassManager(annotation_passes()).run(captured.gm, ctx)


def resolve_calibration(choice: str | None, gpu_name: str) -> Any:
    from gemc.cost_model.calibration import default_calibration, load_calibration

    if choice is None or choice == "none":
        return None
    if choice == "auto":
        return default_calibration(gpu_name)
    return load_calibration(choice)


def compile(  # noqa: A001 - the public name users expect
    entrypoint: str,
    args: dict[str, Any] | None = None,
    config: CompileConfig | None = None,
    *,
    out: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Compile a model entrypoint into a validated plan (and write it to ``out``).

    ``config``: every compile option (:class:`gemc.config.CompileConfig`, what ``gemc
    compile`` builds from its flags); ``options``: CompileConfig fields overriding it, e.g.
    ``gemc.compile(entry, topology="h200:1x8", planner="cpsat")``.
    """
    from gemc.cost_model.topology import parse_topology

    config = (config or CompileConfig()).with_options(**options)
    config.validate()
    disabled_passes, dump_mode = config.disabled_passes, config.dump_mode
    dump_dir = Path(config.dump_dir) if config.dump_dir is not None else None
    args = dict(args or {})
    topo = parse_topology(config.topology)
    # the run's fp32 GEMM mode is priced through the GPU spec (GPUSpec.gemm_dtype)
    topo.gpu = replace(topo.gpu, fp32_matmul=config.fp32_matmul)
    calib = resolve_calibration(config.calibration, topo.gpu.name)
    manager = PassManager(
        config.pipeline(),
        disabled=disabled_passes,
        dump_dir=dump_dir,
        dump_mode=dump_mode,
        progress=progress,
    )
    if progress:
        progress("build model")
    spec = load_model(entrypoint, args)
    if progress:
        progress("capture")
    start = time.perf_counter()
    captured = capture(spec, entrypoint=entrypoint, host_randomness=config.host_randomness)
    # before the passes rewrite the graph: which inputs may change shape by step
    stability = shape_stability.check(spec, captured, lambda s: capture(
        s, entrypoint=entrypoint, host_randomness=config.host_randomness))
    ctx = pass_context(entrypoint, args, captured, topo)
    ctx.calibration = calib
    if captured.frozen_draws:
        ctx.warn(frozen_draws_warning(captured))
    for site in captured.bounded_sizes:
        ctx.warn(f"data-dependent size: {site}; the prediction assumes every sample is kept "
                 "and no fused kernel takes it")
    if captured.batch_size is None:
        ctx.warn(BATCH_SIZE_MISSING)
    gm = manager.run(captured.gm, ctx, capture_seconds=time.perf_counter() - start)
    plan = take_plan(gm)  # emit-plan's, the pipeline's last pass
    _record_varying_inputs(plan, stability)
    try:
        if dump_dir is not None:
            _write_kernel_sources(plan, dump_dir)
        if dump_dir is not None and dump_mode != "failure":
            _dump_for_report(gm, plan, dump_dir, progress)
    except KeyboardInterrupt:
        manager.interrupted("the report dumps, after every pass")
        raise
    if out is not None:  # last: an interrupted compile never leaves a plan behind
        write_plan(out, plan)
    return plan


# kernels that read their sizes from their inputs at run time (the batched lookup: ids and
# offsets), not from the example's shapes
_SIZED_AT_RUN_TIME = frozenset({"batched_embedding_bag"})


def _record_varying_inputs(plan: dict[str, Any],
                           stability: shape_stability.ShapeStability) -> None:
    """The plan's ``model.varying_inputs`` (batch inputs whose shapes may change by step in
    graph mode) or ``model.fixed_shapes`` (why every shape is the example's), where a later
    batch's shapes differ from the example's (gemc.shape_stability). A generated kernel over a node
    whose shape moves was specialised to the example's sizes: the shapes stay fixed."""
    if stability.inputs:
        sized = [str(k.get("name", k["kind"])) for k in plan.get("kernels", [])
                 if k["kind"] not in _SIZED_AT_RUN_TIME
                 and stability.nodes.intersection(k.get("nodes", []))]
        if not sized:
            plan["model"]["varying_inputs"] = list(stability.inputs)
            return
        plan["model"]["fixed_shapes"] = (
            f"kernel {sized[0]} was generated for the example's sizes of a node whose size "
            "follows the batch's")
    elif stability.held:
        plan["model"]["fixed_shapes"] = stability.held


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
    from gemc.atomic_write import write_atomic

    for entry in plan["kernels"]:
        if entry.get("code") is not None:
            write_atomic(dump_dir / entry["file"], entry["code"])

"""From a plan's regions and tables to the cost model's step prediction.

The one bridge between the plan document and ``cost_model.step_model.predict_step``:
the plan builder calls it for every planner, and the solver calls the same conversion, so
the prediction written in a plan is the one the planner optimised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import fx

from gemc import ir
from gemc.cost_model.activations import ActivationProfile, activation_profile
from gemc.cost_model.calibration import Calibration
from gemc.cost_model.inductor_fusion import runs_compiled
from gemc.cost_model.launches import GRAPH_LAUNCH_HOST_S, graph_launches, launch_bound_s
from gemc.cost_model.step_model import predict_step
from gemc.cost_model.topology import Topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost
from gemc.graph_summary import (
    RegionFacts,
    TableFacts,
    gradient_accumulation_ms,
    kernel_adjusted_ms,
)
from gemc.ir import OpKind

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1}


def region_boundary_bytes(gm: fx.GraphModule) -> dict[str, int]:
    """Bytes of the floating-point activations each region reads from outside itself.

    What activation checkpointing keeps of a region and what tensor parallelism gathers
    and scatters at its edges; without it both would look free to the solver. Views are
    followed to the tensor they alias; weights and integer inputs (ids) are not counted.
    """
    def base(node: fx.Node) -> fx.Node:
        while ir.kind_of(node) is ir.OpKind.VIEW and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    seen: dict[str, set[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or ir.kind_of(node) is ir.OpKind.VIEW:
            continue
        region = str(node.meta.get(ir.REGION, ""))
        for arg in node.all_input_nodes:
            src = base(arg)
            if src.meta.get(ir.PARAM) or ir.kind_of(src) is ir.OpKind.PARAM:
                continue
            if src.op != "placeholder" and src.meta.get(ir.REGION, "") == region:
                continue
            dtype = ir.dtype_of(src)
            if dtype is None or not dtype.is_floating_point:
                continue
            seen.setdefault(region, set()).add(src)
    return {region: sum(ir.nbytes(n) for n in nodes) for region, nodes in seen.items()}


def region_costs(regions: Sequence[RegionFacts], activations: Mapping[str, int],
                 boundaries: Mapping[str, int] | None = None) -> list[RegionCost]:
    """The cost model's ``RegionCost`` of each region's facts, with its saved
    ``activations`` and the activations it reads across its boundary (bytes by region)."""
    out = []
    for r in regions:
        out.append(
            RegionCost(
                name=r.name,
                params=r.params,
                fwd_flops=float(r.fwd_flops),
                compute_s=float(r.predicted_ms or 0.0) / 1e3,
                strategy=r.strategy,
                shard_group=int(r.shard_group or 0),
                param_bytes=max(1, r.param_bytes // r.params) if r.params else 4,
                activation_bytes=int(activations.get(r.name, 0)),
                boundary_bytes=int((boundaries or {}).get(r.name, 0)),
                checkpoint=bool(r.checkpoint),
            )
        )
    return out


def table_costs(tables: Sequence[TableFacts]) -> list[TableCost]:
    """The cost model's ``TableCost`` of each table's facts, as placed."""
    return [
        TableCost(
            fqn=t.fqn, rows=int(t.rows), dim=int(t.dim), nnz=int(t.nnz), batch=int(t.batch),
            sharding=t.sharding, ranks=t.ranks,
            dtype_bytes=_DTYPE_BYTES.get(t.dtype, 4), pooled=t.pooling != "none",
            precision=t.precision or "fp32", lookup=t.lookup, lookups=t.lookups,
            padded_nnz=t.padded_nnz, pad_ids=t.pad_ids, routed=t.routed,
            padding_row=t.padding_row,
            lookup_alive=t.lookup_alive_bytes, replicated_only=t.replicated_only,
            batch_fed=t.batch_fed,
        )
        for t in tables
    ]


def _dense_kind(node: fx.Node) -> str | None:
    """The fit kind a dense node's time counts under (None: not in a region's time, as
    graph_summary.region_summaries counts them)."""
    kind = ir.kind_of(node)
    if node.op != "call_function" or kind in (OpKind.VIEW, OpKind.EMBEDDING) \
            or node.meta.get(ir.TABLE) or node.meta.get(ir.PARAM) is not None:
        return None
    if kind is OpKind.GEMM:
        return "gemm"
    if kind is OpKind.ATTENTION:
        return "attention"
    return "memory"


def kind_breakdown_ms(gm: fx.GraphModule, breakdown_ms: Mapping[str, float]) -> dict[str, float]:
    """The predicted step split by the op kinds a run fit scales (calibration.FIT_KINDS):
    dense regions' node times by kind, then the step model's sparse, optimizer,
    communication and host parts. Sums to the step. Copied into the run report, it is
    what ``gemc calibrate --from-run`` regresses the measured step on."""
    out = dict.fromkeys(("gemm", "attention", "memory"), 0.0)
    for node, ms in kernel_adjusted_ms(gm).items():
        kind = _dense_kind(node)
        if kind is not None:
            out[kind] += ms
    out["memory"] += sum(gradient_accumulation_ms(gm).values())  # the backward's adds
    dense = breakdown_ms.get("dense_forward", 0.0) + breakdown_ms.get("dense_backward", 0.0)
    total = sum(out.values())
    if total > 0:  # checkpointed regions recompute their forward: keep the step's sum
        out = {k: v * dense / total for k, v in out.items()}
    out["embedding"] = breakdown_ms.get("sparse_compute", 0.0) + breakdown_ms.get(
        "exchange_cast", 0.0)
    out["optimizer"] = breakdown_ms.get("optimizer", 0.0)
    out["comm"] = sum(breakdown_ms.get(k, 0.0) for k in (
        "all_to_all", "input_dist", "exposed_forward_comm", "exposed_backward_comm", "tp_comm",
        "replica_all_reduce"))
    out["host"] = breakdown_ms.get("host", 0.0)
    return {k: round(v, 6) for k, v in out.items()}


# CPU seconds to issue one op's kernel from the runner when the calibration has no
# measurement (cost_model/eager.py's default for one eager op).
DEFAULT_OP_CPU_S = 8e-6


def kernel_launches(gm: fx.GraphModule) -> int:
    """Kernels one step launches, forward and backward: a fused group or a batched lookup
    once each way, any other compute node once forward and its backward's kernels
    (op_cost's counts: 2 for a GEMM, 3 for attention, ...); views launch nothing."""
    from gemc.cost_model.op_cost import BWD_KERNELS

    groups: set[str] = set()
    n = 0
    for node in gm.graph.nodes:
        kind = ir.kind_of(node)
        if node.op != "call_function" or kind in (None, OpKind.VIEW, OpKind.PARAM):
            continue
        gid = node.meta.get(ir.GROUP)
        if gid is not None:
            if gid not in groups:
                groups.add(gid)
                n += 2
            continue
        n += 1 + BWD_KERNELS.get(kind, 1)
    return n


def host_s(tables: Sequence[TableCost], topology: Topology, options: StepOptions,
           calibration: Calibration | None, *, launches: int = 0,
           device_s: float = 0.0, per_launch_s: float | None = None) -> float:
    """Exposed host time a step: the runner's syncs (plus the table exchange's two when
    tables are sharded over several ranks), each draining the queue the host then
    refills; and, when issuing the step's ``launches`` at ``per_launch_s`` each (default:
    the calibration's eager op, for an eager step) takes the CPU longer than the GPU takes
    to run them (``device_s``), the difference: a launch-bound step waits on the host
    (cost_model.launches.launch_bound_s). The sync term is checked against one run (GEM
    h200: 3 syncs, 3.9 ms of host-late idle); the launch term of a compiled step against
    two (cost_model.launches: Wukong and DCNv2 h200, both launch-bound)."""
    syncs = options.host_syncs
    if topology.world_size > 1 and any(not t.replicated for t in tables):
        syncs += options.exchange_host_syncs
    if per_launch_s is None:
        per_launch_s = (calibration.eager_op_s if calibration is not None else None) \
            or DEFAULT_OP_CPU_S
    launch_bound = launch_bound_s(launches, per_launch_s, device_s)
    factor = calibration.factor("host") if calibration is not None else 1.0
    return (syncs * options.host_sync_s + launch_bound) * factor


def per_call_syncs(gm: fx.GraphModule) -> int:
    """Host syncs the graph's guarded attention kernels make a step: one a forward call
    (``key_padding_attention``'s check, its four integers read by the host), for each
    guarded kernel not run on a packed region's tokens (there the region's one check ahead
    of the graph decides). Why: each drains the GPU queue as the runner's own syncs do
    (``StepOptions.host_sync_s``); unpriced, a plan that keeps a guarded kernel looked as
    cheap as one that gives it to SDPA, which ``passes/attention_choice`` does for that
    sync (``attention_fit.GEMC_GUARDED_CALL_HOST_S``: 1.64 ms exposed a call, TransAct's row
    on the session-25 H100, against the 1.3 ms a sync this term uses)."""
    in_place = {name for n in gm.graph.nodes
                if isinstance(f := n.meta.get(ir.PACKED_REGION), dict)
                for name in f.get("in_place") or ()}
    return sum(1 for n in gm.graph.nodes
               if isinstance(f := n.meta.get(ir.KERNEL), dict) and f.get("mask")
               and "attention" in str(f.get("kind", "")) and ir.PACKED not in n.meta
               and n.name not in in_place)


def with_call_syncs(gm: fx.GraphModule, options: StepOptions) -> StepOptions:
    """``options`` with the graph's :func:`per_call_syncs` added to its host syncs."""
    return replace(options, host_syncs=options.host_syncs + per_call_syncs(gm))


def step_launches(gm: fx.GraphModule, tables: Sequence[TableCost],
                  calibration: Calibration | None, world: int = 1
                  ) -> tuple[dict[str, int], float]:
    """(launches by source with their ``total``, host seconds per launch) of the step the
    runner executes: a compiled step counted as Inductor, cuBLAS, gemc's kernels and the
    eager ops around the graph launch it (cost_model.launches.graph_launches) at the
    fitted graph-mode cost; an eager step (module mode on several ranks) op by op
    (:func:`kernel_launches`) at the calibration's eager op."""
    if runs_compiled(gm):
        per = (calibration.graph_launch_s if calibration is not None else None) \
            or GRAPH_LAUNCH_HOST_S
        return graph_launches(gm, tables, world), float(per)
    per = (calibration.eager_op_s if calibration is not None else None) or DEFAULT_OP_CPU_S
    return {"total": kernel_launches(gm)}, float(per)


def guarded_fills(gm: fx.GraphModule) -> dict[str, dict[str, Any]]:
    """Region id -> the fill each guarded packed region is priced at and where it came
    from (``fill_source``: "sample batch", or why padded), its sample's real tokens and
    the share of the padded scores its attentions compute. In the prediction because the
    fill is data: a user whose batches are fuller or emptier than the example's sees what
    the step was priced at (gemc.guard_sample)."""
    keys = ("fill", "attention_fill", "fill_source", "sample_tokens")
    return {rid: {k: f[k] for k in keys if k in f}
            for rid, f in ir.packed_regions(gm).items() if f.get("guard")}


@dataclass(frozen=True)
class PricedActivations:
    """The step's activations as both the planner and the plan's ``predicted`` block price
    them: each region's saved bytes, and the batch plus the liveness walk's transient peak
    (``activations.activation_profile``), which go to workspace, all but the batch scaled by
    the calibration's run-fitted ``activation_factor``. Why one object: the planner fitted
    plans against the saved bytes alone while the block added the rest, so a plan the
    planner fitted could predict its fullest rank over the cap (DLRM xl on 48 GPUs: 147.6
    GB predicted against the 140.5 GB fitted; BENCHMARKS.md, issue 21)."""

    profile: ActivationProfile
    factor: float
    saved: dict[str, int]   # region -> bytes kept for the backward
    workspace: int          # the batch + the transient peak above what is saved

    def options(self, options: StepOptions) -> StepOptions:
        """``options`` with this step's activation workspace added to its own."""
        return replace(options, workspace_bytes=int(options.workspace_bytes + self.workspace))


def priced_activations(gm: fx.GraphModule, calibration: Calibration | None
                       ) -> PricedActivations:
    """The graph's activations as the runner holds them (see :class:`PricedActivations`);
    computed once a graph: they do not depend on the strategies or shardings chosen."""
    profile = activation_profile(gm)
    factor = calibration.activation_factor if calibration is not None else 1.0
    return PricedActivations(
        profile=profile, factor=factor,
        saved={k: int(v * factor) for k, v in profile.saved.items()},
        workspace=int(profile.inputs + profile.transient * factor))


def predicted_block(
    gm: fx.GraphModule,
    regions: Sequence[RegionFacts],
    tables: Sequence[TableFacts],
    topology: Topology,
    calibration: Calibration | None,
    options: StepOptions | None = None,
) -> dict[str, Any]:
    """The plan's ``predicted`` block of the placed ``regions`` and ``tables`` (the facts
    the plan records): step ms, MFU, per-rank memory and time, priced as
    the runner executes the plan: activations at the autocast dtype and packed sizes
    with the forward's liveness peak (:func:`priced_activations`, as the planner fits
    them), the host's exposed syncs, and the run-fitted factors of the calibration."""
    acts = priced_activations(gm, calibration)
    profile, act_factor = acts.profile, acts.factor
    opts = with_call_syncs(gm, acts.options(options or StepOptions()))
    table_list = table_costs(tables)
    prediction = predict_step(
        region_costs(regions, acts.saved, region_boundary_bytes(gm)),
        table_list, topology,
        calibration=calibration, options=opts,
    )
    launches, per_launch = step_launches(gm, table_list, calibration, topology.world_size)
    host = host_s(table_list, topology, opts, calibration, launches=launches["total"],
                  device_s=prediction.step_s, per_launch_s=per_launch)
    block = prediction.to_dict()
    # the device step is what the planner's searches minimised (its
    # ``solver.predicted_step_ms``, the same arithmetic); the host term (syncs a step;
    # launch-bound time where the device step is shorter than issuing the launches, whose
    # count the tables' routes set) weighs only in the cpsat planner's choice among the
    # plans it tried (solver.problem.host_step_s), so ``step_ms`` = this + host
    block["device_step_ms"] = block["step_ms"]
    block["step_ms"] = block["step_ms"] + 1e3 * host
    block["breakdown_ms"]["host"] = 1e3 * host
    for rank in block.get("per_rank") or []:
        rank["compute_ms"] = rank.get("compute_ms", 0.0) + 1e3 * host
    if block.get("mfu") and prediction.step_s > 0:
        block["mfu"] = block["mfu"] * prediction.step_s / (prediction.step_s + host)
    block["kind_ms"] = kind_breakdown_ms(gm, block["breakdown_ms"])
    block["host"] = {"launches": launches["total"], "launches_by_source": launches,
                     "per_launch_us": 1e6 * per_launch, "exposed_ms": 1e3 * host}
    block["packed_fill"] = guarded_fills(gm)
    block["activations"] = {"saved_bytes": int(profile.saved_total * act_factor),
                            "forward_peak_bytes": int(profile.peak * act_factor),
                            "inputs_bytes": profile.inputs, "factor": act_factor}
    # The file's name, not its path: the same inputs must give the same plan bytes anywhere.
    block["calibration"] = Path(calibration.source).name if calibration is not None else None
    if calibration is None:
        block["note"] = (f"no calibration for {topology.gpu.name}: op times are roofline "
                         "estimates (run gemc calibrate on that GPU)")
    return block

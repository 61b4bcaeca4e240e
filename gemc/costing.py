"""From a plan's regions and tables to the cost model's step prediction.

The one bridge between the plan document and ``cost_model.step_model.predict_step``:
the plan builder calls it for every planner, and the solver calls the same conversion, so
the prediction written in a plan is the one the planner optimised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import fx

from gemc import ir
from gemc.cost_model.activations import saved_activation_bytes
from gemc.cost_model.calibration import Calibration
from gemc.cost_model.step_model import predict_step
from gemc.cost_model.topology import Topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost

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


def region_costs(regions: Sequence[Mapping[str, Any]], activations: Mapping[str, int],
                 boundaries: Mapping[str, int] | None = None) -> list[RegionCost]:
    out = []
    for r in regions:
        params = int(r["params"])
        out.append(
            RegionCost(
                name=r["name"],
                params=params,
                fwd_flops=float(r["fwd_flops"]),
                compute_s=float(r.get("predicted_ms") or 0.0) / 1e3,
                strategy=r["strategy"],
                shard_group=int(r.get("shard_group", 0)),
                param_bytes=max(1, int(r["param_bytes"]) // params) if params else 4,
                activation_bytes=int(activations.get(r["name"], 0)),
                boundary_bytes=int((boundaries or {}).get(r["name"], 0)),
                checkpoint=bool(r.get("checkpoint", False)),
            )
        )
    return out


def table_costs(tables: Sequence[Mapping[str, Any]]) -> list[TableCost]:
    return [
        TableCost(
            fqn=t["fqn"], rows=int(t["rows"]), dim=int(t["dim"]), nnz=int(t["nnz"]),
            batch=int(t["batch"]), sharding=t["sharding"],
            ranks=tuple(s["rank"] for s in t["shards"]),
            dtype_bytes=_DTYPE_BYTES.get(t.get("dtype", "float32"), 4),
            pooled=t.get("pooling", "sum") != "none",
        )
        for t in tables
    ]


def predicted_block(
    gm: fx.GraphModule,
    regions: Sequence[Mapping[str, Any]],
    tables: Sequence[Mapping[str, Any]],
    topology: Topology,
    calibration: Calibration | None,
    options: StepOptions | None = None,
) -> dict[str, Any]:
    """The plan's ``predicted`` block: step ms, MFU, per-rank memory and time."""
    prediction = predict_step(
        region_costs(regions, saved_activation_bytes(gm), region_boundary_bytes(gm)),
        table_costs(tables), topology,
        calibration=calibration, options=options,
    )
    block = prediction.to_dict()
    # The file's name, not its path: the same inputs must give the same plan bytes anywhere.
    block["calibration"] = Path(calibration.source).name if calibration is not None else None
    if calibration is None:
        block["note"] = (f"no calibration for {topology.gpu.name}: op times are roofline "
                         "estimates (run gemc calibrate on that GPU)")
    return block

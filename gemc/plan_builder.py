"""Plan emission: aggregate the annotated graph into the plan document."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch
from torch import fx

import gemc
from gemc import ir
from gemc.capture import Captured
from gemc.context import PassContext
from gemc.ir import OpKind
from gemc.plan import SCHEMA_VERSION
from gemc.sharding import make_shards

# A training step runs the forward once and the backward (two GEMMs per forward GEMM).
TRAIN_FLOPS_FACTOR = 3


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def table_summaries(gm: fx.GraphModule, captured: Captured) -> list[dict[str, Any]]:
    """One entry per table FQN: size, lookups per batch, pooling, and its placement."""
    by_fqn: dict[str, dict[str, Any]] = {}
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.TABLE)
        if facts is None:
            continue
        fqn = facts["fqn"]
        entry = by_fqn.setdefault(
            fqn,
            {
                "fqn": fqn,
                "rows": facts["rows"],
                "dim": facts["dim"],
                "nnz": 0,
                "batch": facts["batch"],
                "pooling": facts["mode"],
                "weighted": facts["weighted"],
                "dtype": captured.param_dtypes.get(fqn, "float32"),
                "lookups": 0,
                "placement": node.meta.get(ir.PLACEMENT),
                "predicted_ms": 0.0,
            },
        )
        entry["nnz"] += facts["nnz"]
        entry["lookups"] += 1
        entry["predicted_ms"] += float(node.meta.get(ir.PREDICTED_MS, 0.0))
    tables = []
    for fqn in sorted(by_fqn):
        entry = by_fqn[fqn]
        placement = entry.pop("placement") or {"sharding": "table_wise", "ranks": [0]}
        entry["sharding"] = placement["sharding"]
        entry["shards"] = make_shards(
            placement["sharding"],
            list(placement["ranks"]),
            entry["rows"],
            entry["dim"],
            placement.get("grid"),
        )
        entry["predicted_ms"] = round(entry["predicted_ms"], 6) if entry["predicted_ms"] else None
        tables.append(entry)
    return tables


def region_summaries(
    gm: fx.GraphModule, captured: Captured, table_fqns: set[str]
) -> list[dict[str, Any]]:
    """One entry per dense region: its weights (tables excluded), FLOPs, op mix, strategy."""
    flops: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    kinds: dict[str, Counter] = defaultdict(Counter)
    params: dict[str, int] = defaultdict(int)
    param_bytes: dict[str, int] = defaultdict(int)
    strategy: dict[str, str] = {}
    predicted: dict[str, float] = defaultdict(float)
    for node in gm.graph.nodes:
        region = node.meta.get(ir.REGION, "")
        kind = ir.kind_of(node)
        fqn = node.meta.get(ir.PARAM)
        if fqn is not None:
            if fqn in table_fqns:
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                params[region] += int(val.numel())
                param_bytes[region] += ir.nbytes(val)
            kinds[region]["param"] += 1
            continue
        if (
            node.op != "call_function"
            or kind in (OpKind.VIEW, OpKind.EMBEDDING)
            or node.meta.get(ir.TABLE)
        ):
            continue
        flops[region] += int(node.meta.get(ir.FLOPS, 0))
        nbytes[region] += int(node.meta.get(ir.BYTES, 0))
        kinds[region][kind.value if kind else "other"] += 1
        predicted[region] += float(node.meta.get(ir.PREDICTED_MS, 0.0))
        placement = node.meta.get(ir.PLACEMENT) or {}
        strategy.setdefault(region, placement.get("strategy", "ddp"))
    names = sorted(set(flops) | set(params))
    return [
        {
            "name": name,
            "params": params[name],
            "param_bytes": param_bytes[name],
            "fwd_flops": flops[name],
            "fwd_bytes": nbytes[name],
            "ops": dict(sorted(kinds[name].items())),
            "strategy": strategy.get(name, "ddp"),
            "predicted_ms": round(predicted[name], 6) if predicted[name] else None,
        }
        for name in names
    ]


def build_plan(
    gm: fx.GraphModule,
    ctx: PassContext,
    captured: Captured,
    *,
    planner: str = "default",
    predicted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    tables = table_summaries(gm, captured)
    table_fqns = {t["fqn"] for t in tables}
    regions = region_summaries(gm, captured, table_fqns)
    topo = ctx.topology
    fwd_flops = sum(int(n.meta.get(ir.FLOPS, 0)) for n in gm.graph.nodes)
    embedding_params = sum(t["rows"] * t["dim"] for t in tables)
    dense_params = sum(r["params"] for r in regions)
    plan = {
        "schema_version": SCHEMA_VERSION,
        "gemc_version": gemc.__version__,
        "model": {
            "entrypoint": ctx.entrypoint,
            "args": _json_safe(ctx.args),  # only user values can be non-JSON types
            "fingerprint": captured.fingerprint,
            "graph_nodes": len(gm.graph.nodes),
            "dense_params": dense_params,
            "embedding_params": embedding_params,
            "fwd_flops": fwd_flops,
            "train_flops_per_step": TRAIN_FLOPS_FACTOR * fwd_flops,
        },
        "topology": topo.to_dict(),
        "mesh": {
            "world_size": topo.world_size,
            "shape": [topo.hosts, topo.gpus_per_host],
            "dim_names": ["host", "local"],
        },
        "regions": regions,
        "tables": tables,
        "kernels": [],
        "precision": [],
        "predicted": predicted
        or {
            "step_ms": None,
            "mfu": None,
            "per_rank": None,
            "cost_model": None,
            "note": "no cost model in this pipeline: predictions are null, not invented",
        },
        "planner": planner,
        "warnings": list(ctx.warnings),
    }
    return plan

"""The run report: what was measured, next to what the plan predicted, per rank.

Written by rank 0 next to the plan (``<plan>.run.json``) or at ``--report``. Every rank
contributes its own step times, peak memory and the table shards it held (gathered with
``all_gather_object``). Where the plan's prediction is null the report says so and
carries the measured values only; predicted memory per rank is read from
``predicted.per_rank[].memory_gb`` (or ``memory_bytes``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist
from gemc.backends.torch.metrics import memory_stats, peak_flops


def _query_stats() -> dict[str, int] | None:
    """The query-padded attention's per-row guard counts (device counters, read here)."""
    mod = sys.modules.get("gemc.backends.triton.jagged_query_attention")
    return mod.STATS.as_dict() if mod is not None else None


def build_report(
    plan, plan_path, opts, world, device, metrics, prec, layout, tables, applied_kernels,  # noqa: ANN001
    local_batch, start, setup_s, saved, resumed_from, emb_cfg, dense_cfg,  # noqa: ANN001
) -> dict[str, Any]:
    """The run report: measured next to predicted, per rank (gathered to every rank)."""
    wsize = world.world_size
    timing = metrics.timing(opts.warmup_steps)
    # guarded attentions (run-time prefix check): how often each path ran on this rank;
    # read only if the kernels' module was loaded (a run without them imports no Triton)
    guarded = sys.modules.get("gemc.backends.triton.key_padding_attention")
    regions = sys.modules.get("gemc.backends.triton.packed_tokens")
    mine = {
        "rank": world.rank,
        "host": os.uname().nodename,
        "step_ms": timing,
        "memory": memory_stats(device),
        "guarded_attention": guarded.STATS.as_dict() if guarded is not None else None,
        "guarded_query_attention": _query_stats(),
        # packed regions guarded by the same check: how often they ran packed / padded
        "guarded_regions": regions.GUARD_STATS.as_dict() if regions is not None else None,
        "tables_held": {
            fqn: (
                None
                if m.local is None
                else {
                    "row_offset": m.local.row_offset,
                    "rows": m.local.rows,
                    "col_offset": m.local.col_offset,
                    "cols": m.local.cols,
                }
            )
            for fqn, m in tables.items()
        },
    }
    per_rank = [mine]
    if wsize > 1:
        gathered: list[Any] = [None] * wsize
        dist.all_gather_object(gathered, mine)
        per_rank = gathered
    step_ms = max((r["step_ms"]["median"] or 0.0) for r in per_rank) or None
    flops = plan["model"].get("train_flops_per_step")
    peak = peak_flops(plan["topology"].get("gpu"), prec.compute_dtype, device)
    mfu = None
    if peak.get("flops") and flops and step_ms:
        mfu = flops / (step_ms / 1e3 * peak["flops"])
    # null when the model states no batch size: never a guess (see gemc.spec.batch_size_of)
    global_batch = local_batch * wsize if local_batch else None
    predicted = plan.get("predicted") or {}
    pred_step = predicted.get("step_ms")
    comparison: dict[str, Any] = {
        "step_ms": {
            "measured": step_ms,
            "predicted": pred_step,
            "ratio_measured_over_predicted": (step_ms / pred_step) if (pred_step and step_ms) else None,
        },
        "memory_per_rank": [
            {
                "rank": r["rank"],
                "measured_bytes": r["memory"]["peak_bytes"],
                "measured_kind": r["memory"]["kind"],
                "predicted_bytes": _predicted_memory(predicted, r["rank"]),
            }
            for r in per_rank
        ],
    }
    # what `gemc calibrate --from-run` fits on (gemc.cost_model.run_fit): the predicted
    # step by op kind, rank 0's predicted memory by part, the GPU it was predicted for
    ranks = predicted.get("per_rank") or [{}]
    comparison.update(kind_ms=predicted.get("kind_ms"), gpu=plan["topology"].get("gpu"),
                      memory_breakdown_gb=(ranks[0] or {}).get("memory"))
    if pred_step is None:
        comparison["note"] = (
            "the plan holds no prediction (predicted.step_ms is null): measured values only"
        )
    return {
        "plan": str(plan_path) if plan_path else None,
        "model": {k: plan["model"].get(k) for k in ("entrypoint", "args", "fingerprint")},
        "world_size": wsize,
        "mesh": plan["mesh"],
        "device": str(device.type),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "seed": opts.seed,
        "steps": {"requested": opts.steps, "start": start, "run": len(metrics.records)},
        "resumed_from": resumed_from,
        "checkpoints": saved,
        "setup_s": setup_s,
        "losses": [{"step": r.step, "loss": r.loss, "ms": r.ms} for r in metrics.records],
        "step_ms": step_ms,
        "step_ms_definition": "median over steps after warmup of the slowest rank, "
        "forward+backward+optimizer+loss all-reduce (batch creation excluded)",
        "warmup_steps": opts.warmup_steps,
        "local_batch": local_batch,
        "global_batch": global_batch,
        "samples_per_s": (global_batch / (step_ms / 1e3)) if step_ms and global_batch else None,
        "mfu": {
            "value": mfu,
            "flops_per_rank_step": flops,
            "peak": peak,
            "definition": "train_flops_per_step / (step_seconds * peak_flops_per_gpu)",
        },
        "precision": {
            "autocast": str(prec.global_dtype).removeprefix("torch.") if prec.global_dtype else None,
            "per_module": {k: str(v).removeprefix("torch.") for k, v in prec.per_module.items()},
        },
        "kernels_applied": applied_kernels,
        "kernels_disabled": not opts.kernels and bool(plan["kernels"]),
        "kernels_skipped": list(opts.skip_kernels),
        "dense": layout.summary(),
        "optimizers": {
            "dense": {"kind": "adamw", **dense_cfg.__dict__},
            "embedding": dict(emb_cfg.__dict__),
        },
        "per_rank": per_rank,
        "vs_predicted": comparison,
    }


def _predicted_memory(predicted: dict[str, Any], rank: int) -> int | None:
    per_rank = predicted.get("per_rank")
    if not isinstance(per_rank, list):
        return None
    for entry in per_rank:
        if isinstance(entry, dict) and entry.get("rank") == rank:
            for key in ("memory_bytes", "peak_memory_bytes", "mem_bytes"):
                if isinstance(entry.get(key), (int, float)):
                    return int(entry[key])
            if isinstance(entry.get("memory_gb"), (int, float)):
                return int(entry["memory_gb"] * 1e9)
    return None

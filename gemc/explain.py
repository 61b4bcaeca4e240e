"""``gemc explain``: a plan as the tables a person reads to trust it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from gemc.explain_precision import precision_section
from gemc.table_format import human_count, ranks_str, render_table

MAX_TABLE_ROWS = 40


def explain(plan: dict[str, Any]) -> str:
    model, topo, pred = plan["model"], plan["topology"], plan["predicted"]
    out = [
        f"model      {model['entrypoint']}  {model.get('args', {})}",
        f"           fingerprint {model['fingerprint'][:23]}...  nodes {model.get('graph_nodes')}",
        f"           dense params {human_count(model.get('dense_params', 0))}  embedding params "
        f"{human_count(model.get('embedding_params', 0))}  train FLOPs/step {human_count(model.get('train_flops_per_step', 0))}",
        f"topology   {topo.get('gpu')}:{topo.get('hosts')}x{topo.get('gpus_per_host')}  world {plan['mesh']['world_size']}  mesh {plan['mesh']['shape']}",
        f"planner    {plan['planner']}",
        f"predicted  step {_ms(pred.get('step_ms'))}  MFU {_pct(pred.get('mfu'))}  cost model {pred.get('cost_model') or '-'}",
    ]
    if pred.get("note"):
        out.append(f"           ({pred['note']})")
    out.append("")
    out.append(
        render_table(
            ["region", "strategy", "params", "fwd FLOPs", "ops", "pred ms"],
            [
                [
                    r["name"] or "(root)",
                    r["strategy"],
                    human_count(r["params"]),
                    human_count(r["fwd_flops"]),
                    _ops(r.get("ops", {})),
                    r.get("predicted_ms"),
                ]
                for r in plan["regions"]
            ],
            title=f"dense regions ({len(plan['regions'])})",
        )
    )
    tables = sorted(plan["tables"], key=lambda t: (-t["rows"] * t["dim"], t["fqn"]))
    shown = tables[:MAX_TABLE_ROWS]
    out += [
        "",
        render_table(
            ["table", "rows", "dim", "lookups/batch", "pooling", "sharding", "ranks", "pred ms"],
            [
                [
                    t["fqn"],
                    human_count(t["rows"]),
                    t["dim"],
                    t["nnz"],
                    t["pooling"],
                    t["sharding"],
                    ranks_str([s["rank"] for s in t["shards"]]),
                    t.get("predicted_ms"),
                ]
                for t in shown
            ],
            title=f"embedding tables ({len(tables)}, largest first)",
        ),
    ]
    if len(tables) > len(shown):
        mix = Counter(t["sharding"] for t in tables[len(shown) :])
        out.append(
            f"... {len(tables) - len(shown)} more: "
            + ", ".join(f"{n} {s}" for s, n in sorted(mix.items()))
        )
    if pred.get("per_rank"):
        out += [
            "",
            render_table(
                ["rank", "memory GB", "compute ms", "comm ms", "tables"],
                [
                    [
                        r.get("rank"),
                        r.get("memory_gb"),
                        r.get("compute_ms"),
                        r.get("comm_ms"),
                        r.get("tables"),
                    ]
                    for r in pred["per_rank"]
                ],
                title="per rank",
            ),
        ]
    out += ["", f"kernels    {len(plan['kernels'])}", *precision_section(plan)]
    for w in plan.get("warnings", []):
        out.append(f"warning: {w}")
    return "\n".join(out)


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.3f} ms"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ops(ops: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:4])

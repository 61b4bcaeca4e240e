"""``gemc explain``: a plan as the tables a person reads to trust it."""

from __future__ import annotations

from collections import Counter
from typing import Any

from gemc.explain_precision import precision_section
from gemc.table_format import human_count, ranks_str, render_table

MAX_TABLE_ROWS = 40
MAX_RANK_ROWS = 64


def explain(plan: dict[str, Any]) -> str:
    model, topo, pred = plan["model"], plan["topology"], plan["predicted"]
    out = [
        f"model      {model['entrypoint']}  {model.get('args', {})}",
        f"           fingerprint {model['fingerprint'][:23]}...  nodes {model.get('graph_nodes')}"
        f"  batch {model.get('batch_size') or 'not stated'}",
        f"           dense params {human_count(model.get('dense_params', 0))}  embedding params "
        f"{human_count(model.get('embedding_params', 0))}  train FLOPs/step {human_count(model.get('train_flops_per_step', 0))}",
        f"topology   {topo.get('gpu')}:{topo.get('hosts')}x{topo.get('gpus_per_host')}  world {plan['mesh']['world_size']}  mesh {plan['mesh']['shape']}",
        f"planner    {planner_line(plan)}",
        f"predicted  step {_ms(pred.get('step_ms'))}  MFU {_pct(pred.get('mfu'))}  cost model {pred.get('cost_model') or '-'}",
    ]
    if pred.get("device_step_ms") is not None and pred.get("breakdown_ms", {}).get("host"):
        out.append(f"           = device {_ms(pred['device_step_ms'])} (the planner's objective, "
                   f"solver's step) + host {_ms(pred['breakdown_ms']['host'])} (syncs, and "
                   f"issuing {(pred.get('host') or {}).get('launches', '?')} kernel launches "
                   "where that outlasts the device step)")
    if pred.get("note"):
        out.append(f"           ({pred['note']})")
    out += solver_lines(plan.get("solver"))
    out.append("")
    out.append(
        render_table(
            ["region", "strategy", "params", "fwd FLOPs", "ops", "pred ms"],
            [
                [
                    r["name"] or "(root)",
                    _strategy(r),
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
            ["table", "rows", "dim", "lookups/batch", "pooling", "sharding", "stored", "ranks",
             "pred ms", "shard ms", "shard GB", "a2a MB"],
            [
                [
                    t["fqn"],
                    human_count(t["rows"]),
                    t["dim"],
                    t["nnz"],
                    t["pooling"],
                    t["sharding"],
                    t.get("precision", "fp32"),
                    ranks_str([s["rank"] for s in t["shards"]]),
                    t.get("predicted_ms"),
                    *_table_cost(t.get("cost")),
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
    reasons = Counter((t.get("precision", "fp32"), t["precision_reason"]) for t in tables
                      if t.get("precision_reason"))
    for (precision, why), n in sorted(reasons.items()):
        out.append(f"table storage: {n} table(s) {precision}: {why.split(': ', 1)[-1]}")
    out.append(exchange_line(plan))
    if pred.get("per_rank"):
        out += ["", *_per_rank(plan)]
    out += ["", *_kernel_lines(plan["kernels"]), *precision_section(plan)]
    for w in plan.get("warnings", []):
        out.append(f"warning: {w}")
    return "\n".join(out)


def _kernel_lines(kernels: list[dict[str, Any]]) -> list[str]:
    """Per kind: how many, and the cost model's fwd+bwd ms before/after for them (a packed
    token region also says how many nodes it spans and its fill). Why: the count alone did
    not say whether the plan runs the sequence tower on its real tokens."""
    if not kernels:
        return ["kernels    0"]
    lines = [f"kernels    {len(kernels)}"]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for k in kernels:
        by_kind.setdefault(str(k.get("kind")), []).append(k)
    for kind, entries in sorted(by_kind.items()):
        pred = [k.get("predicted") or {} for k in entries]
        before = sum(p.get("before_ms") or 0.0 for p in pred)
        after = sum(p.get("after_ms") or 0.0 for p in pred)
        line = f"           {len(entries):3d} {kind:<22} pred {before:9.3f} -> {after:9.3f} ms"
        if kind == "packed_tokens":
            spans = ", ".join(f"{len(k.get('nodes', []))} nodes at fill {k.get('fill')}"
                              for k in entries)
            line += f"  ({spans}; overlaps the kernels inside)"
        lines.append(line)
    return lines


def exchange_line(plan: dict[str, Any]) -> str:
    """The pooled exchange's wire precision, both ways, and why (fp32 for a plan without
    the block)."""
    block = plan.get("exchange") or {}
    fwd, bwd = block.get("forward", "fp32"), block.get("backward", "fp32")
    why = block.get("reason", "fp32: the plan predates the choice").split(": ", 1)[-1]
    return f"table exchange: pooled rows {fwd}, gradients {bwd}: {why}"


def planner_line(plan: dict[str, Any]) -> str:
    """The planner whose plan this is, and the one that was tried and kept it, if another:
    ``greedy (cpsat was tried and kept greedy's plan)``. One statement, so the header and
    the solver's warning cannot contradict each other."""
    tried = (plan.get("solver") or {}).get("planner")
    if tried and tried != plan["planner"]:
        return f"{plan['planner']} ({tried} was tried and kept {plan['planner']}'s plan)"
    return str(plan["planner"])


def solver_lines(solver: dict[str, Any] | None) -> list[str]:
    if not solver:
        return []
    if solver.get("status") == "heuristic":
        return [f"solver     {solver['planner']} (heuristic, no bound)"]
    line = (f"solver     CP-SAT {solver.get('status')}: objective {_ms(solver.get('objective_ms'))}"
            f"  bound {_ms(solver.get('bound_ms'))}  gap {_pct(solver.get('gap'))}"
            f"  kept {solver.get('kept')}")
    extra = (f"           greedy {_ms(solver.get('greedy_step_ms'))}  "
             f"{solver.get('variables')} variables, bins of {solver.get('bin_size')} rank(s), "
             f"{solver.get('deterministic_seconds')} deterministic s of {solver.get('time_limit_s')}")
    out = [line, extra]
    if solver.get("unbalanced_step_ms") is not None:  # the memory-balance trade, stated
        within = (f"under max/mean {solver.get('balance_ratio')} within balance_cap_tolerance "
                  f"{solver.get('balance_cap_tolerance')}"
                  if solver.get("balanced_by") == "cap" else
                  f"within balance_tolerance {solver.get('balance_tolerance')}")
        out.append(f"           memory balance replaced the step-first plan "
                   f"({_ms(solver.get('unbalanced_step_ms'))}, fullest rank "
                   f"{solver.get('unbalanced_max_gb')} GB) {within}: step now "
                   f"{_ms(solver.get('predicted_step_ms'))}")
    was = solver.get("unspread_max_rank_sends_mb")
    if was is not None:  # spread_sends, stated
        now = solver.get("max_rank_sends_mb")
        what = (f"busiest rank {now} MB a step (was {was} MB)" if now != was else
                f"busiest rank unchanged at {now} MB a step, the others evened")
        out.append(f"           pooled all-to-all sends spread over the ranks at the same step: "
                   f"{what}")
    return out


def _strategy(r: dict[str, Any]) -> str:
    s = r["strategy"] + (f"/{r['shard_group']}" if r.get("shard_group") else "")
    return s + (" +ckpt" if r.get("checkpoint") else "")


def _table_cost(cost: dict[str, float] | None) -> list[Any]:
    if not cost:
        return [None, None, None]
    return [cost.get("shard_compute_ms"), cost.get("shard_memory_gb"), cost.get("shard_a2a_mb")]


def _per_rank(plan: dict[str, Any]) -> list[str]:
    """Memory, compute, communication and shards per rank; at scale, the extremes."""
    ranks = plan["predicted"]["per_rank"]
    shards = Counter(s["rank"] for t in plan["tables"] for s in t["shards"])
    headers = ["rank", "memory GB", "sparse ms", "dense ms", "compute ms", "comm ms",
               "exposed ms", "shards"]

    def row(r: dict[str, Any]) -> list[Any]:
        return [r.get("rank"), r.get("memory_gb"), r.get("sparse_compute_ms"),
                r.get("dense_compute_ms"), r.get("compute_ms"), r.get("comm_ms"),
                r.get("exposed_comm_ms"), shards.get(r.get("rank"), 0)]

    if len(ranks) <= MAX_RANK_ROWS:
        return [render_table(headers, [row(r) for r in ranks], title="per rank")]
    top_mem = sorted(ranks, key=lambda r: (-(r.get("memory_gb") or 0), r.get("rank")))
    top_sparse = sorted(ranks, key=lambda r: (-(r.get("sparse_compute_ms") or 0), r.get("rank")))
    pick = {r["rank"]: r for r in top_mem[:8] + top_sparse[:8]}
    rows = [row(pick[k]) for k in sorted(pick)]
    for name, fn in (("min", min), ("max", max)):
        rows.append([name] + [fn(x[i] or 0 for x in map(row, ranks)) for i in range(1, 8)])
    rows.append(["mean"] + [sum((x[i] or 0) for x in map(row, ranks)) / len(ranks)
                            for i in range(1, 8)])
    return [render_table(headers, rows, title=f"per rank ({len(ranks)} ranks: the 8 fullest, "
                                              "the 8 busiest, and min / max / mean)")]


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.3f} ms"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ops(ops: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:4])

"""How low TorchRec's corrected estimator could put gemc's plan by placement alone, and what
replicas would buy and cost (issue 19, 16 ranks; CPU).

    .venv/bin/python benchmarks/torchrec_placement_bound.py \
        --terms benchmarks/results/torchrec_estimator_corrected_s19.json.gz --world 16

Why: with every published correction ("all", ``torchrec_rates.VARIANTS``) gemc's 16-rank
plan prices above TorchRec's. Two ways to close that were proposed: re-place gemc's shards
where gemc's own model is indifferent (a secondary objective), or keep small tables
data-parallel as TorchRec does. This script settles the first exactly and prices the
second under both models:

1. ``best_placement``: CP-SAT's optimum of the "all" max-rank over every placement of gemc's
   plan's shards (the same tables, shardings and shard counts; TorchRec's recorded
   per-shard terms; PXN's host mean and the NVLink shares exactly as
   ``torchrec_rates.rank_times`` re-derives them), with each rank's memory under a cap
   (gemc's memory model, steady bytes), and optionally gemc's per-host pooled sends (its
   all-to-all's host term) and per-rank lookup seconds held to its plan's; a table's block
   of row shards stays on one host (spread over two, each host's owners sum and send its
   partials: twice the sends, which a per-shard load cannot hold; the s22 run let them
   spread, and gemc's ``evaluate`` then priced the spread as one host's, 4.834 ms where
   ``predict_step`` says 5.402). Each optimum is then priced exactly by both:
   ``torchrec_rates.rank_times`` and gemc's ``evaluate``.
2. the replica what-if: gemc's plan with its smallest exchanged tables made data-parallel
   one at a time (TorchRec's own data-parallel terms for them, from its plan's record),
   priced by both, with gemc's step also with the host's exposed time (the plan's
   ``predicted.step_ms``: a replica's launches, ``cost_model.launches``).

The TorchRec terms come from a run of ``torchrec_estimator_corrected.py`` (``--terms``):
its recorded gemc plan must be the plan gemc makes now (checked, table by table), so the
terms are TorchRec's own for these shards. Writes ``--json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchrec_rates as rates  # noqa: E402

PRICING = "all_links"  # the "all" variant: this pricing with PXN re-derived


def pxn_spec(terms: dict[str, Any]) -> dict[str, Any]:
    """The "all" variant's re-derivation (``rates.reprice``'s) for ``rank_times``."""
    intra, inter = rates.pricing_rates(PRICING)
    return {"a2a_bw": terms[PRICING]["a2a_bw"], "intra": intra, "inter": inter,
            "share": rates.PRICINGS[PRICING].get("comms") == "share"}


def shard_cost(rec: dict[str, Any], spec: dict[str, Any], world: int, local: int
               ) -> tuple[float, float]:
    """(ms the shard costs the rank holding it, ms it adds to every rank of that rank's
    host) under ``rank_times``' PXN re-derivation: its compute, its comms outside the
    world-wide all-to-all, its NVLink share and PXN hop; and its cross-host bytes, which
    PXN spreads as the host's mean over the host's NICs."""
    own = rec["fwd_compute"] + rec["bwd_compute"] + rec.get("prefetch_compute", 0.0)
    comms = rec["fwd_comms"] + rec["bwd_comms"]
    if rec["sharding"] not in rates.WORLD_A2A:
        return own + comms, 0.0
    sent = comms * spec["a2a_bw"]
    nvl, cross = rates.a2a_shares(world, local) if spec["share"] else (0.0, 1.0)
    hop = (local - 1) / local if world > local else 0.0
    own += (sent * nvl + sent * cross * hop) / spec["intra"]
    return own, sent * cross / local / spec["inter"]


def best_placement(pieces: list[dict[str, Any]], world: int, local: int,
                   spec: dict[str, Any], *, fixed_ms: float = 0.0,
                   caps: dict[str, list[float]] | None = None,
                   hint: dict[str, list[int]] | None = None, seconds: float = 60.0,
                   workers: int = 2) -> dict[str, Any]:
    """The placement of ``pieces`` with the least "all" max-rank (CP-SAT; exact to 1 ns).

    ``pieces``: per table ``{"table", "record", "shards"}``: its shard count and one shard's
    TorchRec record (every shard of a table alike), placed on distinct ranks; each may
    carry ``"load": {name: amount per shard}`` for ``caps`` (``name -> per-rank cap``:
    memory bytes, gemc's lookup seconds) and ``"host_load"`` likewise, capped per host by
    ``caps["host:<name>"]`` (one value a host). ``fixed_ms``: what every rank pays anyway
    (data-parallel shards). A piece with ``"one_host"`` keeps all its shards on one host
    (a block of row shards: its sends, as gemc's model prices them, hold only there).
    Returns ``{"status", "max_ms", "bound_ms", "ranks": table -> sorted ranks}``."""
    from ortools.sat.python import cp_model

    ns = 1e6  # ms -> ns
    caps = caps or {}
    m = cp_model.CpModel()
    hosts = world // local
    y: dict[str, list[Any]] = {}
    own_terms: list[list[Any]] = [[] for _ in range(world)]
    host_terms: list[list[Any]] = [[] for _ in range(hosts)]
    for p in pieces:
        name, n = p["table"], p["shards"]
        own, spread = shard_cost(p["record"], spec, world, local)
        ys = y[name] = [m.NewBoolVar(f"{name}@{r}") for r in range(world)]
        m.Add(sum(ys) == n)
        if p.get("one_host"):
            on = [m.NewBoolVar(f"{name}@host{h}") for h in range(hosts)]
            m.Add(sum(on) == 1)
            for h in range(hosts):
                m.Add(sum(ys[h * local:(h + 1) * local]) == n * on[h])
        for r in range(world):
            own_terms[r].append(int(round(own * ns)) * ys[r])
            host_terms[r // local].append(int(round(spread * ns)) * ys[r])
            if hint and name in hint:
                m.AddHint(ys[r], r in hint[name])
    for key, cap in caps.items():
        if key.startswith("host:"):
            load = key[5:]
            for h in range(hosts):
                m.Add(sum(int(round(p["host_load"][load])) * y[p["table"]][r]
                          for p in pieces for r in range(h * local, (h + 1) * local))
                      <= int(cap[h]))
        else:
            for r in range(world):
                m.Add(sum(int(round(p["load"][key])) * y[p["table"]][r] for p in pieces)
                      <= int(cap[r]))
    _break_symmetry(m, pieces, y, world, local, caps)
    z = m.NewIntVar(0, 10**12, "max_rank_ns")
    for r in range(world):
        m.Add(sum(own_terms[r]) + sum(host_terms[r // local]) + int(round(fixed_ms * ns)) <= z)
    m.Minimize(z)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = 0
    status = solver.Solve(m)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return {"status": name}
    return {"status": name, "max_ms": solver.ObjectiveValue() / ns,
            "bound_ms": solver.BestObjectiveBound() / ns,
            "ranks": {t: [r for r in range(world) if solver.Value(v[r])] for t, v in y.items()}}


def _break_symmetry(m: Any, pieces: list[dict[str, Any]], y: dict[str, list[Any]],
                    world: int, local: int, caps: dict[str, list[float]]) -> None:
    """Where every rank has the same caps, ranks of a host are interchangeable and so are
    hosts (the objective is a rank's own shards plus its host's mean): order each host's
    ranks by the shards of the table with most shards, and the hosts by how many of them
    each holds. Any placement permutes into this order at the same figure, so the optimum
    is kept; CP-SAT's bound then proves it (without, 16 ranks stopped at the mean's bound)."""
    if not pieces:
        return
    if any(len(set(v)) > 1 for k, v in caps.items() if not k.startswith("host:")) \
            or any(len(set(v)) > 1 for k, v in caps.items() if k.startswith("host:")):
        return
    lead = max(pieces, key=lambda p: (p["shards"], p["table"]))["table"]
    ys = y[lead]
    for h in range(world // local):
        for r in range(h * local, (h + 1) * local - 1):
            m.Add(ys[r] >= ys[r + 1])
    for h in range(world // local - 1):
        m.Add(sum(ys[h * local:(h + 1) * local]) >= sum(ys[(h + 1) * local:(h + 2) * local]))


def place_records(pieces: list[dict[str, Any]], fixed: list[dict[str, Any]],
                  ranks: dict[str, list[int]]) -> list[dict[str, Any]]:
    """Shard records of a placement (one a rank held), for ``rates.rank_times``."""
    out = [dict(r) for r in fixed]
    for p in pieces:
        for r in ranks[p["table"]]:
            out.append({**p["record"], "ranks": [r]})
    return out


def pieces_of(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(placeable tables as ``best_placement`` takes them, the data-parallel records) of a
    recorded plan; refuses a table whose shards differ (the model takes one a table)."""
    by_table: dict[str, list[dict[str, Any]]] = {}
    fixed = []
    for rec in records:
        if rec["ranks"] == "all":
            fixed.append(rec)
        else:
            by_table.setdefault(rec["table"], []).append(rec)
    pieces = []
    for table, recs in sorted(by_table.items(), key=lambda x: int(x[0][1:])):
        shape = {(r["sharding"], r["cols"], r["rows"]) for r in recs}
        if len(shape) != 1 or any(len(r["ranks"]) != 1 for r in recs):
            raise ValueError(f"table {table}: shards {sorted(shape)} differ or span several "
                             "ranks; best_placement takes one shard shape a table")
        pieces.append({"table": table, "record": {k: v for k, v in recs[0].items()
                                                   if k != "ranks"},
                       "shards": len(recs), "was": sorted(r["ranks"][0] for r in recs)})
    return pieces, fixed


def main() -> int:
    import numpy as np
    import vs_torchrec as vt
    from gemc.cost_model.calibration import default_calibration

    from gemc.sharding import SHARDINGS
    from gemc.solver.evaluate import Pricer, evaluate
    from gemc.solver.local_search import steady_bytes
    from gemc.solver.planners import run_planner
    from gemc.solver.problem import Assignment, TableChoice, host_step_s

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--terms", required=True,
                    help="a torchrec_estimator_corrected.py result (.json or .json.gz)")
    ap.add_argument("--world", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=1.3, help="max / mean memory cap")
    ap.add_argument("--seconds", type=float, default=60.0, help="CP-SAT's limit a solve")
    ap.add_argument("--replicas", type=int, default=6,
                    help="how many of the smallest exchanged tables the what-if replicates")
    ap.add_argument("--json", default=str(vt.REPO / "benchmarks" / "results"
                                          / "torchrec_placement_bound.json"))
    args = ap.parse_args()
    world, local = args.world, 8
    opener: Callable[..., Any] = gzip.open if args.terms.endswith(".gz") else open
    with opener(args.terms, "rt") as f:
        recorded = json.load(f)
    row = next(r for r in recorded["rows"] if r["world"] == world)
    terms = row["terms"]
    spec = pxn_spec(terms)

    problem = vt.gemc_problem(1, world, default_calibration("h200"))
    t0 = time.perf_counter()
    g = run_planner(problem, "cpsat")
    plan_s = time.perf_counter() - t0
    pricer = Pricer(problem)
    tables = vt.tables_of(problem)
    fqn_of = {t["name"]: t["fqn"] for t in tables}
    cost_of = {t.fqn: t for t in problem.tables}
    a, ev = g.assignment, g.evaluation
    pieces, fixed = pieces_of(terms[PRICING]["gemc"]["shards"])
    for p in pieces:  # the recorded plan is gemc's plan now
        choice = a.tables[fqn_of[p["table"]]]
        if sorted(choice.ranks) != p["was"] or choice.sharding != p["record"]["sharding"]:
            raise SystemExit(f"{args.terms}: table {p['table']} is {p['record']['sharding']} on "
                             f"{p['was']} there, gemc plans {choice.sharding} on "
                             f"{list(choice.ranks)} now; record the terms again "
                             "(torchrec_estimator_corrected.py --worlds "
                             f"{world} --torchrec-terms-from ...)")
    batch = vt.GLOBAL_BATCH
    start = rates.rank_times(terms[PRICING]["gemc"]["shards"], world, local, batch, spec)
    theirs = rates.rank_times(terms[PRICING]["torchrec"]["shards"], world, local, batch, spec)
    fixed_ms = sum(rates.rank_times([{**r, "ranks": [0]}], 1, 1, batch)["max_ms"]
                   for r in fixed)

    # gemc's model's loads per shard: steady bytes, lookup seconds, pooled bytes sent
    steady = steady_bytes(ev)
    placed = np.zeros(world)
    placed_lookup = np.zeros(world)
    for p in pieces:
        fqn = fqn_of[p["table"]]
        o = pricer.table(cost_of[fqn], a.tables[fqn])
        p["load"] = {"memory": o.memory, "lookup": o.compute_s * 1e9}
        p["host_load"] = {"sends": o.out_bytes / 1e3}
        # a block of row shards sends ``o.out_bytes`` a holder only while its host's
        # owners sum all of it: spread over two hosts, each owner sends twice that
        # (step_model.host_reduce_owners), which these per-shard loads cannot say
        p["one_host"] = SHARDINGS[a.tables[fqn].sharding].row_split and len(
            {r // local for r in a.tables[fqn].ranks}) == 1 and len(a.tables[fqn].ranks) > 1
        for r in a.tables[fqn].ranks:
            placed[r] += o.memory
            placed_lookup[r] += o.compute_s
    base = steady - placed
    grads = ev.lookup_grads if ev.lookup_grads is not None else np.zeros(world)
    mean = float(ev.memory.mean())
    host_sends = ev.out.reshape(world // local, local).sum(axis=1) / 1e3
    hint = {p["table"]: p["was"] for p in pieces}

    def solve(label: str, mem_cap: float, lookup: bool, sends: bool) -> dict[str, Any]:
        # the cap on steady bytes leaves room for the plan's least gradient term (one cap
        # for every rank: their dense parts and replicas are alike); the term moves with
        # the shards, so each placement's max / mean is then checked exactly (``over``)
        caps: dict[str, list[float]] = {
            "memory": [mem_cap - float(base.max()) - float(grads.min())] * world}
        if lookup:
            # the slowest rank's lookup, less what each rank looks up besides the pieces
            other = float((ev.sparse - placed_lookup).max())
            caps["lookup"] = [(float(ev.sparse.max()) - other) * 1e9] * world
        if sends:
            caps["host:sends"] = [float(host_sends.max())] * (world // local)
        t = time.perf_counter()
        got = best_placement(pieces, world, local, spec, fixed_ms=fixed_ms, caps=caps,
                             hint=hint, seconds=args.seconds)
        got.update(label=label, solve_s=round(time.perf_counter() - t, 1))
        if "ranks" not in got:
            return got
        recs = place_records(pieces, fixed, got["ranks"])
        got["all"] = rates.rank_times(recs, world, local, batch, spec)
        b = Assignment(dense=dict(a.dense), tables=dict(a.tables))
        for name, ranks in got["ranks"].items():
            c = a.tables[fqn_of[name]]
            b.tables[fqn_of[name]] = TableChoice(c.sharding, tuple(ranks), c.grid)
        b_ev = evaluate(problem, b, pricer)
        got.update(gemc_ms=b_ev.step_ms, gemc_host_ms=1e3 * host_step_s(problem, b, b_ev.step_s),
                   max_over_mean=b_ev.max_over_mean,
                   over=bool(b_ev.max_over_mean > args.ratio
                             or b_ev.memory.max() > mem_cap * (1 + 1e-9)))
        return got

    bounds = [
        solve(f"memory <= {args.ratio} x mean, gemc's lookup and host sends held",
              args.ratio * mean, True, True),
        solve(f"memory <= {args.ratio} x mean, gemc's host sends held", args.ratio * mean,
              False, True),
        solve(f"memory <= {args.ratio} x mean, nothing of gemc's held", args.ratio * mean,
              False, False),
        solve("memory <= the plan's fullest rank, gemc's lookup and host sends held",
              float(ev.memory.max()), True, True),
    ]

    # the replica what-if: the smallest exchanged tables data-parallel, one more at a time
    dp_records = {r["table"]: r for r in terms[PRICING]["torchrec"]["shards"]
                  if r["ranks"] == "all"}
    smallest = sorted((p for p in pieces if p["table"] in dp_records),
                      key=lambda p: (cost_of[fqn_of[p["table"]]].rows, p["table"]))
    what_if = []
    current = dict(a.tables)
    recs = list(terms[PRICING]["gemc"]["shards"])
    for p in [None, *smallest[:args.replicas]]:
        if p is not None:
            fqn = fqn_of[p["table"]]
            current[fqn] = TableChoice("data_parallel", tuple(range(world)), None)
            recs = [r for r in recs if r["table"] != p["table"]] + [dp_records[p["table"]]]
        b = Assignment(dense=dict(a.dense), tables=dict(current))
        b_ev = evaluate(problem, b, pricer)
        what_if.append({"replicated": None if p is None else p["table"],
                        "rows": None if p is None else cost_of[fqn_of[p["table"]]].rows,
                        "gemc_ms": b_ev.step_ms,
                        "gemc_host_ms": 1e3 * host_step_s(problem, b, b_ev.step_s),
                        "max_over_mean": b_ev.max_over_mean,
                        "all": rates.rank_times(recs, world, local, batch, spec)})

    print(f"world {world}: gemc's plan (planned in {plan_s:.1f} s) under gemc's model "
          f"{ev.step_ms:.3f} ms ({1e3 * host_step_s(problem, a, ev.step_s):.3f} with the host), "
          f"max/mean {ev.max_over_mean:.3f}; under 'all' {start['max_ms']:.3f} ms "
          f"(r{start['rank']}); TorchRec's plan under 'all' {theirs['max_ms']:.3f} ms")
    print("\nbest placement of gemc's shards under 'all' (CP-SAT):")
    for b in bounds:
        if "all" not in b:
            print(f"  {b['label']}: {b['status']}")
            continue
        print(f"  {b['label']}: {b['all']['max_ms']:.4f} ms (r{b['all']['rank']}), "
              f"{b['status']}, bound {b['bound_ms']:.4f}, {b['solve_s']} s; under gemc's model "
              f"{b['gemc_ms']:.3f} ms ({b['gemc_host_ms']:.3f} with the host), max/mean "
              f"{b['max_over_mean']:.3f}{' (over the cap)' if b['over'] else ''}")
    print("\nreplicas (the smallest exchanged tables data-parallel, cumulative):")
    for w in what_if:
        print(f"  +{w['replicated'] or '-'} ({w['rows']} rows): gemc {w['gemc_ms']:.3f} ms "
              f"({w['gemc_host_ms']:.3f} with the host), max/mean {w['max_over_mean']:.3f}; "
              f"'all' {w['all']['max_ms']:.4f} ms (r{w['all']['rank']})")
    out = {"terms": args.terms, "world": world, "ratio": args.ratio,
           "gemc": {"step_ms": ev.step_ms,
                    "host_step_ms": 1e3 * host_step_s(problem, a, ev.step_s),
                    "max_over_mean": ev.max_over_mean, "all": start, "plan_s": plan_s},
           "torchrec": {"all": theirs}, "bounds": bounds, "replicas": what_if}
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

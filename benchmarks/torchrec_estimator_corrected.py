"""Where TorchRec's estimator is wrong about gemc's and TorchRec's sparse plans (issue 19).

    .venv/bin/python benchmarks/torchrec_estimator_corrected.py              # 16,64,512,4096
    .venv/bin/python benchmarks/torchrec_estimator_corrected.py --worlds 16,64

Plans MLPerf DLRMv2's 26 tables (global batch 65,536, H200 hosts of 8) with gemc's CP-SAT
planner and with TorchRec 1.8.0's ``EmbeddingShardingPlanner`` (in TorchRec's own venv, as
``vs_torchrec.py`` does), records both plans' every shard (table, sharding type, ranks,
rows, cols), and prices both under TorchRec's own estimator: at its defaults, then with one
published correction at a time and all of them together (``torchrec_rates.VARIANTS``;
sources in ``torchrec_rates.SOURCES``). TorchRec computes every variant through its own
knobs (``Topology``'s bandwidths, a ``GeneralizedCommsBandwidth``) except PXN, which
depends on which host holds each shard and is re-derived from TorchRec's per-shard terms
(``torchrec_rates.rank_times``; without it the re-summed terms reproduce TorchRec's figure
to 0.001 ms, checked on every run).

Prints one table per size (each plan's max-rank ms under each variant, the rank and its
compute / comms split, and whether gemc's plan is no worse) and writes
``benchmarks/results/torchrec_estimator_corrected.json.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torchrec_rates as rates
import vs_torchrec as vt
from gemc.cost_model.calibration import default_calibration
from gemc.cost_model.hardware import get_gpu

from gemc.solver.evaluate import Pricer, evaluate
from gemc.solver.planners import run_planner
from gemc.table_format import render_table

LOCAL = 8


def gemc_side(world: int, calibration: Any
              ) -> tuple[Any, Any, float, list[dict[str, Any]], dict]:
    """gemc's plan of DLRMv2's tables at ``world`` ranks: (problem, planner result, its
    wall seconds, the tables as the worker names them, the plan as table name -> sharding
    and ranks)."""
    problem = vt.gemc_problem(1, world, calibration)
    tables = vt.tables_of(problem)
    t0 = time.perf_counter()
    g = run_planner(problem, "cpsat")
    seconds = time.perf_counter() - t0
    by_fqn = {t["fqn"]: t["name"] for t in tables}
    plan = {by_fqn[fqn]: {"sharding": c.sharding, "ranks": list(c.ranks)}
            for fqn, c in g.assignment.tables.items()}
    return problem, g, seconds, tables, plan


def case(py: Path, world: int, calibration: Any, timeout: float, plan_torchrec: bool,
         torchrec_plans_with: str = "torchrec", recorded: dict[str, Any] | None = None
         ) -> dict[str, Any]:
    """Both plans at ``world`` ranks, every variant of both; TorchRec's planner plans
    under the pricing ``torchrec_plans_with`` names (its knobs: PXN is no knob, so a
    pricing that re-derives it plans without it). ``recorded``: a recorded row of this
    size whose TorchRec plan and terms are taken instead of planning again (its plan does
    not depend on gemc's code; at 4,096 ranks its planner takes ~15 minutes)."""
    problem, g, seconds, tables, gemc_plan = gemc_side(world, calibration)
    req = {"world": world, "local": LOCAL, "hbm_bytes": 141e9,
           "batch": vt.GLOBAL_BATCH // world, "tables": tables, "terms": rates.PRICINGS}
    row: dict[str, Any] = {"world": world, "tables": tables, "gemc_plan_s": seconds,
                           "gemc_under_gemc_ms": g.evaluation.step_ms}
    t0 = time.perf_counter()
    mine = vt.run_worker(py, {**req, "gemc_plan": gemc_plan, "plan": False}, timeout)
    row["gemc_pricing_s"] = time.perf_counter() - t0
    if "error" in mine:
        row["error"] = f"pricing gemc's plan: {mine['error']}"
        return row
    row["versions"] = {k: mine.get(k) for k in ("torch", "torchrec")}
    terms = {p: {"a2a_bw": v["a2a_bw"], "gemc": v["gemc"]} for p, v in mine["terms"].items()}
    if recorded is not None:
        for p, v in recorded["terms"].items():
            if "torchrec" in v and p in terms:
                terms[p]["torchrec"] = v["torchrec"]
        for key in ("torchrec_plan_s", "torchrec_planned_with"):
            if key in recorded:
                row[key] = recorded[key]
        row["torchrec_from"] = recorded.get("from")
        theirs_shards = recorded["terms"].get("torchrec", {}).get("torchrec", {}).get("shards")
        if theirs_shards:  # TorchRec's plan under gemc's model as it is now, not as recorded
            a = vt.assignment_from_shards(problem, tables, theirs_shards, g.assignment.dense)
            row["torchrec_under_gemc_ms"] = evaluate(problem, a, Pricer(problem)).step_ms
    elif plan_torchrec:
        t0 = time.perf_counter()
        knobs = rates.PRICINGS[torchrec_plans_with]
        theirs = vt.run_worker(py, {**req, "gemc_plan": None, **knobs}, timeout)
        row["torchrec_planned_with"] = torchrec_plans_with
        row["torchrec_worker_s"] = time.perf_counter() - t0
        if "error" in theirs:
            row["torchrec_error"] = str(theirs["error"])
        else:
            row["torchrec_plan_s"] = theirs["torchrec_seconds"]
            for p, v in theirs["terms"].items():
                terms[p]["torchrec"] = v["torchrec"]
            a, odd = vt.torchrec_assignment(problem, tables, theirs["torchrec_plan"],
                                            g.assignment.dense)
            row["torchrec_under_gemc_ms"] = evaluate(problem, a, Pricer(problem)).step_ms
            row["torchrec_odd"] = odd
    # both plans' every shard as TorchRec priced them under each pricing ("shards" in each)
    row["terms"] = terms
    plans = [who for who in ("gemc", "torchrec") if who in terms["torchrec"]]
    row["unpriced"] = {who: terms["torchrec"][who]["unpriced"] for who in plans}
    return judge(row)


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """A size's variants and verdict from its recorded terms (``row["terms"]``)."""
    plans = [who for who in ("gemc", "torchrec") if who in row["terms"]["torchrec"]]
    gpu = get_gpu("h200")  # the estimator's hosts
    row["variants"] = {who: rates.reprice(row["terms"], who, row["world"], LOCAL,
                                          vt.GLOBAL_BATCH, row.get("tables"), gpu)
                       for who in plans}
    if "torchrec" in row["variants"]:
        row["verdict"] = rates.verdict(row["variants"]["gemc"], row["variants"]["torchrec"])
    return row


def split(r: dict[str, Any] | None) -> str:
    """'ms (rank R: compute + comms)' of one plan under one variant."""
    if not r:
        return "-"
    return f"{r['max_ms']:.2f} (r{r['rank']}: {r['compute_ms']:.2f} + {r['comms_ms']:.2f})"


def size_table(row: dict[str, Any]) -> str:
    """One size's table: both plans under every variant, and the verdict."""
    g = row.get("variants", {}).get("gemc", {})
    t = row.get("variants", {}).get("torchrec", {})
    ok = row.get("verdict", {})
    lines = [[v, split(g.get(v)), split(t.get(v)),
              "-" if v not in ok else ("yes" if ok[v] else "no")]
             for v in (*rates.VARIANTS, *rates.KERNEL_FIT)]
    return render_table(
        ["variant", "gemc plan ms (rank: compute + comms)",
         "TorchRec plan ms (rank: compute + comms)", "gemc <= TorchRec"], lines,
        title=f"{row['world']} ranks: max-rank ms under TorchRec 1.8.0's estimator "
              f"(gemc's model: gemc {vt.fmt(row.get('gemc_under_gemc_ms'))} ms, TorchRec "
              f"{vt.fmt(row.get('torchrec_under_gemc_ms'))} ms)")


def read_run(path: Path) -> dict[str, Any]:
    """A recorded run (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def write_run(path: Path, run: dict[str, Any]) -> None:
    """A run as JSON, gzipped when the name ends ``.gz`` (every shard of both plans under
    every pricing is megabytes of repeated keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(run, f, default=str)


def reprice_recorded(src: Path, dst: Path) -> int:
    """``--reprice``: every size of a recorded run judged again by this commit's
    re-derivations (TorchRec's own pricings are the recorded ones)."""
    run = read_run(src)
    run["repriced"] = {"from": str(src), "commit": _commit(),
                       "date": datetime.now(UTC).isoformat(timespec="seconds"),
                       "variants": {k: list(v) for k, v in rates.VARIANTS.items()}}
    for row in run["rows"]:
        if "terms" in row:
            print(size_table(judge(row)), flush=True)
    write_run(dst, run)
    return 0


def _commit() -> str:
    return subprocess.run(["git", "-C", str(vt.REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="16,64,512,4096")
    ap.add_argument("--torchrec-timeout", type=float, default=600.0,
                    help="seconds for each worker call (TorchRec's planner takes minutes at "
                         "512 ranks and more than 10 at 4,096)")
    ap.add_argument("--skip-torchrec-plan", default="",
                    help="worlds (e.g. 4096) where TorchRec's planner is not run: only "
                         "gemc's plan is priced")
    ap.add_argument("--json", default=str(vt.REPO / "benchmarks" / "results"
                                          / "torchrec_estimator_corrected.json.gz"))
    ap.add_argument("--torchrec-plans-with", default="torchrec", choices=sorted(rates.PRICINGS),
                    help="the pricing whose knobs TorchRec's planner plans under (default: "
                         "its own defaults, as in vs_torchrec.py)")
    ap.add_argument("--torchrec-terms-from", default=None,
                    help="a recorded run: take TorchRec's plan and its terms from it for the "
                         "sizes it holds, instead of running TorchRec's planner again")
    ap.add_argument("--reprice", default=None,
                    help="a recorded run's JSON: re-derive its variants from the per-shard "
                         "terms it holds (no planning, no TorchRec) and write them to --json")
    args = ap.parse_args()
    if args.reprice:
        return reprice_recorded(Path(args.reprice), Path(args.json))
    py = vt.setup_venv()
    skip = {int(w) for w in args.skip_torchrec_plan.split(",") if w}
    calibration = default_calibration("h200")
    commit = _commit()
    meta = {"commit": commit, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "sources": rates.SOURCES, "pricings": rates.PRICINGS,
            "variants": {k: list(v) for k, v in rates.VARIANTS.items()}}
    print(f"TorchRec's estimator corrected: {os.cpu_count()} CPUs, commit {commit}\n",
          flush=True)
    recorded: dict[int, dict[str, Any]] = {}
    if args.torchrec_terms_from:
        for r in read_run(Path(args.torchrec_terms_from))["rows"]:
            if "torchrec" in r.get("terms", {}).get("torchrec", {}):
                recorded[r["world"]] = {**r, "from": args.torchrec_terms_from}
    rows = []
    for world in map(int, args.worlds.split(",")):
        row = case(py, world, calibration, args.torchrec_timeout, world not in skip,
                   args.torchrec_plans_with, recorded.get(world))
        rows.append(row)
        print(size_table(row) if "variants" in row else f"{world}: {row.get('error')}",
              flush=True)
        if row.get("torchrec_error"):
            print(f"  TorchRec's side: {row['torchrec_error']}", flush=True)
        write_run(Path(args.json), {**meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

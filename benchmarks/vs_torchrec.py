"""gemc's sparse planner side by side with TorchRec's ``EmbeddingShardingPlanner`` (CPU).

    .venv/bin/python benchmarks/vs_torchrec.py                       # the full table
    .venv/bin/python benchmarks/vs_torchrec.py --worlds 16,64 --repeats 1
    .venv/bin/python benchmarks/vs_torchrec.py --setup-only          # just TorchRec's venv

The tables are MLPerf DLRMv2's (``examples/dlrm`` preset ``dlrmv2``: 26 Criteo tables capped
at 40M rows, 204M rows, dim 128, its pooling factors), and the same tables repeated
(``repeat``, 40 gives 1,040), at a global batch of 65,536 (local 65,536 / world), on
H200 hosts of 8 GPUs. Both planners plan the same tables with row-wise Adagrad as the table
optimizer (DLRMv2's; gemc: ``--table-optimizer rowwise_adagrad``, TorchRec: fused
``EXACT_ROWWISE_ADAGRAD``). Each plan is priced under both cost models:

* gemc's: ``gemc.solver.evaluate`` (held equal to ``predict_step``): the predicted step, ms,
  of the whole model, the dense part planned by gemc for both (TorchRec plans tables only);
* TorchRec's: its planner's own figure of merit (``NoopPerfModel``: the largest per-rank
  sum of the shards' estimated perf, ms) from TorchRec's perf estimator, with its default
  link rates (what its planner plans with), again told H200's link rates
  (``H200_BANDWIDTHS``), and again told H200's link rates and HBM bandwidth
  (``H200_RATES``: its compute estimates divide bytes by ``hbm_mem_bw``, whose default is
  963 GB/s, an A100's; the H200 streams 4.8 TB/s).

TorchRec runs in its own venv, ``benchmarks/.venv_torchrec`` (gitignored), which this script
creates on first use: torch 2.13.0 (CPU) then ``torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0``
with ``--no-deps`` and their pure-Python dependencies, and is called through
``benchmarks/torchrec_worker.py`` in a subprocess with a time limit (``--torchrec-timeout``;
its planner takes minutes at 4,096 ranks and more than 15 at 1,040 tables).

Planning seconds are wall clock on a shared machine: noisy (repeat and compare).
Writes ``benchmarks/results/vs_torchrec.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gemc.cost_model.calibration import default_calibration  # noqa: E402
from gemc.cost_model.topology import parse_topology  # noqa: E402
from gemc.passes.parallelize import step_options  # noqa: E402

from gemc.api import load_model  # noqa: E402
from gemc.capture import capture  # noqa: E402
from gemc.replan import annotate  # noqa: E402
from gemc.solver.evaluate import Pricer, evaluate  # noqa: E402
from gemc.solver.infeasible import PlanInfeasibleError  # noqa: E402
from gemc.solver.local_search import move_budget, spread_sends  # noqa: E402
from gemc.solver.planners import BALANCE_MOVES_SHARE, run_planner  # noqa: E402
from gemc.solver.problem import Assignment, TableChoice, problem_from_graph  # noqa: E402
from gemc.table_format import render_table  # noqa: E402

DLRM = f"{REPO}/examples/dlrm/model.py:build"
VENV = REPO / "benchmarks" / ".venv_torchrec"
WORKER = REPO / "benchmarks" / "torchrec_worker.py"
GLOBAL_BATCH = 65536
# H200 HGX link rates for TorchRec's estimator (bytes/ms, its unit): NVLink 4 at 450 GB/s
# a direction, one ConnectX-7 400 Gb/s NIC (50 GB/s) per GPU. Its defaults are 600 GiB/s
# and 12.5 GiB/s (a 100 Gb/s NIC): both plans are priced under both.
H200_BANDWIDTHS = {"intra_host_bw": 450e9 / 1e3, "inter_host_bw": 50e9 / 1e3}
# ... and HBM's 4.8 TB/s (the H200 datasheet's, gemc.cost_model.hardware), for TorchRec's
# lookup compute estimates (its default hbm_mem_bw is 963 GB/s)
H200_RATES = {**H200_BANDWIDTHS, "hbm_mem_bw": 4.8e12 / 1e3}
# the pricings besides TorchRec's defaults: name in the request and the row -> rates
PRICED_WITH = {"h200bw": H200_BANDWIDTHS, "h200": H200_RATES}
# TorchRec's sharding names -> gemc's (one table each way: the worker holds the inverse)
FROM_TORCHREC = {"table_wise": "table_wise", "row_wise": "row_wise",
                 "column_wise": "column_wise", "table_row_wise": "table_row_wise",
                 "data_parallel": "data_parallel", "grid_shard": "grid"}


def setup_venv() -> Path:
    """TorchRec's venv (created once): torch 2.13.0 CPU, then torchrec and fbgemm-gpu-cpu
    1.8.0 without their dependency pins (which would pull another torch), then the
    pure-Python packages they import."""
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import torchrec"],
                                      capture_output=True).returncode == 0:
        return py
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "torchrec==1.8.0",
         "fbgemm-gpu-cpu==1.8.0", "tensordict"],
        [str(py), "-m", "pip", "install", "-q", "numpy", "tqdm", "pyre-extensions",
         "torchmetrics==1.0.3", "cloudpickle", "packaging", "importlib_metadata", "orjson",
         "pyvers"],
    ]
    for cmd in steps:
        print("setup:", " ".join(cmd[2:] if cmd[0] == str(py) else cmd), flush=True)
        subprocess.run(cmd, check=True)
    return py


def gemc_problem(repeat: int, world: int, calibration: Any) -> Any:
    topo = f"h200:{world // 8}x8"
    margs = {"preset": "dlrmv2", "repeat": repeat, "batch_size": GLOBAL_BATCH // world}
    spec = load_model(DLRM, margs)
    captured = capture(spec, entrypoint=DLRM)
    gm, ctx = annotate(captured, parse_topology(topo), entrypoint=DLRM, args=margs,
                       calibration=calibration)
    return problem_from_graph(gm, ctx, options=step_options("rowwise_adagrad"))


def add_what_if_coalesce(ap: argparse.ArgumentParser) -> None:
    """The ``--what-if-coalesce-s`` option (read by :func:`apply_what_if_coalesce`)."""
    ap.add_argument("--what-if-coalesce-s", type=float, default=None,
                    help="a sensitivity study: plan and price with the cost model's "
                         "kernels.COALESCE_DUPLICATE_S (seconds a duplicate id on the sparse "
                         "route, 2.65e-7 shipped) set to this; not what gemc compiles")


def apply_what_if_coalesce(args: argparse.Namespace) -> None:
    """Set the duplicate price the option names, before any table is priced."""
    if args.what_if_coalesce_s is not None:
        from gemc.cost_model import kernels
        kernels.COALESCE_DUPLICATE_S = args.what_if_coalesce_s
        print(f"what-if: kernels.COALESCE_DUPLICATE_S = {args.what_if_coalesce_s:g} s", flush=True)


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (CP-SAT's worker)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def tables_of(problem: Any) -> list[dict[str, Any]]:
    return [{"name": f"t{i}", "fqn": t.fqn, "rows": t.rows, "dim": t.dim,
             "pooling": max(1, round(t.nnz / t.batch))} for i, t in enumerate(problem.tables)]


def torchrec_assignment(problem: Any, tables: list[dict[str, Any]], plan: dict[str, Any],
                        dense: dict[str, Any]) -> tuple[Assignment, list[str]]:
    """TorchRec's plan in gemc's terms (shards in offset order); what gemc cannot express
    (uneven column shards, grid) is listed."""
    out, odd = {}, []
    for t in tables:
        p = plan[t["name"]]
        kind = FROM_TORCHREC[p["sharding"]]
        if kind == "data_parallel":
            out[t["fqn"]] = TableChoice(kind, tuple(range(problem.world)))
            continue
        shards = sorted(p["shards"], key=lambda s: (s["offsets"][1], s["offsets"][0]))
        if kind == "column_wise" and len({s["sizes"][1] for s in shards}) > 1:
            odd.append(f"{t['name']}: uneven column shards")
        if kind == "grid":
            odd.append(f"{t['name']}: grid_shard")
        out[t["fqn"]] = TableChoice(kind, tuple(s["rank"] for s in shards))
    return Assignment(dense=dict(dense), tables=out), odd


def assignment_from_shards(problem: Any, tables: list[dict[str, Any]],
                           shards: list[dict[str, Any]], dense: dict[str, Any]) -> Assignment:
    """A plan in gemc's terms from its per-shard records (``table``, ``sharding`` in gemc's
    names, ``ranks``, ``row_offset``, ``col_offset``: what a ``torchrec_estimator_corrected``
    run records of each plan): the shards in offset order, column ranges first (the order
    ``Sharding.shards`` cuts them in). Why: a recorded TorchRec plan is priced again under
    gemc's model as it is now, not quoted from the run that recorded it."""
    fqn = {t["name"]: t["fqn"] for t in tables}
    by_table: dict[str, list[dict[str, Any]]] = {}
    for s in shards:
        by_table.setdefault(s["table"], []).append(s)
    out = {}
    for name, mine in by_table.items():
        kind = mine[0]["sharding"]
        if kind == "data_parallel":
            out[fqn[name]] = TableChoice(kind, tuple(range(problem.world)))
            continue
        mine = sorted(mine, key=lambda s: (s["col_offset"], s["row_offset"]))
        out[fqn[name]] = TableChoice(kind, tuple(r for s in mine for r in s["ranks"]))
    return Assignment(dense=dict(dense), tables=out)


def run_worker(py: Path, req: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "req.json").write_text(json.dumps(req))
        try:
            proc = subprocess.run([str(py), str(WORKER), f"{d}/req.json", f"{d}/res.json"],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"TorchRec's planner ran past {timeout:.0f} s"}
        if proc.returncode != 0:
            return {"error": proc.stderr.strip().splitlines()[-1:]}
        return json.loads((Path(d) / "res.json").read_text())


def spread_study(py: Path, problem: Any, a: Assignment, req: dict[str, Any], timeout: float,
                 tolerances: list[float]) -> dict[str, Any]:
    """gemc's plan with its pooled sends spread further than the planner does
    (``spread_sends`` with the step let rise by each tolerance), priced by both models:
    what a plan whose ranks send evenly costs in gemc's step and buys under TorchRec's
    estimator (which charges each shard's outputs to its rank)."""
    pricer = Pricer(problem)
    by_fqn = {t["fqn"]: t["name"] for t in req["tables"]}
    out = {}
    for tol in tolerances:
        b = spread_sends(problem, pricer, a, tolerance=tol,
                         max_moves=move_budget(problem) // BALANCE_MOVES_SHARE)
        ev = evaluate(problem, b, pricer)
        plan = {by_fqn[f]: {"sharding": c.sharding, "ranks": list(c.ranks)}
                for f, c in b.tables.items()}
        priced = run_worker(py, {**req, "gemc_plan": plan, "plan": False}, timeout)
        out[f"{tol:g}"] = {
            "gemc_ms": ev.step_ms, "max_rank_sends_mb": float(ev.out.max()) / 1e6,
            "mem_gb": [float(ev.memory.max()) / 1e9, float(ev.memory.mean()) / 1e9],
            **{f"torchrec{'_' + n if n else ''}_ms":
               (priced.get(f"gemc_under_torchrec{'_' + n if n else ''}") or {}).get("max_perf_ms")
               for n in ("", *PRICED_WITH)}}
        print(f"    spread, step let rise {100 * tol:g}%: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in out[f"{tol:g}"].items()), flush=True)
    return out


def case(py: Path, repeat: int, world: int, calibration: Any, timeout: float,
         plan_torchrec: bool, spread_tolerances: list[float] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    problem = gemc_problem(repeat, world, calibration)
    capture_s = time.perf_counter() - t0
    tables = tables_of(problem)
    row: dict[str, Any] = {"tables": len(tables), "world": world, "capture_s": capture_s}
    t0, c0 = time.perf_counter(), cpu_seconds()
    try:
        g = run_planner(problem, "cpsat")
    except PlanInfeasibleError as exc:
        row["gemc_error"] = exc.render()
        return row
    row["gemc_plan_s"] = time.perf_counter() - t0
    row["gemc_plan_cpu_s"] = cpu_seconds() - c0  # with CP-SAT's child: less load-dependent
    row["gemc_report"] = g.report
    row["gemc_under_gemc_ms"] = g.evaluation.step_ms
    mem = g.evaluation.memory
    row["gemc_mem_gb"] = [float(mem.max()) / 1e9, float(mem.mean()) / 1e9]
    row["gemc_shardings"] = dict(Counter(c.sharding for c in g.assignment.tables.values()))
    by_fqn = {t["fqn"]: t["name"] for t in tables}
    gemc_plan = {by_fqn[fqn]: {"sharding": c.sharding, "ranks": list(c.ranks)}
                 for fqn, c in g.assignment.tables.items()}
    row["gemc_plan"] = gemc_plan
    req = {"world": world, "local": 8, "hbm_bytes": 141e9, "batch": GLOBAL_BATCH // world,
           "tables": tables, "gemc_plan": gemc_plan,
           "priced_with": PRICED_WITH}
    # TorchRec's pricing of gemc's plan first (quick: repeated tables enumerate once), then
    # its planner under the time limit
    priced = run_worker(py, {**req, "plan": False}, timeout)
    row["torchrec_versions"] = {k: priced.get(k) for k in ("torch", "torchrec")}
    row["gemc_under_torchrec"] = priced.get("gemc_under_torchrec")
    for name in PRICED_WITH:
        row[f"gemc_under_torchrec_{name}"] = priced.get(f"gemc_under_torchrec_{name}")
    if spread_tolerances:
        row["spread_study"] = spread_study(py, problem, g.assignment, req, timeout,
                                           spread_tolerances)
    if not plan_torchrec:
        return row
    tr = run_worker(py, {**req, "gemc_plan": None}, timeout)
    if "error" in tr:
        row["torchrec_error"] = tr["error"]
        return row
    if "torchrec_plan" in tr:
        row["torchrec_plan_s"] = tr["torchrec_seconds"]
        row["torchrec_under_torchrec"] = tr["torchrec_under_torchrec"]
        for name in PRICED_WITH:
            row[f"torchrec_under_torchrec_{name}"] = tr.get(f"torchrec_under_torchrec_{name}")
        row["torchrec_shardings"] = dict(Counter(p["sharding"]
                                                 for p in tr["torchrec_plan"].values()))
        row["torchrec_plan"] = tr["torchrec_plan"]
        a, odd = torchrec_assignment(problem, tables, tr["torchrec_plan"], g.assignment.dense)
        ev = evaluate(problem, a, Pricer(problem))
        row["torchrec_under_gemc_ms"] = ev.step_ms
        row["torchrec_mem_gb_gemc"] = [float(ev.memory.max()) / 1e9,
                                       float(ev.memory.mean()) / 1e9]
        row["torchrec_fits_gemc_cap"] = bool(ev.feasible)
        row["torchrec_odd"] = odd
    return row


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="16,64,512,4096")
    ap.add_argument("--repeats", default="1,40", help="table-set repeats (1: DLRMv2's 26)")
    ap.add_argument("--torchrec-timeout", type=float, default=900.0)
    ap.add_argument("--skip-torchrec-plan", default="",
                    help="tables,world pairs (e.g. 1040,4096) where only gemc's plan is priced "
                         "by TorchRec, its planner not run")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "vs_torchrec.json"))
    ap.add_argument("--setup-only", action="store_true")
    ap.add_argument("--spread-tolerances", default="",
                    help="also price gemc's plan with its pooled sends spread at these step "
                         "tolerances (e.g. 0.01,0.05; local_search.spread_sends)")
    add_what_if_coalesce(ap)
    args = ap.parse_args()
    py = setup_venv()
    if args.setup_only:
        return 0
    skip = {tuple(map(int, p.split(","))) for p in args.skip_torchrec_plan.split(";") if p}
    apply_what_if_coalesce(args)
    tolerances = [float(x) for x in args.spread_tolerances.split(",") if x]
    calibration = default_calibration("h200")
    rows, results = [], []
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"vs TorchRec: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"commit {commit}\n", flush=True)
    for repeat in map(int, args.repeats.split(",")):
        for world in map(int, args.worlds.split(",")):
            r = case(py, repeat, world, calibration, args.torchrec_timeout,
                     (26 * repeat, world) not in skip, tolerances)
            results.append(r)
            gt = r.get("gemc_under_torchrec") or {}
            tt = r.get("torchrec_under_torchrec") or {}
            priced = [fmt((r.get(f"{who}_under_torchrec_{name}") or {}).get("max_perf_ms"))
                      for name in PRICED_WITH for who in ("gemc", "torchrec")]
            rows.append([
                r["tables"], world, fmt(r.get("torchrec_plan_s"), ".1f"),
                fmt(r.get("gemc_plan_s"), ".1f") + " / " + fmt(r.get("gemc_plan_cpu_s"), ".1f"),
                fmt(r.get("gemc_under_gemc_ms")), fmt(r.get("torchrec_under_gemc_ms")),
                fmt(gt.get("max_perf_ms")), fmt(tt.get("max_perf_ms")),
                *priced,
                "/".join(fmt(x, ".1f") for x in r.get("gemc_mem_gb", [])) or "-",
                "/".join(fmt(x, ".1f") for x in r.get("torchrec_mem_gb_gemc", [])) or "-",
                r.get("gemc_error", "") and "gemc: infeasible"
                or (str(r.get("torchrec_error", ""))[:60]),
            ])
            print(f"  done {r['tables']} tables x {world}: " + " | ".join(map(str, rows[-1])),
                  flush=True)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(
                {"commit": commit, "cpus": os.cpu_count(), "rows": results,
                 "what_if_coalesce_s": args.what_if_coalesce_s}, indent=1,
                default=str))
    print(render_table(
        ["tables", "ranks", "TorchRec plan s", "gemc plan s (wall / cpu)", "gemc plan @gemc ms",
         "TorchRec plan @gemc ms", "gemc plan @TorchRec ms", "TorchRec plan @TorchRec ms",
         "gemc plan @TorchRec H200 bw ms", "TorchRec plan @TorchRec H200 bw ms",
         "gemc plan @TorchRec H200 bw+HBM ms", "TorchRec plan @TorchRec H200 bw+HBM ms",
         "gemc max/mean GB", "TorchRec max/mean GB @gemc", "note"], rows,
        title="gemc vs TorchRec 1.8 planner, DLRMv2 tables, global batch 65,536, H200 x8 hosts"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

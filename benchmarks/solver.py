"""Solver benchmark: every planner on the GEM and DLRM examples from 8 to 4096 GPUs.

    .venv/bin/python benchmarks/solver.py                 # the full table (~15 min, 2 cores)
    .venv/bin/python benchmarks/solver.py --quick         # gem tiny + dlrm h200, 8 and 64 GPUs
    .venv/bin/python benchmarks/solver.py --json out.json

Each model is captured and annotated once (capture dominates a GEM-scale compile); each
(topology, planner) then runs the parallelize pass's planner on the annotated graph, as
``gemc compile`` would. Printed per case: solve seconds (the planner, wall clock; capture
reported apart), the predicted step, max / mean memory per rank, and for CP-SAT its status,
the gap between its solution and its own lower bound, and how much faster than greedy.
The step is the solver's ``evaluate``, which tests hold equal to ``predict_step`` (cheaper
here: ``predict_step`` also builds the world x world all-to-all matrix, ~1 s at 4096 ranks).

gem-xl runs at its preset's local batch (256 samples per GPU; ``--gem-xl-batch`` overrides
it: at 4096 the saved activations alone are ~1.3 TB per GPU and every planner prints the
error that says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gemc.cost_model.calibration import default_calibration  # noqa: E402
from gemc.cost_model.topology import parse_topology  # noqa: E402

from gemc.api import load_model  # noqa: E402
from gemc.capture import capture  # noqa: E402
from gemc.replan import annotate  # noqa: E402
from gemc.solver.infeasible import PlanInfeasibleError  # noqa: E402
from gemc.solver.planners import PLANNERS, run_planner  # noqa: E402
from gemc.solver.problem import SolverSettings, problem_from_graph  # noqa: E402
from gemc.table_format import render_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GEM = f"{REPO}/examples/gem/model.py:build"
DLRM = f"{REPO}/examples/dlrm/model.py:build"
TOPOLOGIES = ("h200:1x8", "h200:8x8", "h200:64x8", "h200:512x8")


def models(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    if args.quick:
        return [("gem tiny", GEM, {"preset": "tiny"}), ("dlrm h200", DLRM, {"preset": "h200"})]
    return [
        ("gem tiny", GEM, {"preset": "tiny"}),
        ("gem h200", GEM, {"preset": "h200"}),
        ("gem-xl" + (f" b{args.gem_xl_batch}" if args.gem_xl_batch else ""), GEM,
         {"preset": "gem-xl", **({"batch_size": args.gem_xl_batch} if args.gem_xl_batch
                                 else {})}),
        ("dlrm h200", DLRM, {"preset": "h200"}),
        ("dlrm xl", DLRM, {"preset": "xl"}),
    ]


def run_case(problem, planner: str) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        r = run_planner(problem, planner)
    except PlanInfeasibleError as exc:
        return {"planner": planner, "seconds": time.perf_counter() - start,
                "error": exc.render()}
    ev, rep = r.evaluation, r.report
    row = {
        "planner": planner, "seconds": time.perf_counter() - start,
        "phases": {k: round(v, 2) for k, v in r.seconds.items()},
        "step_ms": ev.step_ms, "max_gb": float(ev.memory.max()) / 1e9,
        "mean_gb": float(ev.memory.mean()) / 1e9, "cap_gb": problem.cap_bytes / 1e9,
        "report": rep,
    }
    if rep.get("bound_ms"):
        row["vs_bound"] = (ev.step_ms - rep["bound_ms"]) / ev.step_ms
    return row


def fmt(row: dict[str, Any], greedy_ms: float | None) -> list[Any]:
    if "error" in row:
        first = row["error"].split(":")[0][:70]
        return [row["planner"], f"{row['seconds']:.1f}", "infeasible", "-", "-", "-", "-",
                first]
    rep = row["report"]
    status = rep.get("status", "")
    if status not in ("heuristic",):
        status = f"{status}/{rep.get('kept')}"
    vs_greedy = (f"{100 * (row['step_ms'] / greedy_ms - 1):+.1f}%"
                 if greedy_ms and row["planner"] == "cpsat" else "")
    gap = f"{100 * row['vs_bound']:.2f}%" if "vs_bound" in row else ""
    return [row["planner"], f"{row['seconds']:.1f}", f"{row['step_ms']:.2f}",
            f"{row['max_gb']:.1f}", f"{row['mean_gb']:.1f}", gap, vs_greedy, status]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--time-limit", type=float, default=5.0,
                    help="CP-SAT deterministic seconds per case (default 5)")
    ap.add_argument("--gem-xl-batch", type=int, default=None)
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--json", help="also write every row here")
    args = ap.parse_args()
    topologies = args.topologies.split(",") if not args.quick else ["h200:1x8", "h200:8x8"]
    settings = SolverSettings(time_limit_s=args.time_limit)
    calibration = default_calibration("h200")
    results = []
    print(f"gemc solver benchmark: {os.cpu_count()} CPUs, CP-SAT {settings.workers} workers, "
          f"{args.time_limit:g} deterministic s per case, calibration "
          f"{'h200' if calibration else 'none (roofline)'}\n")
    for name, entry, margs in models(args):
        t = time.perf_counter()
        spec = load_model(entry, margs)
        captured = capture(spec, entrypoint=entry)
        gm, ctx = annotate(captured, parse_topology(topologies[0]), entrypoint=entry,
                           args=margs, calibration=calibration)
        capture_s = time.perf_counter() - t
        rows = []
        for topo_spec in topologies:
            ctx.topology = parse_topology(topo_spec)
            t = time.perf_counter()
            problem = problem_from_graph(gm, ctx, settings)
            extract_s = time.perf_counter() - t
            cases = [run_case(problem, p) for p in reversed(PLANNERS)]  # naive, greedy, cpsat
            greedy = next((c.get("step_ms") for c in cases if c["planner"] == "greedy"), None)
            for c in cases:
                c.update(model=name, topology=topo_spec, gpus=problem.world,
                         extract_s=extract_s, capture_s=capture_s)
                rows.append([name, problem.world, *fmt(c, greedy)])
                results.append(c)
        print(render_table(
            ["model", "GPUs", "planner", "solve s", "step ms", "max GB", "mean GB",
             "vs bound", "vs greedy", "status"], rows,
            title=f"{name}: {len(problem.tables)} tables, {len(problem.regions)} regions; "
                  f"capture + annotate {capture_s:.1f} s"))
        print(flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planning time of gemc's sparse planner on MLPerf DLRMv2's tables (CPU, issue 19).

    .venv/bin/python benchmarks/planner_time.py                     # 26 and 1,040 tables
    .venv/bin/python benchmarks/planner_time.py --cases 26x16,26x64 --runs 2

Captures the same problems as ``benchmarks/vs_torchrec.py`` (``examples/dlrm`` preset
``dlrmv2``, its tables repeated ``tables / 26`` times, global batch 65,536, H200 hosts of
8, row-wise Adagrad) and times ``run_planner(problem, "cpsat")`` with the compile's
default settings, ``--runs`` times each: wall seconds, CPU seconds of this process and of
CP-SAT's child processes (less load-dependent than wall on a shared machine), the
predicted step, max / mean rank memory, and wall seconds per phase. Capture is not
counted. Plans must be identical run to run (deterministic budget): checked and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gemc.cost_model.calibration import default_calibration  # noqa: E402
from vs_torchrec import gemc_problem  # noqa: E402

from gemc.solver.planners import run_planner  # noqa: E402


def cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="26x16,26x64,26x512,26x4096,1040x64,1040x512,1040x4096",
                    help="TABLESxRANKS, comma-separated (TABLES a multiple of 26)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    calibration = default_calibration("h200")
    rows = []
    for case in args.cases.split(","):
        tables, world = map(int, case.split("x"))
        problem = gemc_problem(tables // 26, world, calibration)
        plans = []
        for run in range(args.runs):
            load = os.getloadavg()[0]
            t, (c_self, c_kids) = time.perf_counter(), cpu()
            r = run_planner(problem, "cpsat")
            wall = time.perf_counter() - t
            d_self, d_kids = (x - y for x, y in zip(cpu(), (c_self, c_kids)))
            mem = r.evaluation.memory
            row = {"tables": tables, "world": world, "run": run, "load_1min": load,
                   "wall_s": wall, "cpu_self_s": d_self, "cpu_children_s": d_kids,
                   "step_ms": r.evaluation.step_ms, "max_gb": float(mem.max()) / 1e9,
                   "mean_gb": float(mem.mean()) / 1e9, "report": r.report,
                   "phases_s": r.seconds}
            rows.append(row)
            plans.append(r.assignment)
            print(f"{tables} x {world} run {run}: wall {wall:.1f} s, cpu {d_self:.1f} + "
                  f"{d_kids:.1f} s (load {load:.1f}); step {r.evaluation.step_ms:.3f} ms, "
                  f"max/mean {row['max_gb']:.1f}/{row['mean_gb']:.1f} GB; phases "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r.seconds.items()), flush=True)
        if len(plans) > 1:
            print(f"  identical plans: {all(p == plans[0] for p in plans)}", flush=True)
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1, default=str))
        tmp.rename(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

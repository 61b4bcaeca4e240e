"""Which plan the cpsat planner keeps: the host's launches and the balance's step tolerance (CPU, issue 19).

    .venv/bin/python benchmarks/planner_choice.py                       # the figures below
    .venv/bin/python benchmarks/planner_choice.py --cases 1040x64 --cap-tolerances 0.05,0.1

For each case, ``run_planner(problem, "cpsat")`` with the compile's settings, twice: the
plan kept by the step with the host's exposed time (the planner's rule since s14,
``gemc.solver.problem.host_step_s``), and the plan kept by the device step alone (the
problem without its ``host_s``, the rule before). Printed per pick: the plan's device step,
its step with the host (what the plan's ``predicted.step_ms`` states), max / mean rank
memory, which planner's plan was kept and by which balance search. ``--cap-tolerances``
runs the host-aware pick again at each ``balance_cap_tolerance``.

Cases: ``TABLESxRANKS`` are DLRMv2's tables as in ``benchmarks/vs_torchrec.py`` (global
batch 65,536, H200 hosts of 8, row-wise Adagrad); ``gem_tiny`` is the GEM example's tiny
preset on h200:2x4 (``tests/solver/test_pass.py``'s case).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gemc.cost_model.calibration import default_calibration  # noqa: E402
from vs_torchrec import gemc_problem  # noqa: E402

from gemc.solver.planners import run_planner  # noqa: E402
from gemc.solver.problem import Problem, host_step_s, problem_from_graph  # noqa: E402

GEM = f"{REPO / 'examples' / 'gem' / 'model.py'}:build"


def gem_tiny_problem() -> Problem:
    from gemc.cost_model.topology import parse_topology

    from gemc.api import load_model
    from gemc.capture import capture
    from gemc.replan import annotate

    captured = capture(load_model(GEM, {"preset": "tiny"}), entrypoint=GEM)
    gm, ctx = annotate(captured, parse_topology("h200:2x4"), entrypoint=GEM,
                       args={"preset": "tiny"})
    return problem_from_graph(gm, ctx)


def pick(problem: Problem, label: str, **settings: float) -> dict[str, Any]:
    """One planner run; ``problem`` keeps its ``host_s`` unless ``label`` is device-only."""
    q = problem if label == "host-aware" else dataclasses.replace(problem, host_s=None)
    if settings:
        q = dataclasses.replace(q, settings=dataclasses.replace(q.settings, **settings))
    r = run_planner(q, "cpsat")
    ev = r.evaluation
    return {"pick": label, **settings, "kept": r.report.get("kept"),
            "balanced_by": r.report.get("balanced_by"),
            "device_ms": round(1e3 * ev.step_s, 3),
            "with_host_ms": round(1e3 * host_step_s(problem, r.assignment, ev.step_s), 3),
            "max_gb": round(float(ev.memory.max()) / 1e9, 1),
            "mean_gb": round(float(ev.memory.mean()) / 1e9, 1),
            "max_over_mean": round(ev.max_over_mean, 2),
            "replicas": sum(c.sharding == "data_parallel" for c in r.assignment.tables.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="gem_tiny,26x16,26x64,1040x64")
    ap.add_argument("--cap-tolerances", default="",
                    help="comma-separated balance_cap_tolerance values to run the "
                         "host-aware pick at as well")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    calibration = default_calibration("h200")
    rows = []
    for case in args.cases.split(","):
        if case == "gem_tiny":
            problem = gem_tiny_problem()
        else:
            tables, world = map(int, case.split("x"))
            problem = gemc_problem(tables // 26, world, calibration)
        runs = [pick(problem, "host-aware"), pick(problem, "device-only")]
        runs += [pick(problem, "host-aware", balance_cap_tolerance=float(t))
                 for t in args.cap_tolerances.split(",") if t]
        for run in runs:
            rows.append({"case": case, **run})
            print(case, json.dumps(run), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

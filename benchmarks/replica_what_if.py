"""What replicating more of DLRMv2's small tables costs and buys, under both models (CPU).

    .venv/bin/python benchmarks/replica_what_if.py --world 16

gemc's plan (``run_planner(problem, "cpsat")``, as ``benchmarks/vs_torchrec.py`` plans it)
is changed to replicate every table TorchRec's planner makes data parallel at this world
size (its 18 smallest at 16 ranks), then polished by gemc's local search
(``local_search.improve``: the tables moved one at a time, the step first); each of the
three plans is priced by gemc's model and by TorchRec's estimator at its three rate sets
(the worker of ``vs_torchrec.py``, in its venv ``benchmarks/.venv_torchrec``). Why: the
replica's price now follows the runner's bucketed step (one all-reduce a step); whether
gemc's planner stops short of TorchRec's replication because its model says so or
because its search does is what this separates. Writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gemc.cost_model.calibration import default_calibration  # noqa: E402
from gemc.cost_model.topology import parse_topology  # noqa: E402
from vs_torchrec import (  # noqa: E402
    GLOBAL_BATCH,
    PRICED_WITH,
    gemc_problem,
    run_worker,
    setup_venv,
    tables_of,
)

from gemc.solver.evaluate import Pricer, evaluate  # noqa: E402
from gemc.solver.local_search import improve  # noqa: E402
from gemc.solver.planners import run_planner  # noqa: E402
from gemc.solver.problem import TableChoice  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=16)
    ap.add_argument("--torchrec-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results"
                                          / "replica_what_if.json"))
    args = ap.parse_args()
    py = setup_venv()
    world = args.world
    problem = gemc_problem(1, world, default_calibration(
        parse_topology(f"h200:{world // 8}x8").gpu.name))
    tables = tables_of(problem)
    by_fqn = {t["fqn"]: t["name"] for t in tables}
    by_name = {t["name"]: t["fqn"] for t in tables}
    req = {"world": world, "local": 8, "hbm_bytes": 141e9, "batch": GLOBAL_BATCH // world,
           "tables": tables, "priced_with": PRICED_WITH}
    theirs = run_worker(py, {**req, "gemc_plan": None}, args.torchrec_timeout)
    replicated = sorted(by_name[n] for n, p in theirs["torchrec_plan"].items()
                        if p["sharding"] == "data_parallel")
    pricer = Pricer(problem)
    planned = run_planner(problem, "cpsat").assignment
    forced = replace(planned, tables={**planned.tables, **{
        f: TableChoice("data_parallel", tuple(range(world))) for f in replicated}})
    rows = []
    for name, a in (("gemc's plan", planned), ("+ TorchRec's replicas", forced),
                    ("+ TorchRec's replicas, improved", improve(problem, pricer, forced))):
        ev = evaluate(problem, a, pricer)
        plan = {by_fqn[f]: {"sharding": c.sharding, "ranks": list(c.ranks)}
                for f, c in a.tables.items()}
        priced = run_worker(py, {**req, "gemc_plan": plan, "plan": False},
                            args.torchrec_timeout)
        row = {"plan": name, "gemc_ms": ev.step_ms,
               "replica_all_reduce_ms": 1e3 * ev.breakdown["replica_all_reduce"],
               "shardings": dict(Counter(c.sharding for c in a.tables.values())),
               "max_over_mean": ev.max_over_mean, "max_rank_sends_mb": float(ev.out.max()) / 1e6,
               **{f"torchrec{'_' + n if n else ''}_ms":
                  (priced.get(f"gemc_under_torchrec{'_' + n if n else ''}") or {})
                  .get("max_perf_ms") for n in ("", *PRICED_WITH)}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.json).write_text(json.dumps({"world": world, "torchrec_replicas": len(replicated),
                                           "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

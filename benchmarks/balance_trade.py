"""What memory balance to ``balance_ratio`` costs in step on DLRMv2's tables (CPU, no GPU).

    .venv/bin/python benchmarks/balance_trade.py --worlds 16,64

For each rank count: the CP-SAT planner's plan before any balance trade (the step-first
plan ``planners._balanced`` receives), then ``local_search.cap_memory`` from it at the
planner's ``balance_ratio`` with the hard cap (penalty 0) and with the priced first phase
(``planners.CAP_PENALTY``): the step, its rise over the step-first plan, and max / mean
rank memory of each, beside the plan the planner keeps. Why: the planner keeps a capped
plan only within ``balance_cap_tolerance`` of the step, so where it stays above the ratio
this says by how much the cap would have cost (BENCHMARKS.md, issue 19).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gemc.cost_model.calibration import default_calibration  # noqa: E402
from vs_torchrec import add_what_if_coalesce, apply_what_if_coalesce, gemc_problem  # noqa: E402

from gemc.solver import candidates, planners  # noqa: E402
from gemc.solver.evaluate import Evaluation, Pricer, evaluate  # noqa: E402
from gemc.solver.local_search import cap_memory  # noqa: E402


def price_column_sums() -> None:
    """A sensitivity study (``--what-if-column-sums``), not what gemc compiles: charge each
    holder of a column-split table (column-wise, grid) under row-wise Adagrad the all-reduce
    of its per-row sums of squares over its column group, which the runner makes every step
    (``backends/torch/sparse_optim.rowwise_adagrad_rows_``, ``sq_group``: ``min(ids, rows)``
    fp32 values) and the step model does not price; the group is taken spread evenly over
    the world (its placement is not known when an option is priced). Only the solver's
    options are re-priced (``candidates.table_option``), so the figures compare with each
    other, not with ``predict_step``."""
    from dataclasses import replace

    from gemc.cost_model.collectives import collective_time
    from gemc.cost_model.memory import table_shard
    from gemc.cost_model.step_model import shard_work

    from gemc.sharding import SHARDINGS

    plain = candidates.table_option

    def table_option(problem: Any, t: Any, sharding: str, ranks: int,
                     grid: tuple[int, int] | None = None) -> Any:
        o = plain(problem, t, sharding, ranks, grid)
        k = SHARDINGS[sharding].column_blocks(ranks)
        if k <= 1 or o.replicated or problem.options.table_optimizer != "rowwise_adagrad":
            return o
        rep = replace(t, sharding=sharding, ranks=tuple(range(ranks)))
        rows, dim = table_shard(rep, 0)
        ids = shard_work(rep, rows, dim, problem.world)[2]
        group = tuple(range(0, problem.world, max(1, problem.world // k)))[:k]
        s = collective_time("all_reduce", min(ids, rows) * 4, group, problem.topology,
                            calibration=problem.calibration)
        return replace(o, compute_s=o.compute_s + s)

    candidates.table_option = table_option
    print("what-if: column groups' sum-of-squares all-reduce priced", flush=True)


def _row(ev: Evaluation, base: Evaluation) -> dict[str, Any]:
    mean = float(ev.memory.mean())
    return {"step_ms": ev.step_ms, "rise": ev.step_s / base.step_s - 1,
            "max_gb": float(ev.memory.max()) / 1e9, "mean_gb": mean / 1e9,
            "ratio": float(ev.memory.max()) / mean if mean else 1.0}


def trade(problem: Any) -> dict[str, Any]:
    """The step-first plan, the kept plan and the two cap searches, as ``_row``s."""
    seen: dict[str, Any] = {}
    inner = planners._balanced

    def spy(problem: Any, pricer: Pricer, a: Any, ev: Evaluation) -> Any:
        seen["a"], seen["ev"] = a, ev
        return inner(problem, pricer, a, ev)

    planners._balanced = spy
    try:
        kept = planners.run_planner(problem, "cpsat")
    finally:
        planners._balanced = inner
    base, pricer = seen["ev"], Pricer(problem)
    out = {"step_first": _row(base, base), "kept": _row(kept.evaluation, base)}
    for name, penalty in (("cap_hard", 0.0), ("cap_priced", planners.CAP_PENALTY)):
        b = cap_memory(problem, pricer, seen["a"], problem.settings.balance_ratio,
                       max_moves=problem.settings.search_moves, penalty=penalty)
        out[name] = _row(evaluate(problem, b, pricer), base)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="16,64")
    ap.add_argument("--repeat", type=int, default=1, help="table-set repeats (1: DLRMv2's 26)")
    ap.add_argument("--json", default=None)
    add_what_if_coalesce(ap)
    ap.add_argument("--what-if-column-sums", action="store_true",
                    help="price the column groups' sum-of-squares all-reduce "
                         "(price_column_sums; a sensitivity study)")
    args = ap.parse_args(argv)
    apply_what_if_coalesce(args)
    if args.what_if_column_sums:
        price_column_sums()
    calibration = default_calibration("h200")
    results = {}
    for world in map(int, args.worlds.split(",")):
        res = trade(gemc_problem(args.repeat, world, calibration))
        results[str(world)] = res
        for name, r in res.items():
            print(f"{26 * args.repeat} tables x {world:>4}  {name:<11} step {r['step_ms']:8.3f} ms "
                  f"({100 * r['rise']:+6.1f}%)  max/mean {r['max_gb']:6.2f}/{r['mean_gb']:5.2f} GB "
                  f"= {r['ratio']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

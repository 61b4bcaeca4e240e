"""The fullest rank the planner fitted against the fullest rank the plan predicts (CPU only).

    .venv/bin/python benchmarks/plan_memory_agreement.py            # the default cases
    .venv/bin/python benchmarks/plan_memory_agreement.py "examples/zoo/din.py:build|h200|h200:1x1|fp32|greedy"

Each case (``ENTRY|PRESET|TOPOLOGY|TABLE_PRECISION[|PLANNER]``, greedy by default) is
compiled with the shipped calibration; the row prints the plan's ``solver.max_memory_gb``
and ``solver.cap_gb`` (what the planner fitted) beside ``predicted.max_memory_gb`` (what
the plan predicts). Why: both come from one memory model now (``costing.priced_activations``
and ``memory.lookup_gradient_extra``), and a plan whose prediction exceeds the capacity it
was fitted in is a silently wrong plan (BENCHMARKS.md, issue 21: DLRM xl fitted at the cap,
predicted at 328 GB). A case that no plan fits prints the error's first line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gemc  # noqa: E402
from gemc.errors import GemcUserError  # noqa: E402

CASES = [
    "examples/dlrm/model.py:build|tiny|h200:1x2|fp32",
    "examples/dlrm/model.py:build|h200|h200:1x1|fp32",
    "examples/dlrm/model.py:build|h200|h200:1x8|fp32",
    "examples/dlrm/model.py:build|h200|h200:1x8|bf16",
    "examples/dlrm/model.py:build|h200|h200:1x8|fp32|cpsat",
    "examples/gem/model.py:build|h200|h200:1x8|fp32",
    "examples/zoo/hstu.py:build|h200|h200:1x8|fp32",
    "examples/zoo/din.py:build|h200|h200:1x1|fp32",
    "examples/zoo/din.py:build|h200|h200:1x4|fp32",
    "examples/zoo/mmoe.py:build|h200|h200:1x2|fp32",
    "examples/zoo/wukong.py:build|h200|h200:1x2|fp32",
    "examples/zoo/sasrec_bst.py:build|h200|h200:1x1|fp32",
    "examples/zoo/dlrm_dcnv2.py:build|h200|h200:2x8|fp8",
]


def row(case: str) -> str:
    """One markdown row: model preset, topology, tables, planner, fitted, cap, predicted."""
    entry, preset, topology, precision, *planner = case.split("|")
    name = entry.split("/")[-2] if entry.endswith("model.py:build") else \
        entry.split("/")[-1].split(".")[0]
    head = f"| {name} {preset} | {topology} | {precision} | {(planner or ['greedy'])[0]} |"
    try:
        plan = gemc.compile(entry, {"preset": preset}, topology=topology,
                            planner=(planner or ["greedy"])[0], table_precision=precision,
                            calibration="auto")
    except GemcUserError as exc:
        return f"{head} refused: {str(exc).splitlines()[0][:160]} | | |"
    solver, predicted = plan["solver"], plan["predicted"]["max_memory_gb"]
    return (f"{head} {solver['max_memory_gb']:.2f} | {solver['cap_gb']:.2f} | {predicted:.2f} "
            f"| {predicted - solver['max_memory_gb']:+.2f} |")


def main(argv: list[str]) -> int:
    print("| model preset | topology | tables | planner | fitted GB | cap GB | predicted GB "
          "| predicted - fitted |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for case in argv or CASES:
        print(row(case), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

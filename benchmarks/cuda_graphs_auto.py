"""What ``gemc run --compile-mode auto`` decides for each zoo model and example, from its plan.

    python benchmarks/cuda_graphs_auto.py                 # CPU, ~1 min: the h200 presets
    python benchmarks/cuda_graphs_auto.py --models transact,gem --out auto.json

Each model is compiled as ``benchmarks/zoo.py`` compiles it (h200 preset, one H200,
TF32), and ``backends/torch/cuda_graphs_choice.resolve_compile_mode`` is asked what a run
on one CUDA GPU would take: CUDA graphs where the plan's predicted host issue time (its
launches at the per-launch price) exceeds its predicted device time. A table per model:
launches, issue ms, device ms, the mode and the reason. Why a script: the decision is the
cost model's, and the step it predicts is only as good as that model. The measured
answer is ``zoo.py``'s ``gemc-nographs`` against ``gemc-cudagraphs`` on a GPU
(BENCHMARKS.md, thirty-first session).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = ("transact", "mmoe", "din", "wukong", "dlrm_dcnv2", "hstu", "sasrec_bst", "gem", "dlrm")


def entry_of(model: str) -> str:
    """A zoo model's or an example's ``path:build``."""
    repo = Path(__file__).resolve().parent.parent
    if model in ("gem", "dlrm"):
        return f"{repo / 'examples' / model / 'model.py'}:build"
    return f"{repo / 'examples' / 'zoo' / f'{model}.py'}:build"


def decide(model: str, preset: str, planner: str) -> dict[str, Any]:
    """One model's plan prediction and the auto decision on one CUDA GPU."""
    from gemc.backends.torch.cuda_graphs_choice import resolve_compile_mode

    from gemc.api import compile as gemc_compile

    plan = gemc_compile(entry_of(model), {"preset": preset, "seed": 0}, topology="h200:1x1",
                        planner=planner, fp32_matmul="tf32")
    predicted = plan.get("predicted") or {}
    host = predicted.get("host") or {}
    mode, why = resolve_compile_mode(None, device_type="cuda", executor="inductor",
                                     world_size=1, predicted=predicted)
    launches, per_us = host.get("launches"), host.get("per_launch_us")
    return {"model": model, "launches": launches,
            "issue_ms": launches * per_us / 1e3 if launches and per_us else None,
            "device_ms": predicted.get("device_step_ms"), "step_ms": predicted.get("step_ms"),
            "mode": mode, "reason": why}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--preset", default="h200")
    ap.add_argument("--planner", default="default", help="as zoo.py compiles (default)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'model':<12} {'launches':>8} {'issue ms':>9} {'device ms':>10}  mode")
    for model in args.models.split(","):
        try:
            row = decide(model, args.preset, args.planner)
        except Exception as exc:  # noqa: BLE001 - one model failing must not lose the others
            row = {"model": model, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{model:<12} failed: {row['error'][:200]}")
        else:
            fmt = lambda x: f"{x:.2f}" if isinstance(x, float) else "-"  # noqa: E731
            print(f"{model:<12} {row['launches'] or '-':>8} {fmt(row['issue_ms']):>9} "
                  f"{fmt(row['device_ms']):>10}  {row['mode'] or 'no CUDA graphs'}", flush=True)
        rows.append(row)
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(args.out)
    return rows


if __name__ == "__main__":
    main()

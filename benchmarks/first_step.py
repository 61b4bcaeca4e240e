"""The first step of a gemc run, cold and warm, and the kernel choices recorded in the plan.

    python benchmarks/first_step.py --out $OUT                        # H200: gem, h200 preset
    python benchmarks/first_step.py --model examples/dlrm/model.py:build --out $OUT
    python benchmarks/first_step.py --smoke --out /tmp/first-step     # CPU, tiny: a crash check

Issue 16 item 4: compile and autotune time are cached across runs and the first step is
reported. Each phase is ``gemc`` itself in a fresh process, as a user runs it:

1. ``gemc compile`` for ``h200:1x1`` -> ``OUT/plan.json``;
2. ``cold``: ``gemc run --cache-dir none`` (nothing cached: the cold first step);
3. ``measure``: ``gemc run --measure-kernels`` with the default cache (``OUT/gemc-cache``,
   empty: cold, and it fills the cache), each fused group timed against Inductor's code;
4. ``gemc record-choices`` folds those choices into the plan;
5. ``warm``: ``gemc run`` again: the plan's choices and the warm cache.

Writes ``OUT/first_step.json`` (per phase: first-step seconds, step ms, whether the cache
was warm, torch's cache counters, where the choices came from) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GEMC = [sys.executable, "-m", "gemc.cli"]


def _gemc(*args: str) -> None:
    print("$ gemc " + " ".join(args), flush=True)
    subprocess.run([*GEMC, *args], check=True, cwd=REPO)


def phase(report: Path) -> dict[str, Any]:
    """One run report, summarised."""
    r = json.loads(report.read_text())
    graph = r.get("graph_executor") or {}
    cache = r.get("compile_cache") or {}
    return {"first_step_s": r.get("first_step_s"), "step_ms": r.get("step_ms"),
            "cache_dir": cache.get("dir"), "warm": cache.get("warm"),
            "counters": cache.get("counters"),
            "choices": dict(Counter(graph.get("kernel_choices", {}).values())),
            "sources": dict(Counter(graph.get("choice_sources", {}).values()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the plan and the reports")
    p.add_argument("--model", default="examples/gem/model.py:build")
    p.add_argument("--preset", default=None, help="default h200 (tiny with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 10)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 2 steps")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    preset = args.preset or ("tiny" if args.smoke else "h200")
    steps = str(args.steps or (2 if args.smoke else 10))
    plan = str(out / "plan.json")
    device = ["--device", "cpu"] if args.smoke else []
    sets = ["--set", f"preset={preset}"] + (["--set", "batch_size=8"] if args.smoke else [])
    _gemc("compile", args.model, *sets, "--topology", "h200:1x1", "--out", plan, "--quiet")
    common = [plan, "--steps", steps, "--quiet", *device]
    _gemc("run", *common, "--cache-dir", "none", "--report", str(out / "cold.run.json"))
    _gemc("run", *common, "--measure-kernels", "--report", str(out / "measure.run.json"))
    _gemc("record-choices", plan, str(out / "measure.run.json"))
    _gemc("run", *common, "--report", str(out / "warm.run.json"))
    result = {"model": args.model, "preset": preset, "steps": int(steps),
              "phases": {name: phase(out / f"{name}.run.json")
                         for name in ("cold", "measure", "warm")}}
    (out / "first_step.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'phase':8} {'first step s':>12} {'step ms':>9} {'warm':>5}  sources")
    for name, row in result["phases"].items():
        first = f"{row['first_step_s']:.1f}" if row["first_step_s"] is not None else "-"
        step = f"{row['step_ms']:.2f}" if row["step_ms"] is not None else "-"
        print(f"{name:8} {first:>12} {step:>9} {row['warm']!s:>5}  {row['sources']}")
    print(f"wrote {out / 'first_step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

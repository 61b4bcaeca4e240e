"""gemc's compiled graph against torch.compile's, side by side on the CPU: what each hands
to Dynamo, AOTAutograd and Inductor on the first step.

    OMP_NUM_THREADS=1 python benchmarks/first_step_cpu.py --models dlrm,mmoe
    OMP_NUM_THREADS=1 python benchmarks/first_step_cpu.py --models gem --steps 2 --out /tmp/fs

Issue 16 wants gemc's cold first step within 1.5x torch.compile's on the H200, and DLRM,
MMoE and GEM were over. The H200's seconds are few and noisy; what makes them is mostly
the same on the CPU: how many Dynamo frames and graph breaks, how many FX nodes reach
AOTAutograd and Inductor (forward and backward graphs), how many kernels Inductor generates
(C++ here, Triton there: counted alike, fused alike up to the backends' rules), whether a
later step compiles again, and the Python-side compile seconds. So this runs both on the
CPU with Inductor (``GEMC_CPU_COMPILE_BACKEND=inductor``: the CPU tests use ``aot_eager``)
at a small preset, each variant in its own process with an empty Inductor cache, exactly as
``benchmarks/zoo.py --cold`` builds them:

``compile``  the reference trainer, the whole model under ``torch.compile``, each table's
             lookup eager (``ReferenceTrainer(compile_fn=...)``, zoo.py's baseline), bf16
             autocast;
``gemc``     the runner on the plan compiled for ``h200:1x1`` (graph mode: the rewritten
             graph with gemc's kernels as custom ops, trained through ``torch.compile``).

Both compile through one counting backend (Inductor's ``compile_fx`` with a counting
``inner_compile``), so the figures are taken at the same points. Per variant: first-step
and later steps' seconds, Dynamo frames compiled (per step: a compile after the first step
is a recompile), graph breaks, FX nodes Dynamo captured, nodes of each forward and
backward graph Inductor received, Inductor kernels generated, torch's phase timers, and
the ops whose counts differ most between the two variants' Inductor graphs. Writes
``OUT/first_step_cpu.json``. Not a timing of the GPU: the H200 command that confirms a
change is ``python3 benchmarks/zoo.py --models dlrm,mmoe --variants compile,gemc --steps 30
--warmup 3 --cold``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
VARIANTS = ("compile", "gemc")
MODELS = {"dlrm": "examples/dlrm/model.py:build", "mmoe": "examples/zoo/mmoe.py:build",
          "gem": "examples/gem/model.py:build"}
TIMERS = ("entire_frame_compile", "entire_backward_compile", "backend_compile",
          "create_aot_dispatcher_function", "_recursive_joint_graph_passes",
          "inductor_compile", "code_gen", "total_wall_time")


class Counting:
    """A ``torch.compile`` backend: Inductor, counting what each stage receives."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        from torch._inductor import metrics
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        self.frames.append({"nodes": _calls(gm)})

        def inner(g: Any, inputs: Any, **kw: Any) -> Any:
            before = metrics.generated_kernel_count
            t0 = time.perf_counter()
            out = compile_fx_inner(g, inputs, **kw)
            self.graphs.append({
                "backward": bool(kw.get("is_backward")), "nodes": _calls(g),
                "kernels": metrics.generated_kernel_count - before,
                "seconds": round(time.perf_counter() - t0, 3),
                "ops": dict(Counter(_op_name(n) for n in g.graph.nodes
                                    if n.op == "call_function"))})
            return out

        return compile_fx(gm, example_inputs, inner_compile=inner)


def _calls(gm: Any) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def _op_name(node: Any) -> str:
    t = node.target
    return str(getattr(t, "__name__", t)) if not hasattr(t, "_schema") else str(t)


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "frames_ok": int(counters["frames"]["ok"])}


def child(model: str, variant: str, plan_path: str, steps: int, margs: dict[str, Any],
          out: Path) -> int:
    """One variant in this process (fresh caches: the parent's environment)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # gemc's own kernels, before Triton loads
    os.environ["GEMC_CPU_COMPILE_BACKEND"] = "inductor"
    import torch
    from torch._dynamo import utils as dynamo_utils

    counting = Counting()
    per_step: list[dict[str, Any]] = []
    entry = str(REPO / MODELS[model])
    args = margs
    report: dict[str, Any] = {}
    t_set = time.perf_counter()
    if variant == "compile":
        from gemc.backends.torch.optimizers import resolve_optimizers
        from gemc.backends.torch.reference import ReferenceTrainer

        from gemc.api import load_model
        from gemc.plan import load_plan

        dense_cfg, emb_cfg = resolve_optimizers(load_plan(plan_path).get("optimizer"))
        trainer = ReferenceTrainer(
            load_model(entry, args, device="meta"), world_size=1, device=torch.device("cpu"),
            dense_cfg=dense_cfg, emb_cfg=emb_cfg, autocast_dtype=torch.bfloat16,
            compile_fn=lambda m: torch.compile(m, backend=counting))
        setup_s = time.perf_counter() - t_set
        for step in range(steps):
            before = _dynamo_counts()
            t0 = time.perf_counter()
            trainer.step(step)
            per_step.append({"s": round(time.perf_counter() - t0, 3),
                             **_delta(before, _dynamo_counts())})
    else:
        from gemc.backends.torch import graph_mode
        from gemc.backends.torch.runner import RunOptions, run

        graph_mode.compile_backend = lambda device: counting  # the same counting Inductor
        marks: list[tuple[float, dict[str, int]]] = [(time.perf_counter(), _dynamo_counts())]

        def on_step(n: int) -> None:
            marks.append((time.perf_counter(), _dynamo_counts()))

        setup_s = 0.0
        result = run(plan_path, RunOptions(steps=steps, device="cpu", progress=False,
                                           warmup_steps=0, on_step=on_step,
                                           divergence="off"))
        rep = result.report
        setup_s = float(rep.get("setup_s") or 0.0)
        times = [float(e["ms"]) / 1e3 for e in rep["losses"]]
        for i in range(1, len(marks)):
            per_step.append({"s": round(times[i - 1], 3) if i - 1 < len(times) else None,
                             **_delta(marks[i - 1][1], marks[i][1])})
        report = {"host_s": (rep.get("graph_executor") or {}).get("host_s"),
                  "kernels_applied": rep.get("kernels_applied"),
                  "table_lookups": Counter((rep.get("graph_executor") or {})
                                           .get("table_lookups", {}).values())}
    phases = {k: round(v, 3) for k, v in dynamo_utils.calculate_time_spent().items()
              if k in TIMERS}
    phases.update({k: round(sum(v), 3) for k, v in dynamo_utils.compilation_time_metrics.items()
                   if k in TIMERS})
    row = {"model": model, "variant": variant, "setup_s": round(setup_s, 3),
           "steps": per_step, "frames": counting.frames, "graphs": counting.graphs,
           "phases": phases, **report}
    (out / f"{model}.{variant}.json").write_text(json.dumps(row, indent=1, default=str))
    return 0


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """The side-by-side table's columns for one variant."""
    fw = [g for g in row["graphs"] if not g["backward"]]
    bw = [g for g in row["graphs"] if g["backward"]]
    steps = row["steps"]
    return {
        "first_s": steps[0]["s"] if steps else None,
        "later_s": max((s["s"] or 0.0 for s in steps[1:]), default=None),
        "frames": len(row["frames"]),
        "breaks": sum(s["graph_breaks"] for s in steps),
        "recompiles": sum(s["unique_graphs"] for s in steps[1:]),
        "dynamo_nodes": sum(f["nodes"] for f in row["frames"]),
        "fw_nodes": sum(g["nodes"] for g in fw), "bw_nodes": sum(g["nodes"] for g in bw),
        "fw_kernels": sum(g["kernels"] for g in fw), "bw_kernels": sum(g["kernels"] for g in bw),
        "inductor_s": round(sum(g["seconds"] for g in row["graphs"]), 2),
        "aot_s": row["phases"].get("create_aot_dispatcher_function"),
        "joint_passes_s": row["phases"].get("_recursive_joint_graph_passes"),
        "compile_s": row["phases"].get("total_wall_time"),
    }


COLUMNS = ("first_s", "later_s", "frames", "breaks", "recompiles", "dynamo_nodes",
           "fw_nodes", "bw_nodes", "fw_kernels", "bw_kernels", "compile_s", "aot_s",
           "joint_passes_s", "inductor_s")


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (model, variant), then the ops whose counts differ most per model."""
    head = f"{'model':<6} {'variant':<8} " + " ".join(f"{c:>14}" for c in COLUMNS)
    lines = [head]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(row["model"], {})[row["variant"]] = row
        if "error" in row:
            lines.append(f"{row['model']:<6} {row['variant']:<8} failed: {row['error']}")
            continue
        s = summarise(row)
        lines.append(f"{row['model']:<6} {row['variant']:<8} " + " ".join(
            f"{'-' if s[c] is None else s[c]:>14}" for c in COLUMNS))
    for model, rs in by_model.items():
        if not all(v in rs and "graphs" in rs[v] for v in VARIANTS):
            continue
        for backward in (False, True):
            ops = {v: Counter() for v in VARIANTS}
            for v in VARIANTS:
                for g in rs[v]["graphs"]:
                    if g["backward"] == backward:
                        ops[v].update(g["ops"])
            diff = sorted(set(ops["compile"]) | set(ops["gemc"]),
                          key=lambda o: -abs(ops["gemc"][o] - ops["compile"][o]))[:12]
            lines.append(f"{model} {'backward' if backward else 'forward'} ops, "
                         "compile -> gemc: " + ", ".join(
                             f"{o.removeprefix('aten.')} {ops['compile'][o]}->{ops['gemc'][o]}"
                             for o in diff if ops["gemc"][o] != ops["compile"][o]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dlrm,mmoe", help=f"of {', '.join(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--model-args", default=None, metavar="JSON",
                   help="more build() arguments, e.g. the h200 preset's layers at a CPU size: "
                   '\'{"preset": "h200", "batch_size": 64, "table_rows": [2000, ...]}\'')
    p.add_argument("--steps", type=int, default=3, help="steps per variant (a later step "
                   "that compiles is a recompile)")
    p.add_argument("--out", default=None, help="default: a temporary directory")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "VARIANT", "PLAN"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="first-step-cpu-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    margs = {"preset": args.preset, **json.loads(args.model_args or "{}")}
    if args.child:
        return child(*args.child, args.steps, margs, out)
    from gemc.api import compile as gemc_compile
    from gemc.plan import write_plan

    rows = []
    for model in args.models.split(","):
        plan = gemc_compile(str(REPO / MODELS[model]), margs,
                            topology="h200:1x1", planner="default", fp32_matmul="tf32")
        plan_path = out / f"{model}.plan.json"
        write_plan(plan_path, plan)
        for variant in args.variants.split(","):
            cache = tempfile.mkdtemp(prefix="first-step-cpu-cache-")
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
                   "TRITON_CACHE_DIR": cache + "/triton", "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, __file__, "--child", model, variant, str(plan_path),
                   "--steps", str(args.steps), "--preset", args.preset, "--out", str(out),
                   *(["--model-args", args.model_args] if args.model_args else [])]
            print(f"first_step_cpu: {model} / {variant} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, env=env, cwd=REPO)
            shutil.rmtree(cache, ignore_errors=True)
            path = out / f"{model}.{variant}.json"
            rows.append(json.loads(path.read_text()) if proc.returncode == 0 and path.exists()
                        else {"model": model, "variant": variant,
                              "error": f"exit code {proc.returncode}"})
    (out / "first_step_cpu.json").write_text(json.dumps(rows, indent=1, default=str))
    print(table(rows))
    print(f"first_step_cpu: rows in {out / 'first_step_cpu.json'}", file=sys.stderr)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

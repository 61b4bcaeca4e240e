"""Multi-GPU plans measured against their predictions (issue 9), in three steps.

    # 1. on a machine with ortools (the CPU box): one plan per planner, for N GPUs
    python benchmarks/multi_gpu.py prepare --gpus 8 --out-dir mg/
    # 2. on the N-GPU machine: run each plan for 50 steps under torchrun, compare
    python benchmarks/multi_gpu.py run --plans mg/ --steps 50 --out mg/results.json
    # 3. on the N-GPU machine, after `gemc calibrate --out cal.json`: collectives
    python benchmarks/multi_gpu.py collectives --calibration cal.json --out coll.json

``prepare`` compiles the GEM example (``--preset``, default h200; its batch is per rank, so
the global batch scales with the GPU count) for ``h200:1xN`` with each planner (cpsat,
greedy, naive) and writes ``<out-dir>/<planner>.json``. The GPU machine has no ortools,
so plans are compiled here and carried.

``run`` launches ``python -m torch.distributed.run --standalone --nproc_per_node=W -m
gemc.run PLAN`` for every plan in ``--plans`` (W from the plan's mesh), with
``--no-kernels`` when W > 1 and a region is not ddp (graph mode on several ranks needs
every region ddp), and
reads each run report: measured step ms (the slowest rank's median after warmup),
samples/s, MFU, peak memory per rank, against the plan's predicted step and memory.
Targets: cpsat's plan measured fastest of the three; predicted step within 15% of measured.

``collectives`` compares what ``gemc calibrate`` measured (all-reduce, all-gather,
reduce-scatter, all-to-all over message sizes, NCCL) with the cost model's datasheet
prediction (``cost_model.collectives`` without calibration) on the topology: error per
collective and size.

``--smoke`` (CPU, gloo): ``prepare --gpus 2 --preset tiny`` and ``run --device cpu --no-kernels`` with
a few steps: a check that the plumbing works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GEM = f"{REPO / 'examples' / 'gem' / 'model.py'}:build"
PLANNERS = ("cpsat", "greedy", "naive")
STEP_TOLERANCE = 0.15


def _write_json(path: Path, data: Any) -> None:
    from gemc.atomic_write import write_atomic

    write_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


# ---- prepare ------------------------------------------------------------------------------


def prepare(gpus: int, preset: str, out_dir: Path, planners: list[str],
            time_limit_s: float | None) -> list[dict[str, Any]]:
    from gemc.api import compile as gemc_compile

    rows = []
    for planner in planners:
        t0 = time.perf_counter()
        solver = {"time_limit_s": time_limit_s} if time_limit_s else None
        plan = gemc_compile(GEM, {"preset": preset}, topology=f"h200:1x{gpus}",
                            planner=planner, out=out_dir / f"{planner}.json", solver=solver)
        pred = plan["predicted"]
        rows.append({"planner": planner, "compile_s": round(time.perf_counter() - t0, 1),
                     "predicted_step_ms": pred.get("step_ms"),
                     "plan": str(out_dir / f"{planner}.json")})
        print(f"prepare: {planner}: predicted step {pred.get('step_ms'):.2f} ms "
              f"({rows[-1]['compile_s']} s)", file=sys.stderr)
    return rows


# ---- run ----------------------------------------------------------------------------------


def _world_of(plan: dict[str, Any]) -> int:
    size = 1
    for s in plan["mesh"]["shape"]:
        size *= int(s)
    return size


def run_plan(plan_path: Path, steps: int, device: str | None, timeout_s: int,
             no_kernels: bool = False) -> dict[str, Any]:
    """One plan under torchrun; its run report (or the failure, as a result).
    ``no_kernels``: run the ops the kernels replace (the CPU smoke: interpreted Triton on
    two gloo ranks costs seconds a step and checks nothing the kernel tests do not)."""
    plan = json.loads(plan_path.read_text())
    world = _world_of(plan)
    report = plan_path.with_name(plan_path.stem + ".run.json")
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", "-m", "gemc.run", str(plan_path), "--steps", str(steps),
           "--report", str(report), "--quiet"]
    if no_kernels or world > 1 and plan.get("kernels") and any(r["strategy"] != "ddp"
                                                               for r in plan["regions"]):
        cmd.append("--no-kernels")
    if device:
        cmd += ["--device", device]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not report.exists():
        # torchrun's summary ends the output and names only the signal: the ranks' own
        # errors come before it, so the whole output is kept beside the plan
        log = plan_path.with_name(plan_path.stem + ".log")
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"plan": str(plan_path), "world": world, "error": f"exit {proc.returncode}",
                "log": str(log), "log_tail": tail, "wall_s": wall}
    return {"plan": str(plan_path), "world": world, "wall_s": wall,
            "report": json.loads(report.read_text()), "no_kernels": "--no-kernels" in cmd}


def summarize(planner: str, plan: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """The comparison row of one planner's run."""
    row: dict[str, Any] = {"planner": planner, "world": res["world"],
                           "predicted_step_ms": plan["predicted"].get("step_ms")}
    if "error" in res:
        return {**row, "error": res["error"], "log": res.get("log"),
                "log_tail": res.get("log_tail")}
    rep = res["report"]
    measured = rep.get("step_ms")
    pred = row["predicted_step_ms"]
    mem = rep.get("vs_predicted", {}).get("memory_per_rank", [])
    peaks = [m["measured_bytes"] for m in mem if m.get("measured_bytes") is not None]
    preds = [m["predicted_bytes"] for m in mem if m.get("predicted_bytes") is not None]
    row.update({
        "measured_step_ms": measured,
        "step_error": (pred - measured) / measured if (pred and measured) else None,
        "samples_per_s": rep.get("samples_per_s"),
        "global_batch": rep.get("global_batch"),
        "mfu": (rep.get("mfu") or {}).get("value"),
        "peak_bytes_max": max(peaks) if peaks else None,
        "predicted_bytes_max": max(preds) if preds else None,
        "final_loss": rep["losses"][-1]["loss"] if rep.get("losses") else None,
        "kernels": "off (--no-kernels)" if res.get("no_kernels") else
        f"{len(rep.get('kernels_applied') or [])} applied",
    })
    return row


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ok = [r for r in rows if r.get("measured_step_ms")]
    out = []
    cpsat = next((r for r in ok if r["planner"] == "cpsat"), None)
    if cpsat and len(ok) > 1:
        fastest = min(ok, key=lambda r: r["measured_step_ms"])
        out.append({"target": "cpsat's plan measured fastest", "met": fastest is cpsat,
                    "fastest": fastest["planner"]})
    for r in ok:
        if r.get("step_error") is not None:
            out.append({"target": f"{r['planner']}: predicted step within 15% of measured",
                        "met": abs(r["step_error"]) <= STEP_TOLERANCE,
                        "error": r["step_error"]})
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'planner':8} {'GPUs':>4} {'pred ms':>9} {'meas ms':>9} {'error':>7} "
            f"{'samples/s':>10} {'MFU':>6} {'peak GB':>8} {'pred GB':>8}  kernels")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['planner']:8} {r['world']:>4} {_fmt(r['predicted_step_ms'], '9.2f')}"
                         f"  FAILED: {r['error']} (output: {r.get('log') or '-'})")
            continue
        gb = (lambda b: None if b is None else b / 1e9)
        lines.append(
            f"{r['planner']:8} {r['world']:>4} {_fmt(r['predicted_step_ms'], '9.2f')} "
            f"{_fmt(r['measured_step_ms'], '9.2f')} "
            f"{_fmt(r['step_error'] and 100 * r['step_error'], '+6.1f')}% "
            f"{_fmt(r['samples_per_s'], '10,.0f')} {_fmt(r['mfu'] and 100 * r['mfu'], '5.1f')}% "
            f"{_fmt(gb(r['peak_bytes_max']), '8.1f')} {_fmt(gb(r['predicted_bytes_max']), '8.1f')}"
            f"  {r['kernels']}")
    return "\n".join(lines)


def run_all(plans_dir: Path, steps: int, device: str | None, timeout_s: int,
            no_kernels: bool = False) -> list[dict[str, Any]]:
    plans = sorted(p for p in plans_dir.glob("*.json")
                   if not p.name.endswith(".run.json") and p.stem in PLANNERS)
    if not plans:
        raise SystemExit(f"multi_gpu run: no <planner>.json plans in {plans_dir}; "
                         "write them with `multi_gpu.py prepare` first")
    rows = []
    for path in plans:
        print(f"run: {path.stem} ...", file=sys.stderr, flush=True)
        res = run_plan(path, steps, device, timeout_s, no_kernels)
        rows.append(summarize(path.stem, json.loads(path.read_text()), res))
    return rows


# ---- collectives --------------------------------------------------------------------------


def compare_collectives(calibration: dict[str, Any], topology: str | None) -> list[dict[str, Any]]:
    """Measured (``gemc calibrate``) vs the datasheet cost model, per collective and size."""
    from gemc.cost_model.collectives import collective_time
    from gemc.cost_model.topology import parse_topology

    coll = calibration.get("collectives") or {}
    ranks = coll.get("ranks")
    if not ranks or ranks < 2:
        raise SystemExit("multi_gpu collectives: the calibration file has no collectives "
                         "(it was measured on one GPU); run `gemc calibrate` with >= 2 GPUs")
    topo = parse_topology(topology or f"h200:1x{ranks}")
    rows = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for nbytes, measured_s in coll.get(op, []):
            pred_s = collective_time(op, float(nbytes), int(ranks), topo)
            rows.append({"op": op, "bytes": int(nbytes), "ranks": int(ranks),
                         "measured_us": measured_s * 1e6, "predicted_us": pred_s * 1e6,
                         "error": (pred_s - measured_s) / measured_s if measured_s else None})
    return rows


def collectives_table(rows: list[dict[str, Any]]) -> str:
    head = f"{'collective':15} {'bytes':>12} {'measured us':>12} {'predicted us':>13} {'error':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['op']:15} {r['bytes']:>12,} {r['measured_us']:12.1f} "
                     f"{r['predicted_us']:13.1f} {_fmt(r['error'] and 100 * r['error'], '+7.1f')}%")
    by_op: dict[str, list[float]] = {}
    for r in rows:
        if r["error"] is not None:
            by_op.setdefault(r["op"], []).append(abs(r["error"]))
    for op, errs in by_op.items():
        lines.append(f"{op}: mean |error| {100 * statistics.mean(errs):.1f}%, "
                     f"worst {100 * max(errs):.1f}%")
    return "\n".join(lines)


# ---- CLI ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="compile one plan per planner (needs ortools for cpsat)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--preset", default="h200")
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--time-limit-s", type=float, default=None, help="CP-SAT time limit")
    p.add_argument("--out-dir", type=Path, required=True)
    r = sub.add_parser("run", help="run every plan of --plans under torchrun and compare")
    r.add_argument("--plans", type=Path, required=True)
    r.add_argument("--steps", type=int, default=50)
    r.add_argument("--device", choices=("cpu", "cuda"), default=None)
    r.add_argument("--timeout-s", type=int, default=900, help="per plan")
    r.add_argument("--out", type=Path, default=None)
    c = sub.add_parser("collectives", help="measured collectives vs the cost model")
    c.add_argument("--calibration", type=Path, required=True)
    c.add_argument("--topology", default=None, help="default h200:1x<ranks measured>")
    c.add_argument("--out", type=Path, default=None)
    s = sub.add_parser("smoke", help="CPU/gloo: prepare 2 ranks of the tiny preset and run them")
    s.add_argument("--out-dir", type=Path, required=True)
    s.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    if args.cmd == "prepare":
        planners = [x.strip() for x in args.planners.split(",") if x.strip()]
        unknown = set(planners) - set(PLANNERS)
        if unknown:
            ap.error(f"unknown planners {sorted(unknown)}; known: {', '.join(PLANNERS)}")
        rows = prepare(args.gpus, args.preset, args.out_dir, planners, args.time_limit_s)
        _write_json(args.out_dir / "prepared.json", {"gpus": args.gpus, "preset": args.preset,
                                                     "plans": rows})
        return 0
    if args.cmd in ("run", "smoke"):
        if args.cmd == "smoke":
            prepare(2, "tiny", args.out_dir, list(PLANNERS), 5.0)
            rows = run_all(args.out_dir, args.steps, "cpu", 600, no_kernels=True)
            out = args.out_dir / "results.json"
        else:
            rows = run_all(args.plans, args.steps, args.device, args.timeout_s)
            out = args.out
        print(table(rows))
        tg = targets(rows)
        for t in tg:
            print(f"target {'MET' if t['met'] else 'NOT MET'}: {t['target']}")
        if out is not None:
            _write_json(out, {"rows": rows, "targets": tg, "steps": args.steps})
        return 0 if all(not r.get("error") for r in rows) else 1
    if args.cmd == "collectives":
        try:
            calibration = json.loads(args.calibration.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--calibration {args.calibration}: not a readable JSON calibration file "
                     f"({exc}); write one with `gemc calibrate --out FILE` on the GPUs")
        rows = compare_collectives(calibration, args.topology)
        print(collectives_table(rows))
        if args.out is not None:
            _write_json(args.out, {"rows": rows, "calibration": str(args.calibration)})
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())

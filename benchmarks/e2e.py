"""End-to-end training benchmark on one GPU: eager bf16, torch.compile bf16, gemc.

    python benchmarks/e2e.py --out e2e.json              # GEM h200 preset on the H200
    python benchmarks/e2e.py --smoke --out smoke.json    # CPU, tiny preset: a crash check

All three variants train the same model (``examples/gem/model.py``), each in a fresh child
process of this script (``--same-process``: one after the other in this one; why separate:
a variant run third inherited the others' process state, and gemc's host-side launch
latency with it: 92.7 ms a step third against 79.7 ms first at the same commit, e117a72,
BENCHMARKS.md), from the same deterministic init (``gemc.backends.torch.init``), on the same
batches (``make_batch(step)``), with the same optimizers (fused AdamW for dense parameters,
row-wise Adagrad on the rows each step used for the tables):

``eager``    :class:`gemc.backends.torch.reference.ReferenceTrainer` under
             ``torch.autocast(bf16)``: the model as its author wrote it.
``compile``  the same, with every dense region of the plan (``plan["regions"]``) wrapped in
             ``torch.compile`` (default mode). The whole model is not compiled: AOTAutograd
             cannot differentiate the tables' sparse gradients, and dense table gradients
             would cost a full pass over every table each step.
``gemc``     ``gemc.api.compile`` for ``h200:1x1``, then the runner
             (``gemc.backends.torch.runner.run``) on that plan in this process: its precision
             sites and generated kernels (graph mode: fused GEMM epilogues, jagged attention,
             the batched embedding bag with the optimizer fused in its backward).
``gemc-nokernels`` (optional) the runner on the same plan with ``--no-kernels``.

Timing: a step is forward + backward + optimizers + reading the loss (a sync); batch
creation is outside it. ``step_ms`` is the median over the steps after ``--warmup``.
MFU = ``plan.model.train_flops_per_step / (step_s * peak)``, against the H200's dense bf16
datasheet peak (989 TFLOP/s) and against a measured bf16 matmul peak (the best of
8192^3 GEMMs on this GPU). Peak memory is ``torch.cuda.max_memory_allocated`` during the
timed loop (parameters and optimizer state included). The loss curves are printed and
compared to eager (bf16 rounds differently in each variant, so they agree to about 1e-2,
not bit for bit).

``--profile N`` profiles N more steps after the timed ones (``steps_run``: profiled steps
are slower, so they stay out of the median and the loss curve keeps them) and writes,
next to ``--out``, per variant: ``.kernels.txt`` (device time per kernel), ``.gaps.txt``
(where the GPU idles within the timed region and why: busy vs idle, idle by cause and gap
size, the launches that came late, the host syncs and the op chain around each, the largest
gaps; on CUDA also the Python line of each sync, from ``torch.cuda.set_sync_debug_mode`` on
the step after the profiled ones) and ``.trace.json.gz`` (the last profiled step, for
Perfetto). The row gains ``gpu_busy_ms``, ``gpu_idle_ms`` and ``syncs_per_step``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GEM = f"{REPO / 'examples' / 'gem' / 'model.py'}:build"
H200_BF16_DATASHEET = 989e12
sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_analysis  # noqa: E402, F401  (the profiled step's analysis; its tests reach it here)
from trace_analysis import StepProfiler, profile_line  # noqa: E402


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="GEM preset (default h200; tiny with --smoke)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed + warmup steps (default 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5)")
    p.add_argument(
        "--variants",
        default="eager,compile,gemc",
        help="comma-separated: eager, compile, gemc, gemc-nokernels (the runner without the "
        "plan's kernels: isolates what they bring)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--same-process",
        action="store_true",
        help="run all variants in this process, one after the other (default: each in a "
        "fresh child process). Why the default: on the H200 gemc's step was 92.7 ms run "
        "after eager and torch.compile in one process and 79.7 ms run first (host-side "
        "launch latency, not device time), so a variant's place in the order must not "
        "decide its figure",
    )
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, batch 8, 2 steps")
    p.add_argument("--out", default="e2e.json", help="JSON results")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile N more steps after the timed ones of each variant (torch.profiler); "
        "writes the "
        "kernels by device time per step next to --out as <out>.<variant>.kernels.txt, where "
        "the GPU idles and why as <out>.<variant>.gaps.txt, and the last profiled step as a "
        "Chrome trace <out>.<variant>.trace.json.gz",
    )
    p.add_argument(
        "--profile-stack",
        action="store_true",
        help="record every Python call in the profiled steps (the gaps file then names the "
        "repo function around each sync and late launch). Heavy: the host side of those steps "
        "slows down many times, so their gaps and step times are no measurement; use it for "
        "attribution, with --profile 1",
    )
    args = p.parse_args(argv)
    if args.smoke:  # Triton runs interpreted on the CPU: keep the batch and the steps few
        args.preset = args.preset or "tiny"
        args.batch_size = args.batch_size or 8
        args.steps = args.steps or 2
        args.warmup = 1 if args.warmup is None else args.warmup
        args.device = args.device or "cpu"
    args.preset = args.preset or "h200"
    args.steps = args.steps or 30
    args.warmup = 5 if args.warmup is None else args.warmup
    return args


def _device(requested: str | None) -> Any:
    import torch

    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: Any) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def measured_bf16_peak(device: Any, n: int = 8192, iters: int = 20) -> float | None:
    """Best bf16 GEMM throughput this GPU reaches (FLOP/s), the practical MFU ceiling."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    best = 0.0
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = max(best, 2 * n**3 / (start.elapsed_time(end) / 1e3))
    del a, b
    _free(device)
    return best


# --- where the GPU idles ----------------------------------------------------------------------
def _profiler(args: argparse.Namespace, name: str, device: Any) -> StepProfiler:
    stack = args.profile_stack
    if stack and name.startswith("gemc") and os.environ.get("TRITON_INTERPRET") == "1":
        # the interpreter runs every kernel as Python: recording each call ran a 23 GB
        # machine out of memory on the tiny preset
        print(f"e2e: --profile-stack ignored for {name}: Triton is interpreted", file=sys.stderr)
        stack = False
    return StepProfiler(args.profile, args.steps, device, Path(f"{args.out}.{name}.kernels.txt"),
                        stack=stack)


def _baseline(
    name: str, args: argparse.Namespace, plan: dict[str, Any], device: Any, *,
    entry: str = GEM, model_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """eager or compile: the single-process reference trainer, bf16 autocast (of the GEM
    example, or of ``entry`` built with ``model_args``: benchmarks/zoo.py)."""
    import torch
    from gemc.backends.torch.optimizers import resolve_optimizers
    from gemc.backends.torch.reference import ReferenceTrainer

    from gemc.api import load_model

    dense_cfg, emb_cfg = resolve_optimizers(plan.get("optimizer"))
    t0 = time.perf_counter()
    spec = load_model(entry, model_args if model_args is not None else _model_args(args),
                      device="meta")
    compile_fn = None
    compile_modules = None
    note = None
    if name == "compile":
        backend = "aot_eager" if device.type == "cpu" else "inductor"
        compile_fn = lambda m: torch.compile(m, backend=backend)  # noqa: E731
        # The whole model, as its user would compile it (each table's lookup stays eager:
        # sparse row gradients do not compile). Compiling only the plan's dense regions left
        # the glue between them in eager and flattered gemc.
        compile_modules = None
        note = f"torch.compile(backend={backend!r}) on the whole model, table lookups eager"
    trainer = ReferenceTrainer(
        spec,
        world_size=1,
        seed=args.seed,
        device=device,
        dense_cfg=dense_cfg,
        emb_cfg=emb_cfg,
        autocast_dtype=torch.bfloat16,
        compile_fn=compile_fn,
        compile_modules=compile_modules,
    )
    setup_s = time.perf_counter() - t0
    _free(device)
    losses, times = [], []
    prof = _profiler(args, name, device)
    try:
        for step in range(steps_run(args)):
            batches = trainer.batches(step)
            _sync(device)
            t1 = time.perf_counter()
            losses.append(trainer.train_step(batches))  # float(): a sync
            _sync(device)
            times.append((time.perf_counter() - t1) * 1e3)
            prof.step()
    except BaseException:
        prof.abandon()
        raise
    prof.close()
    result = _summary(name, losses, times, args, _peak_memory(device), setup_s, note)
    result.update(prof.summary)
    del trainer, spec
    _free(device)
    return result


def _gemc(
    args: argparse.Namespace, plan: dict[str, Any], device: Any, *, kernels: bool = True,
    name: str | None = None, options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The runner on ``plan``; ``options``: more :class:`RunOptions` fields (zoo.py's
    graph executor, compile mode, group measurement), ``name`` the row's variant."""
    from gemc.backends.torch.runner import RunOptions, run

    _free(device)
    t0 = time.perf_counter()
    name = name or ("gemc" if kernels else "gemc-nokernels")
    prof = _profiler(args, name, device)
    try:
        result = run(
            plan,
            RunOptions(
                steps=steps_run(args),
                device=device.type,
                seed=args.seed,
                progress=False,
                warmup_steps=args.warmup,
                kernels=kernels,
                on_step=prof.step,
                **(options or {}),
            ),
        )
    except BaseException:
        prof.abandon()
        raise
    prof.close()
    wall = time.perf_counter() - t0
    rep = result.report
    summary = _summary(
        name,
        [loss for _, loss in result.losses],
        [float(e["ms"]) for e in rep["losses"]],
        args,
        rep["per_rank"][0]["memory"]["peak_bytes"] if device.type == "cuda" else None,
        rep["setup_s"],
        f"{len(rep['kernels_applied'])} kernels applied; {rep['execution']}; "
        f"autocast {rep['precision']['autocast']}",
    )
    summary["run_wall_s"] = wall
    summary["runner_report"] = {
        k: rep.get(k) for k in ("vs_predicted", "kernels_applied", "precision", "execution",
                                "mfu", "graph_executor", "first_step_s",
                                "first_step")
    }
    summary.update(prof.summary)
    _free(device)
    return summary


def steps_run(args: argparse.Namespace) -> int:
    """Steps each variant runs: ``--steps`` timed ones (the first ``--warmup`` of them not
    counted), then, with ``--profile N``, the profiler's own: one warm-up step, N profiled,
    one recording sync sites. Why after: the profiler slows a step by 10-30% (more for the
    Python-heavy variants), so profiled steps inside the timed window skewed the medians."""
    return args.steps + (args.profile + 2 if args.profile > 0 else 0)


def _summary(
    name: str,
    losses: list[float],
    times: list[float],
    args: argparse.Namespace,
    peak: int | None,
    setup_s: float,
    note: str | None,
) -> dict[str, Any]:
    timed = times[args.warmup : args.steps] or times
    step_ms = statistics.median(timed) if timed else None
    batch = args.batch_size_effective
    return {
        "variant": name,
        "losses": losses,
        "step_ms": step_ms,
        "step_ms_all": times,
        "first_step_s": times[0] / 1e3 if times else None,  # compile + autotune included
        "samples_per_s": batch / (step_ms / 1e3) if step_ms else None,
        "peak_memory_bytes": peak,
        "setup_s": setup_s,
        "note": note,
    }


def _model_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"preset": args.preset, "seed": args.seed}
    if args.batch_size:
        out["batch_size"] = args.batch_size
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["variant", "step ms", "samples/s", "MFU@989T", "MFU@meas", "peak GB", "x compile",
            "final loss"]
    base = next((r for r in rows if r["variant"] == "compile" and r["samples_per_s"]), None)
    lines = ["  ".join(f"{h:>12}" for h in head)]
    for r in rows:
        def fmt(v: Any, spec: str) -> str:
            return format(v, spec) if isinstance(v, (int, float)) else "-"

        speedup = (
            r["samples_per_s"] / base["samples_per_s"] if base and r["samples_per_s"] else None
        )
        peak = r["peak_memory_bytes"] / 1e9 if r["peak_memory_bytes"] else None
        lines.append(
            "  ".join(
                f"{x:>12}"
                for x in (
                    r["variant"],
                    fmt(r["step_ms"], ".2f"),
                    fmt(r["samples_per_s"], ",.0f"),
                    fmt(r.get("mfu_datasheet") and 100 * r["mfu_datasheet"], ".1f"),
                    fmt(r.get("mfu_measured") and 100 * r["mfu_measured"], ".1f"),
                    fmt(peak, ".1f"),
                    fmt(speedup, ".2f"),
                    fmt(r["losses"][-1] if r["losses"] else None, ".5f"),
                )
            )
        )
    return "\n".join(lines)


def interpreted_triton(device: str | None, cuda_available: bool) -> bool:
    """Whether this run's kernels need Triton's interpreter: only when they run on the CPU.
    (Setting it on a GPU machine would also break torch.compile's Inductor kernels.)"""
    return device == "cpu" or (device is None and not cuda_available)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.same_process and len(variants) > 1:
        return _isolated(args, list(sys.argv[1:] if argv is None else argv), variants)
    import torch

    if interpreted_triton(args.device, torch.cuda.is_available()):
        # the plan's kernels run in Triton's interpreter on the CPU; it must be chosen before
        # anything imports Triton (compiling the plan does)
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from gemc.api import compile as gemc_compile

    device = _device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    print(f"e2e: GEM preset {args.preset} on {device} ({torch.__version__})", file=sys.stderr)
    t0 = time.perf_counter()
    plan = gemc_compile(GEM, _model_args(args), topology="h200:1x1")
    compile_s = time.perf_counter() - t0
    args.batch_size_effective = int(args.batch_size or _batch_of(plan) or 1)
    flops = plan["model"]["train_flops_per_step"]
    print(
        f"e2e: gemc compile {compile_s:.1f}s: {len(plan['kernels'])} kernels, precision "
        f"{[e.get('dtype') for e in plan['precision']]}, {flops / 1e12:.2f} TFLOP/step",
        file=sys.stderr,
    )
    measured = measured_bf16_peak(device)
    rows = []
    for name in variants:
        print(f"e2e: running {name} ...", file=sys.stderr)
        try:
            if name in ("gemc", "gemc-nokernels"):
                row = _gemc(args, plan, device, kernels=name == "gemc")
            elif name in ("eager", "compile"):
                row = _baseline(name, args, plan, device)
            else:
                raise ValueError(f"unknown variant {name!r}")
        except Exception as exc:  # one variant failing must not lose the others' numbers
            row = {"variant": name, "error": f"{type(exc).__name__}: {exc}", "losses": [],
                   "step_ms": None, "samples_per_s": None, "peak_memory_bytes": None}
            print(f"e2e: {name} failed: {row['error']}", file=sys.stderr)
            _free(device)
        step_s = row["step_ms"] / 1e3 if row.get("step_ms") else None
        row["mfu_datasheet"] = flops / (step_s * H200_BF16_DATASHEET) if step_s else None
        row["mfu_measured"] = flops / (step_s * measured) if (step_s and measured) else None
        rows.append(row)
    _compare_losses(rows)
    table = _table(rows)
    _print_rows(rows, table)
    result = {
        "preset": args.preset,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size_effective,
        "train_flops_per_step": flops,
        "peak_flops": {"datasheet_bf16": H200_BF16_DATASHEET, "measured_bf16_matmul": measured},
        "gemc_compile_s": compile_s,
        "plan_predicted": plan["predicted"].get("step_ms"),
        "variants": rows,
        "table": table,
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"e2e: wrote {args.out}", file=sys.stderr)
    return 0 if all(not r.get("error") for r in rows) else 1


def _isolated(args: argparse.Namespace, argv: list[str], variants: list[str]) -> int:
    """Each variant in a fresh child process (this script with ``--same-process`` and one
    variant; its profile files land under ``--out`` as usual), then one table and one JSON
    of all rows."""
    import subprocess

    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for name in variants:
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--variants", name,
               "--same-process", "--out", str(out)]
        print(f"e2e: {name} in a child process ...", file=sys.stderr)
        code = subprocess.run(cmd, check=False).returncode
        try:
            data = json.loads(out.read_text())
            row = data["variants"][0]
            first = first or data
        except (OSError, ValueError, KeyError, IndexError) as exc:
            row = {"variant": name, "error": f"child process exited {code} without results "
                   f"({type(exc).__name__}: {exc})", "losses": [], "step_ms": None,
                   "samples_per_s": None, "peak_memory_bytes": None}
            print(f"e2e: {name} failed: {row['error']}", file=sys.stderr)
        rows.append(row)
    _compare_losses(rows)
    table = _table(rows)
    _print_rows(rows, table)
    result = {**(first or {}), "variants": rows, "table": table, "isolated": True}
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"e2e: wrote {out}", file=sys.stderr)
    return 0 if all(not r.get("error") for r in rows) else 1


def _compare_losses(rows: list[dict[str, Any]]) -> None:
    eager = next((r for r in rows if r["variant"] == "eager" and r["losses"]), None)
    for r in rows:
        if eager and r["losses"] and len(r["losses"]) == len(eager["losses"]):
            r["max_rel_loss_diff_vs_eager"] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], eager["losses"])
            )


def _print_rows(rows: list[dict[str, Any]], table: str) -> None:
    print(table)
    for r in rows:
        if r["losses"]:
            print(f"loss {r['variant']:>8}: " + " ".join(f"{x:.4f}" for x in r["losses"]))
        if r.get("error"):
            print(f"error {r['variant']}: {r['error']}")
        if "syncs_per_step" in r:
            print(f"profile {r['variant']:>8}: {profile_line(r)}")


def _batch_of(plan: dict[str, Any]) -> int | None:
    tables = plan.get("tables") or []
    for t in tables:
        if t.get("pooling") != "none" and t.get("batch"):
            return int(t["batch"])
    return None


if __name__ == "__main__":
    sys.exit(main())

"""How well does the cost model predict a real training step? One command on the H200.

Plan mode (the default, issue 18): for every model -- both examples and every
``examples/zoo/*.py`` module (``build(preset=...)``) -- compile the plan for ``GPU:1x1``
with the greedy planner (no ortools needed), run it with ``gemc run`` (a subprocess, as
a user would) and compare the plan's ``predicted.step_ms`` and per-rank memory with the
run report's measured step (median after warmup) and ``max_memory_allocated``; MAPE and
worst. Then leave-half-out: fit a calibration from the runs of half the models
(``gemc.cost_model.run_fit``, what ``gemc calibrate --from-run`` does), recompile the other
half with it and score those against their own runs; both halves in turn. Everything
(plans, run reports, fitted calibrations, ``cost_model_accuracy.json``) goes to ``--out
DIR``.

    python benchmarks/cost_model_accuracy.py --out out/acc                     # on the H200
    python benchmarks/cost_model_accuracy.py --smoke --out /tmp/acc            # CPU crash check

``--smoke``: tiny presets, 3 steps on the CPU with the ops the kernels replace
(``--no-kernels``); checks the script, not the model. Without a GPU (and no ``--smoke``)
it only compiles and prints the predictions.

``--measured-from-zoo FILE...`` (no GPU needed): the measurements are the ``gemc`` rows of
``benchmarks/zoo.py`` result files (``step_ms``, ``peak_memory_bytes``; a later file wins),
scored against plans compiled now, and the leave-half-out refit runs on them (each row
becomes a run report pairing the plan compiled now with the measured step and peak).
Predictions at this commit against measurements of an earlier one: a cost-model change
is re-checked on the CPU, and after an H200 zoo run the refit needs no second GPU pass.
A row whose run applied other kernels than the plan compiled now has (by kind, from the
row's ``runner_report.kernels_applied``) is marked ``same_program: false`` with the
kinds that changed: it is scored, summarised apart (``same_program_*``), and never
fitted on.

    python benchmarks/cost_model_accuracy.py --planner default --out /tmp/acc \
        --measured-from-zoo benchmarks/results/zoo_h200_8e10b4c.json \
        benchmarks/results/zoo_h200_3c7f966_gem.json benchmarks/results/zoo_h200_3c7f966_models.json

Eager mode (``--mode eager``, issue 3): for the GEM and DLRM examples x batch sizes x {bf16, fp32}: capture and annotate the model
on the meta device, predict one eager single-GPU step (forward, backward, AdamW over all
parameters — eager EmbeddingBag gradients are dense, so the tables get AdamW too) with
``gemc.cost_model.eager.predict_eager_step``, then build the real model on the GPU, run
the same step (warm-up, then CUDA-event timing, median) and record
``torch.cuda.max_memory_allocated``. Prints per-config error and the MAPE; writes JSON.

"bf16" means the whole model in bf16 (``model.to(torch.bfloat16)``, float inputs cast),
so the graph the model prices is exactly the one that runs; "fp32" is plain fp32 with
TF32 off (PyTorch's default).

    python benchmarks/cost_model_accuracy.py --out out/accuracy.json          # on the H200
    python benchmarks/cost_model_accuracy.py --smoke --out /tmp/acc.json      # CPU check
    python benchmarks/cost_model_accuracy.py --measured-from \
        benchmarks/results/cost_model_accuracy_h200.json --gpu h200 \
        --calibration cost_model/data/h200.json --out /tmp/rescored.json     # no GPU needed

``--smoke`` uses the tiny presets, two batch sizes, and times eager steps on the CPU only
to exercise the code (CPU times are not comparable with a GPU prediction). In eager mode
``--out`` is the JSON file to write.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = {"gem": REPO / "examples" / "gem" / "model.py",
          "dlrm": REPO / "examples" / "dlrm" / "model.py"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Batch sizes as fractions of each preset's own batch (GEM h200: 4096, DLRM h200: 65536).
BATCH_FRACTIONS = (0.25, 0.5, 1.0)


def _cast(inputs: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def _preset_batch(entrypoint: str, preset: str) -> int:
    from gemc.api import load_model
    return int(load_model(entrypoint, {"preset": preset}).info["batch_size"])


def predict(entrypoint: str, args: dict[str, Any], dtype: torch.dtype, gpu_name: str,
            calibration: Any) -> dict[str, Any]:
    """Annotated graph (meta device) -> predicted eager step."""
    from gemc.cost_model.eager import predict_eager_step
    from gemc.cost_model.topology import parse_topology

    from gemc.api import annotate_model, load_model

    spec = load_model(entrypoint, args, device="meta")
    spec.model.to(dtype)
    spec.example_inputs = _cast(spec.example_inputs, dtype)
    topo = parse_topology(f"{gpu_name}:1x1")
    t0 = time.perf_counter()
    gm = annotate_model(spec, topo)
    pred = predict_eager_step(gm, topo.gpu, calibration)
    out = pred.to_dict()
    out["annotate_s"] = time.perf_counter() - t0
    return out


class EagerStep:
    """The measured step: the real model on ``device`` with torch's default foreach AdamW,
    a few pre-built batches, and ``run(i)`` = zero_grad (set to None), forward, backward,
    optimizer step. ``mark(phase)`` (a context-manager factory, e.g.
    ``torch.profiler.record_function``) wraps each phase when given: "zero_grad",
    "forward", "backward", "optimizer"."""

    def __init__(self, entrypoint: str, args: dict[str, Any], dtype: torch.dtype, device: str,
                 *, n_batches: int = 4) -> None:
        from gemc.api import load_model

        spec = load_model(entrypoint, args, device=device)
        self.model = spec.model.to(device=device, dtype=dtype).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.batches = [_cast(spec.make_batch(i, device), dtype) for i in range(n_batches)]
        self.device = device

    def run(self, i: int, mark: Callable[[str], AbstractContextManager[Any]] | None = None
            ) -> None:
        m = mark or (lambda _phase: nullcontext())
        with m("zero_grad"):
            self.opt.zero_grad(set_to_none=True)
        with m("forward"):
            loss = self.model(*self.batches[i % len(self.batches)])
        with m("backward"):
            loss.backward()
        with m("optimizer"):
            self.opt.step()

    def close(self) -> None:
        """Drop the model, optimizer state and batches (and the CUDA cache)."""
        self.model = self.opt = None  # type: ignore[assignment]
        self.batches = []
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure(entrypoint: str, args: dict[str, Any], dtype: torch.dtype, device: str, *,
            steps: int, warmup: int) -> dict[str, Any]:
    """Eager fwd + bwd + AdamW step on a real device: median step time and peak memory."""
    eager = EagerStep(entrypoint, args, dtype, device, n_batches=min(4, steps))
    cuda = device.startswith("cuda")
    for i in range(warmup):
        eager.run(i)
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            eager.run(i)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        peak = torch.cuda.max_memory_allocated()
    else:
        for i in range(steps):
            t0 = time.perf_counter()
            eager.run(i)
            times.append(time.perf_counter() - t0)
        peak = 0
    eager.close()
    result = {"step_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
              "max_ms": 1e3 * max(times), "steps": steps, "device": device,
              "max_memory_allocated_gb": peak / 1e9}
    return result


def _environment(device: str, calibration: Any) -> dict[str, Any]:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "device": device, "calibration": calibration.summary() if calibration else None}
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(0)
    return env


# ---- plan mode ----------------------------------------------------------------------------
ZOO = REPO / "examples" / "zoo"


def plan_models(names: str | None) -> dict[str, str]:
    """name -> entrypoint: the examples and every zoo module (``examples/zoo/NAME.py``)."""
    found = {name: f"{path}:build" for name, path in MODELS.items()}
    if ZOO.is_dir():
        for path in sorted(ZOO.glob("*.py")):
            if not path.name.startswith("_"):
                found[f"zoo/{path.stem}"] = f"{path}:build"
    if not names:
        return found
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in found]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {sorted(found)}")
    return {n: found[n] for n in wanted}


def _slug(name: str) -> str:
    return name.replace("/", "_")


def compile_plan(entrypoint: str, preset: str, topology: str, calibration: str,
                 out: Path, planner: str = "greedy", fp32_matmul: str = "ieee"
                 ) -> dict[str, Any]:
    """The plan ``gemc compile --planner PLANNER --fp32-matmul MODE`` writes (greedy, the
    default here, needs no ortools)."""
    from gemc.api import compile as gemc_compile

    return gemc_compile(entrypoint, {"preset": preset}, topology=topology, planner=planner,
                        calibration=calibration, out=out, fp32_matmul=fp32_matmul)


def zoo_measurements(paths: list[str]) -> dict[str, dict[str, Any]]:
    """model name (as ``plan_models`` spells it) -> the measured gemc step and peak of
    ``benchmarks/zoo.py``'s result files (``variants[model]`` rows of variant ``gemc``
    with ``step_ms`` and ``peak_memory_bytes``); a later file overrides an earlier one."""
    found: dict[str, dict[str, Any]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        for model, variants in (doc.get("variants") or {}).items():
            for v in variants:
                if v.get("variant") != "gemc" or not v.get("step_ms") \
                        or not v.get("peak_memory_bytes"):
                    continue
                name = model if model in MODELS else f"zoo/{model}"
                found[name] = {"step_ms": float(v["step_ms"]),
                               "peak_gb": float(v["peak_memory_bytes"]) / 1e9,
                               "device": "cuda", "source": str(path)}
                report = v.get("runner_report")
                applied = report.get("kernels_applied") if isinstance(report, dict) else None
                if isinstance(applied, list):
                    found[name]["kernel_kinds"] = kernel_kinds(applied)
                executor = report.get("graph_executor") if isinstance(report, dict) else None
                routes = executor.get("table_lookups") if isinstance(executor, dict) else None
                if isinstance(routes, dict):
                    found[name]["table_routes"] = route_counts(routes.values())
    if not found:
        raise SystemExit(f"no gemc rows with step_ms and peak_memory_bytes in {paths}")
    return found


def kernel_kinds(names: list[str]) -> dict[str, int]:
    """How many kernels of each kind a list of plan kernel names holds (a name is its
    kind and an index: ``jagged_silu_attention_3``); what ``gemc run`` reports as applied."""
    return dict(sorted(Counter(re.sub(r"_\d+$", "", str(n)) for n in names).items()))


def route_counts(paths: Any) -> dict[str, int]:
    """How many tables take each lookup route (gemc.table_lookup), as ``lookup_<route>``."""
    return dict(sorted(Counter(f"lookup_{p}" for p in paths).items()))


def program_change(plan: dict[str, Any], measured: dict[str, Any]) -> dict[str, list[int]] | None:
    """Kernel kinds whose count differs between the run that was measured (its
    ``kernels_applied``) and the plan compiled now: ``{kind: [ran, now]}``, and likewise
    the tables on each lookup route (``lookup_sparse``: the run's
    ``graph_executor.table_lookups`` against the plan's ``tables[].lookup``); empty when
    the same program runs, None when the measurement does not say what ran. Why: a run
    of another program (a pass since matched more of the graph, a table the cost model
    now routes otherwise) neither judges nor calibrates today's plan -- the zoo's HSTU ran
    with Inductor's padded attention, its plan now has 8 jagged SiLU kernels."""
    ran = measured.get("kernel_kinds")
    if ran is None:
        return None
    now = kernel_kinds([k.get("name", "") for k in plan.get("kernels") or []])
    if "table_routes" in measured:
        ran = {**ran, **measured["table_routes"]}
        now = {**now, **route_counts(t.get("lookup", "batched") for t in plan["tables"])}
    return {k: [ran.get(k, 0), now.get(k, 0)] for k in sorted(set(ran) | set(now))
            if ran.get(k, 0) != now.get(k, 0)}


def synthetic_run_report(plan: dict[str, Any], measured: dict[str, Any],
                         path: Path) -> Path:
    """A run report (the fields ``gemc calibrate --from-run`` reads) pairing the plan
    compiled now with a step and peak measured earlier (a zoo row): what lets the
    leave-half-out refit run from saved measurements without a GPU."""
    pred = plan["predicted"]
    ranks = pred.get("per_rank") or [{}]
    doc = {"device": "cuda", "measured_from": measured.get("source"),
           "vs_predicted": {
               "step_ms": {"measured": measured["step_ms"], "predicted": pred["step_ms"]},
               "memory_per_rank": [{"rank": 0, "measured_bytes": measured["peak_gb"] * 1e9,
                                    "measured_kind": "cuda_max_memory_allocated",
                                    "predicted_bytes": (ranks[0] or {}).get("memory_bytes")}],
               "kind_ms": pred.get("kind_ms"), "gpu": plan["topology"].get("gpu"),
               "memory_breakdown_gb": (ranks[0] or {}).get("memory")}}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def run_plan(plan_path: Path, report: Path, *, steps: int, smoke: bool) -> dict[str, Any]:
    """``gemc run`` in a fresh process (its own CUDA context and allocator peak)."""
    cmd = [sys.executable, "-m", "gemc.cli", "run", str(plan_path), "--steps", str(steps),
           "--report", str(report), "--quiet"]
    if smoke:
        cmd += ["--device", "cpu", "--no-kernels"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"gemc run exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return json.loads(report.read_text())


def _measured(report: dict[str, Any]) -> dict[str, Any]:
    peaks = [r["memory"]["peak_bytes"] for r in report["per_rank"]]
    return {"step_ms": report["step_ms"], "peak_gb": max(peaks) / 1e9,
            "device": report["device"], "steps": report["steps"]["run"]}


def _predicted(plan: dict[str, Any]) -> dict[str, Any]:
    pred = plan["predicted"]
    return {"step_ms": pred["step_ms"], "peak_gb": pred["max_memory_gb"],
            "kind_ms": pred.get("kind_ms"), "breakdown_ms": pred.get("breakdown_ms")}


def _errors(pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, float]:
    return {"time_error_pct": 100 * (pred["step_ms"] - meas["step_ms"]) / meas["step_ms"],
            "memory_error_pct": 100 * (pred["peak_gb"] - meas["peak_gb"]) / meas["peak_gb"]}


def _stats(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    errs = [abs(r[key]) for r in rows if r.get(key) is not None]
    return {"mape_pct": statistics.fmean(errs) if errs else None,
            "worst_pct": max(errs) if errs else None, "n": len(errs)}


def plan_main(args: argparse.Namespace) -> int:
    """Plan mode: compile, run, compare; then the leave-half-out refit (module doc)."""
    from gemc.cost_model.calibration import resolve_calibration
    from gemc.cost_model.hardware import get_gpu
    from gemc.cost_model.run_fit import calibrate_from_runs

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = get_gpu(args.gpu or "h200").name
    topology = f"{gpu}:1x1"
    preset = args.preset or ("tiny" if args.smoke else gpu)
    steps = args.steps or (3 if args.smoke else 30)
    run_on = args.smoke or torch.cuda.is_available()
    if not run_on:
        print("no CUDA GPU: compiling and predicting only (use --smoke for a CPU run)",
              file=sys.stderr)
    calibration = args.calibration
    base = resolve_calibration(calibration, gpu)
    zoo = zoo_measurements(args.measured_from_zoo) if args.measured_from_zoo else {}
    if zoo:
        run_on = False
    # benchmarks/zoo.py turns TF32 on for every variant: its rows ran fp32 GEMMs on TF32
    fp32_matmul = args.fp32_matmul or ("tf32" if zoo else "ieee")
    models = plan_models(args.models)
    if zoo and not args.models:
        models = {n: e for n, e in models.items() if n in zoo}
    rows: list[dict[str, Any]] = []
    for name, entrypoint in models.items():
        row: dict[str, Any] = {"model": name, "preset": preset, "topology": topology}
        plan_path = out / f"{_slug(name)}.plan.json"
        try:
            t0 = time.perf_counter()
            plan = compile_plan(entrypoint, preset, topology, calibration, plan_path,
                                args.planner, fp32_matmul)
            row["predicted"] = _predicted(plan)
            row["compile_s"] = time.perf_counter() - t0
            if name in zoo:  # measured earlier (a zoo row), predicted now
                row["measured"] = zoo[name]
                change = program_change(plan, zoo[name])
                row["same_program"] = None if change is None else not change
                if change:
                    row["kernels_changed"] = change
                row["run_report"] = str(synthetic_run_report(
                    plan, zoo[name], out / f"{_slug(name)}.run.json"))
                row.update(_errors(row["predicted"], row["measured"]))
            elif run_on:
                report = run_plan(plan_path, out / f"{_slug(name)}.run.json", steps=steps,
                                  smoke=args.smoke)
                row["measured"] = _measured(report)
                row["run_report"] = str(out / f"{_slug(name)}.run.json")
                row.update(_errors(row["predicted"], row["measured"]))
        except Exception as exc:  # one broken model is one row, the others still count
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        _print_plan_row(row)

    refit = _leave_half_out(rows, base, preset, topology, out, smoke=args.smoke,
                            fit=calibrate_from_runs, planner=args.planner,
                            fp32_matmul=fp32_matmul)
    same = [r for r in rows if r.get("same_program") is not False]
    refit_same = [r for r in refit if r.get("same_program") is not False]
    summary = {"time": _stats(rows, "time_error_pct"), "memory": _stats(rows, "memory_error_pct"),
               "refit_time": _stats(refit, "time_error_pct"),
               "refit_memory": _stats(refit, "memory_error_pct"),
               "same_program_time": _stats(same, "time_error_pct"),
               "same_program_memory": _stats(same, "memory_error_pct"),
               "same_program_refit_time": _stats(refit_same, "time_error_pct"),
               "same_program_refit_memory": _stats(refit_same, "memory_error_pct"),
               "program_changed": [r["model"] for r in rows if r.get("same_program") is False],
               "failed": [r["model"] for r in rows if "error" in r],
               "targets": "time MAPE <= 10%, worst <= 20%; memory MAPE <= 10%"}
    doc = {"benchmark": "cost_model_accuracy", "mode": "plan", "gpu": gpu,
           "environment": _environment("cuda" if run_on and not args.smoke else "cpu", base),
           "steps": steps, "summary": summary, "models": rows, "refit": refit,
           "planner": args.planner, "fp32_matmul": fp32_matmul, "measured_from_zoo": args.measured_from_zoo or None}
    if zoo:
        doc["note"] = ("predicted at this commit, measured at the commits of the zoo files "
                       "named in measured_from_zoo")
    (out / "cost_model_accuracy.json").write_text(json.dumps(doc, indent=1, sort_keys=True)
                                                 + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out / 'cost_model_accuracy.json'}")
    return 0


def _leave_half_out(rows: list[dict[str, Any]], base: Any, preset: str, topology: str,
                    out: Path, *, smoke: bool, fit: Any,
                    planner: str = "greedy", fp32_matmul: str = "ieee"
                    ) -> list[dict[str, Any]]:
    """Fit on the runs of every other model, judge on the rest, then the other way round.
    A run of another program than the plan compiled now (``same_program`` False) is
    judged but never fitted on."""
    measured = [r for r in rows if "measured" in r]
    if len(measured) < 2 or base is None:
        return []
    halves = (measured[0::2], measured[1::2])
    result = []
    for i, (half, test) in enumerate((halves, halves[::-1])):
        train = [r for r in half if r.get("same_program") is not False]
        cal_path = out / f"refit_{i}.calibration.json"
        if not train:
            result.append({"fold": i, "error": "no run of the same program in this half: "
                           f"{', '.join(r['model'] for r in half)} ran other kernels"})
            continue
        try:
            fit([r["run_report"] for r in train], base, cal_path, require_gpu=not smoke)
        except Exception as exc:
            result.append({"fold": i, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for r in test:
            entry: dict[str, Any] = {"fold": i, "model": r["model"],
                                     "trained_on": [t["model"] for t in train],
                                     "same_program": r.get("same_program")}
            if r.get("kernels_changed"):
                entry["kernels_changed"] = r["kernels_changed"]
            try:
                plan = compile_plan(plan_models(r["model"])[r["model"]], preset, topology,
                                    str(cal_path), out / f"{_slug(r['model'])}.refit.plan.json",
                                    planner, fp32_matmul)
                entry["predicted"] = _predicted(plan)
                entry["measured"] = r["measured"]
                entry.update(_errors(entry["predicted"], r["measured"]))
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
            result.append(entry)
            print(f"refit fold {i} (fit on {', '.join(entry['trained_on'])}): "
                  f"{_fmt_row(entry)}", flush=True)
    return result


def _fmt_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row.get('model', '?')}: ERROR {row['error'][:160]}"
    pred, meas = row.get("predicted", {}), row.get("measured")
    text = f"{row['model']:<20} pred {pred['step_ms']:9.2f} ms {pred['peak_gb']:7.2f} GB"
    if meas:
        text += (f"  meas {meas['step_ms']:9.2f} ms {meas['peak_gb']:7.2f} GB ({meas['device']})"
                 f"  err {row['time_error_pct']:+6.1f}% / {row['memory_error_pct']:+6.1f}%")
    if row.get("same_program") is False:
        text += "  (ran other kernels: " + ", ".join(
            f"{k} {ran}->{now}" for k, (ran, now) in (row.get("kernels_changed") or {}).items()
        ) + ")"
    return text


def _print_plan_row(row: dict[str, Any]) -> None:
    print(_fmt_row(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("plan", "eager"), default="plan",
                        help="plan: the compiled plan vs gemc run (default); eager: the "
                        "eager single-GPU step (issue 3)")
    parser.add_argument("--out", default=None,
                        help="plan mode: a directory (default out/cost_model_accuracy); "
                        "eager mode: the JSON file (default out/cost_model_accuracy.json)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny presets, CPU timing: checks the script, not the model")
    parser.add_argument("--models", default=None,
                        help="comma list (plan mode: gem, dlrm, zoo/NAME; default all; "
                        "eager mode: gem, dlrm, default both)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--batch-sizes", default=None,
                        help="comma list; default 1/4, 1/2, 1x of each preset's batch")
    parser.add_argument("--preset", default=None, help="default h200 (tiny with --smoke)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu", default=None, help="GPU spec to predict for (default: "
                        "the visible CUDA device, else h200)")
    parser.add_argument("--calibration", default="auto",
                        help="calibration file, 'auto' (the one shipped for the GPU) or 'none'")
    parser.add_argument("--no-measure", action="store_true", help="predict only")
    parser.add_argument("--measured-from", default=None, metavar="JSON",
                        help="score new predictions against the measurements of an earlier "
                        "report (e.g. benchmarks/results/cost_model_accuracy_h200.json): "
                        "re-checks a cost-model change without a GPU")
    parser.add_argument("--measured-from-zoo", nargs="+", default=None, metavar="JSON",
                        help="plan mode without a GPU: score plans compiled now against the "
                        "gemc rows of benchmarks/zoo.py result files (step_ms, "
                        "peak_memory_bytes; later files win) and run the leave-half-out "
                        "refit on those measurements")
    parser.add_argument("--planner", default="greedy",
                        help="plan mode: the planner to compile with (default greedy; the "
                        "zoo runs used 'default')")
    parser.add_argument("--fp32-matmul", default=None, choices=("ieee", "tf32"),
                        help="plan mode: how the plans run fp32 GEMMs (gemc compile "
                        "--fp32-matmul); default tf32 with --measured-from-zoo (zoo.py's "
                        "runs had TF32 on), else ieee")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless MAPE <= 10%% and every config within 20%%")
    args = parser.parse_args(argv)
    if args.mode == "plan":
        args.out = args.out or "out/cost_model_accuracy"
        return plan_main(args)
    args.out = args.out or "out/cost_model_accuracy.json"
    args.models = args.models or "gem,dlrm"

    from gemc.cost_model.calibration import default_calibration, load_calibration
    from gemc.cost_model.hardware import get_gpu, gpu_from_device_name

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda and not args.smoke else "cpu"
    gpu_name = args.gpu
    if gpu_name is None:
        spec = gpu_from_device_name(torch.cuda.get_device_name(0)) if cuda else None
        gpu_name = spec.name if spec else "h200"
    gpu_name = get_gpu(gpu_name).name
    if args.calibration == "none":
        calibration = None
    elif args.calibration == "auto":
        calibration = default_calibration(gpu_name)
    else:
        calibration = load_calibration(args.calibration)
    preset = args.preset or ("tiny" if args.smoke else "h200")
    steps = args.steps or (3 if args.smoke else 10)
    measure_on = not args.no_measure
    earlier: dict[str, dict[str, Any]] = {}
    if args.measured_from:
        prior = json.loads(Path(args.measured_from).read_text())
        earlier = {r["config"]: r["measured"] for r in prior["configs"] if r.get("measured")}
        measure_on = False
    if device == "cpu" and not args.smoke and measure_on:
        print("no CUDA GPU: predicting only (use --smoke for a CPU timing run)", file=sys.stderr)
        measure_on = False

    rows: list[dict[str, Any]] = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        entrypoint = f"{MODELS[model_name]}:build"
        if args.batch_sizes:
            batches = [int(b) for b in args.batch_sizes.split(",")]
        else:
            base = _preset_batch(entrypoint, preset)
            fractions = BATCH_FRACTIONS[1:] if args.smoke else BATCH_FRACTIONS
            batches = sorted({max(2, int(base * f)) for f in fractions})
        for batch in batches:
            for dname in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
                cfg = {"preset": preset, "batch_size": batch}
                name = f"{model_name}/{preset}/b{batch}/{dname}"
                row: dict[str, Any] = {"config": name, "model": model_name, "preset": preset,
                                       "batch_size": batch, "dtype": dname}
                try:
                    row["predicted"] = predict(entrypoint, cfg, DTYPES[dname], gpu_name,
                                               calibration)
                    if measure_on:
                        row["measured"] = measure(entrypoint, cfg, DTYPES[dname], device,
                                                  steps=steps, warmup=args.warmup)
                except Exception as exc:  # keep going: one broken config is one row
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                if row["config"] in earlier and "predicted" in row:
                    row["measured"] = earlier[row["config"]]
                _score(row, comparable=str(row.get("measured", {}).get("device", device))
                       .startswith("cuda"))
                rows.append(row)
                _print_row(row)

    summary = _summary(rows)
    report = {"benchmark": "cost_model_accuracy", "gpu": gpu_name,
              "environment": _environment(device, calibration), "summary": summary,
              "configs": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    if args.check and summary.get("mape_pct") is not None:
        ok = summary["mape_pct"] <= 10 and summary["max_abs_error_pct"] <= 20
        return 0 if ok else 1
    return 0


def _score(row: dict[str, Any], *, comparable: bool) -> None:
    pred, meas = row.get("predicted"), row.get("measured")
    if not (pred and meas and comparable and meas["step_ms"] > 0):
        return
    row["time_error_pct"] = 100 * (pred["step_ms"] - meas["step_ms"]) / meas["step_ms"]
    peak = meas.get("max_memory_allocated_gb") or 0
    if peak > 0:
        row["memory_error_pct"] = 100 * (pred["memory_gb"]["peak"] - peak) / peak


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errs = [abs(r["time_error_pct"]) for r in rows if "time_error_pct" in r]
    mem = [abs(r["memory_error_pct"]) for r in rows if "memory_error_pct" in r]
    return {
        "configs": len(rows),
        "scored": len(errs),
        "failed": [r["config"] for r in rows if "error" in r],
        "mape_pct": statistics.fmean(errs) if errs else None,
        "max_abs_error_pct": max(errs) if errs else None,
        "memory_mape_pct": statistics.fmean(mem) if mem else None,
        "memory_max_abs_error_pct": max(mem) if mem else None,
        "targets": "MAPE <= 10%, every config <= 20%; memory within 15%",
    }


def _print_row(row: dict[str, Any]) -> None:
    pred = row.get("predicted", {})
    meas = row.get("measured", {})
    parts = [f"{row['config']:<28}"]
    if "error" in row:
        parts.append(f"ERROR {row['error'][:120]}")
    else:
        parts.append(f"pred {pred.get('step_ms', float('nan')):9.2f} ms")
        if meas:
            parts.append(f"meas {meas['step_ms']:9.2f} ms ({meas['device']})")
        if "time_error_pct" in row:
            parts.append(f"err {row['time_error_pct']:+6.1f}%")
        if "memory_error_pct" in row:
            parts.append(f"mem pred {pred['memory_gb']['peak']:6.2f} GB "
                         f"meas {meas['max_memory_allocated_gb']:6.2f} GB "
                         f"err {row['memory_error_pct']:+6.1f}%")
        parts.append(f"[{pred.get('cost_model', '?')}]")
    print("  ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""How well does the cost model predict a real training step? One command on the H200.

For the GEM and DLRM examples x batch sizes x {bf16, fp32}: capture and annotate the model
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
to exercise the code (CPU times are not comparable with a GPU prediction).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/cost_model_accuracy.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny presets, CPU timing: checks the script, not the model")
    parser.add_argument("--models", default="gem,dlrm")
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
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless MAPE <= 10%% and every config within 20%%")
    args = parser.parse_args(argv)

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

"""Where does an eager step's time go? Measured GPU kernel time by category vs the cost model.

For each config (``model/preset/bBATCH/dtype``, as the accuracy benchmark names them) this
runs *the accuracy benchmark's* eager step (``cost_model_accuracy.EagerStep``: same model,
cast, foreach AdamW, batches), times it with CUDA events as that benchmark does, then
profiles a few steps with torch.profiler (CPU + CUDA activity) and sorts every GPU kernel
(and memcpy/memset) into the categories ``gemc.cost_model.eager`` predicts:

    gemm, attention, embedding_fwd, embedding_bwd, norm, pointwise (everything else:
    elementwise, reductions, index, casts, fills, loss), optimizer (all of opt.step)

each split by phase (fwd / bwd / opt, from ``record_function`` ranges around the phases:
a kernel belongs to the phase in which the CPU launched it). The CPU side: GPU idle
(step time minus kernel busy time: the stream waiting on the CPU or on a sync), per phase
the CPU wall time, the GPU busy time and the GPU span, and the host syncs (device-to-host
copies, stream/device synchronizations, cudaMalloc/cudaFree) seen in each phase. It prints measured against
predicted per category side by side, the top kernels, and for every bf16/fp32 pair of the
same model and batch how each category scales (measured vs predicted ratio). JSON to --out.

    python benchmarks/cost_model_breakdown.py --calibration cost_model/data/h200.json \\
        --out out/breakdown.json                                    # on the H200
    python benchmarks/cost_model_breakdown.py --smoke --out /tmp/bd.json   # CPU check

Attribution rules (``classify``): a kernel is sorted by the chain of CPU ops that launched
it (ATen ops and autograd nodes, outermost first) and its own name: optimizer phase ->
optimizer; an ``embedding`` op in the chain -> embedding_fwd/bwd by phase (the dense
gradient's zero fill included); scaled-dot-product attention ops -> attention; a kernel
whose name is a GEMM's (cuBLAS/cuBLASLt/CUTLASS/nvjet) or that an mm/addmm/bmm launched ->
gemm (bias-gradient reductions are *not* gemm: the cost model does not count them there
either); layer/rms/batch norm and softmax ops -> norm; the rest -> pointwise.

``--smoke`` runs the tiny presets on the CPU with the profiler's CPU activity only: the
"kernels" are then the innermost CPU ops. It checks the script, not the cost model.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cost_model_accuracy as acc  # noqa: E402  (the same step, predictor and model list)

DEFAULT_CONFIGS = ("dlrm/h200/b16384/bf16", "dlrm/h200/b16384/fp32",
                   "gem/h200/b1024/bf16", "gem/h200/b1024/fp32")
SMOKE_CONFIGS = ("dlrm/tiny/b32/bf16", "dlrm/tiny/b32/fp32",
                 "gem/tiny/b16/bf16", "gem/tiny/b16/fp32")
PHASE_OF_LABEL = {"gemc::forward": "fwd", "gemc::backward": "bwd", "gemc::optimizer": "opt",
                  "gemc::zero_grad": "zero_grad"}
MEASURED_PHASES = ("fwd", "bwd", "opt", "other")

_GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|gemv|splitk|dot_kernel|"
                          r"\bsm\d\d_|ampere_|hopper_|volta_|turing_", re.IGNORECASE)
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
             "aten::_scaled_mm", "aten::matmul", "aten::linear", "aten::einsum"}
_NOT_GEMM_KERNEL = re.compile(r"elementwise|vectorized|copy|fill|reduce|memset|memcpy",
                              re.IGNORECASE)
_ATTENTION = ("scaled_dot_product", "scaleddotproduct", "flash_attention", "efficient_attention",
              "flashattention", "efficientattention", "cudnn_attention", "fmha")
_NORM = ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "batch_norm", "batchnorm",
         "group_norm", "groupnorm", "softmax")
# host syncs, copies, and allocator calls (cudaFree waits for the device) seen in a phase
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "cuMemcpyDtoH", "cudaMalloc", "cudaFree", "cudaHostAlloc")
_GPU_ACTIVITIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def classify(chain: list[str], kernel: str, phase: str) -> str:
    """The cost-model category of one kernel launched under ``chain`` (CPU op names,
    outermost first; innermost last) during ``phase``."""
    if phase == "opt":
        return "optimizer"
    text = " ".join(chain).lower()
    if "embedding" in text:
        return "embedding_bwd" if phase == "bwd" else "embedding_fwd"
    if any(k in text for k in _ATTENTION) or any(k in kernel.lower() for k in _ATTENTION):
        return "attention"
    innermost = chain[-1] if chain else ""
    if _GEMM_KERNEL.search(kernel) or (innermost in _GEMM_OPS
                                        and not _NOT_GEMM_KERNEL.search(kernel)):
        return "gemm"
    if any(k in text for k in _NORM):
        return "norm"
    return "pointwise"


def kernel_class(name: str) -> str:
    """A coarse label of what a kernel is (for the 'what is in this category' lines)."""
    low = name.lower()
    for label, keys in (("memcpy", ("memcpy",)), ("memset", ("memset",)),
                        ("fill", ("fill",)), ("copy/cast", ("copy", "cast")),
                        ("sort", ("sort", "radix")), ("scan", ("scan",)),
                        ("foreach", ("multi_tensor", "foreach")),
                        ("reduce", ("reduce",)), ("index/scatter", ("index", "scatter",
                                                                   "gather")),
                        ("embedding", ("embedding", "segment", "bag")),
                        ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "gemv")),
                        ("elementwise", ("elementwise", "vectorized", "unrolled"))):
        if any(k in low for k in keys):
            return label
    return "other"


def short_name(name: str, limit: int = 200) -> str:
    """A kernel's name without the namespaces that make the interesting part scroll off."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at::cuda::", "c10::",
                  "std::"):
        name = name.replace(noise, "")
    return name[:limit]


# ---- reading a profile -------------------------------------------------------------------
def _ev(e: Any) -> dict[str, Any]:
    start = int(e.start_ns())
    dur = int(e.duration_ns()) if hasattr(e, "duration_ns") else int(e.end_ns()) - start
    act = str(e.activity_type()) if hasattr(e, "activity_type") else ""
    return {"name": e.name(), "cuda": e.device_type() != torch.autograd.DeviceType.CPU,
            "start": start, "end": start + max(dur, 0), "corr": int(e.correlation_id()),
            "linked": int(e.linked_correlation_id()), "tid": int(e.start_thread_id()),
            "act": act}


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _is_annotation(e: dict[str, Any], labels: set[str]) -> bool:
    """A GPU-timeline user annotation, not a kernel: the profiler mirrors every
    ``record_function`` range that launched kernels (``gemc::step``, torch's
    ``Optimizer.step#AdamW.step``) onto the GPU timeline as one event spanning those
    kernels. Counted as a kernel it doubles their time (19 ms of "optimizer" on the H200).
    Told apart by its activity type where the event has one, else by its name: the label
    of a CPU-side range (``labels``; kernel names never are one)."""
    return "annotation" in e["act"] or e["name"] in labels \
        or e["name"].startswith(("gemc::", "Optimizer.", "ProfilerStep#"))


def analyze(events: list[Any], *, skip_steps: int = 1, top: int = 25) -> dict[str, Any]:
    """Per-step averages of GPU kernel time by category and phase, from raw kineto events
    (``prof.profiler.kineto_results.events()``) of steps wrapped in gemc:: ranges."""
    evs = [_ev(e) for e in events]
    cpu_ops = [e for e in evs if not e["cuda"] and e["linked"] == 0
               and e["act"] not in ("cuda_runtime", "cuda_driver")]
    runtime = [e for e in evs if not e["cuda"] and (e["linked"] > 0 or e["act"] in (
        "cuda_runtime", "cuda_driver"))]
    labels = {e["name"] for e in cpu_ops}  # CPU ops and record_function ranges
    gpu = [e for e in evs if e["cuda"] and not _is_annotation(e, labels) and (
        e["act"] in _GPU_ACTIVITIES or not e["act"])]

    steps = sorted((e for e in cpu_ops if e["name"] == "gemc::step"), key=lambda e: e["start"])
    steps = steps[skip_steps:] if len(steps) > skip_steps else steps
    if not steps:
        raise RuntimeError("no gemc::step ranges in the profile")
    phases = sorted(((e["start"], e["end"], PHASE_OF_LABEL[e["name"]]) for e in cpu_ops
                     if e["name"] in PHASE_OF_LABEL), key=lambda p: p[0])
    phase_starts = [p[0] for p in phases]
    step_starts = [s["start"] for s in steps]

    def step_of(t: int) -> int | None:
        i = bisect.bisect_right(step_starts, t) - 1
        return i if i >= 0 and t <= steps[i]["end"] else None

    def phase_of(t: int) -> str:
        i = bisect.bisect_right(phase_starts, t) - 1
        if i >= 0 and t <= phases[i][1]:
            return {"zero_grad": "other"}.get(phases[i][2], phases[i][2])
        return "other"

    # CPU op nesting per thread -> parent links; op by correlation id.
    parent: dict[int, int] = {}
    by_thread: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(cpu_ops):
        by_thread[e["tid"]].append(i)
    for idxs in by_thread.values():
        idxs.sort(key=lambda i: (cpu_ops[i]["start"], -cpu_ops[i]["end"]))
        stack: list[int] = []
        for i in idxs:
            while stack and cpu_ops[stack[-1]]["end"] < cpu_ops[i]["end"]:
                stack.pop()
            if stack:
                parent[i] = stack[-1]
            stack.append(i)
    op_by_corr = {e["corr"]: i for i, e in enumerate(cpu_ops) if e["corr"]}
    launch_ns = {e["corr"]: e["start"] for e in runtime if e["corr"]}
    chain_cache: dict[int, list[str]] = {}

    def chain(i: int) -> list[str]:
        if i not in chain_cache:
            names, j = [], i
            while j is not None:
                if not cpu_ops[j]["name"].startswith("gemc::"):
                    names.append(cpu_ops[j]["name"])
                j = parent.get(j)
            chain_cache[i] = names[::-1]
        return chain_cache[i]

    # The work items: GPU activities, or with no GPU in the trace the innermost CPU ops.
    items: list[dict[str, Any]] = []
    if gpu:
        for g in gpu:
            op = op_by_corr.get(g["linked"])
            t = launch_ns.get(g["corr"], cpu_ops[op]["start"] if op is not None else g["start"])
            items.append({"name": g["name"], "start": g["start"], "end": g["end"], "launch": t,
                          "chain": chain(op) if op is not None else []})
        device = "cuda"
    else:  # CPU only: every op's self time (its duration less its children's)
        child_ns: dict[int, int] = defaultdict(int)
        for i, p in parent.items():
            child_ns[p] += cpu_ops[i]["end"] - cpu_ops[i]["start"]
        for i, e in enumerate(cpu_ops):
            self_ns = e["end"] - e["start"] - child_ns[i]
            if e["name"].startswith("gemc::") or self_ns <= 0:
                continue
            items.append({"name": e["name"], "start": e["start"], "end": e["start"] + self_ns,
                          "launch": e["start"], "chain": chain(i)})
        device = "cpu"

    n = len(steps)
    cats: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(MEASURED_PHASES, 0.0))
    counts: dict[str, int] = defaultdict(int)
    classes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    kernels: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    origins: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_step: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    per_phase: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for it in items:
        s = step_of(it["launch"])
        if s is None:
            continue
        ph = phase_of(it["launch"])
        cat = classify(it["chain"], it["name"], ph)
        ms = (it["end"] - it["start"]) / 1e6
        cats[cat][ph] += ms
        counts[cat] += 1
        classes[cat][kernel_class(it["name"])] += ms
        k = kernels[(short_name(it["name"]), cat, ph)]
        k[0] += 1
        k[1] += ms
        origin = next((c for c in it["chain"] if not c.startswith(("autograd::engine",
                                                                   "Optimizer."))),
                      "(no op)")
        origins[cat][origin] += ms
        per_step[s].append((it["start"], it["end"]))
        per_phase[ph].append((it["start"], it["end"]))

    busy = [_union_ns(iv) / 1e6 for iv in per_step]
    span = [(max(e for _, e in iv) - min(s for s, _ in iv)) / 1e6 if iv else 0.0
            for iv in per_step]
    phase_stats: dict[str, dict[str, float]] = {}
    for ph in MEASURED_PHASES:
        iv = per_phase.get(ph, [])
        cpu_ms = sum(p[1] - p[0] for p in phases if {"zero_grad": "other"}.get(p[2], p[2]) == ph
                     and step_of(p[0]) is not None) / 1e6
        phase_stats[ph] = {
            "cpu_wall_ms": cpu_ms / n,
            "gpu_busy_ms": _union_ns(iv) / 1e6 / n,
            # first kernel start to last kernel end of the phase, averaged over steps
            "gpu_span_ms": statistics.fmean(
                [(max(e for _, e in sub) - min(s for s, _ in sub)) / 1e6 if sub else 0.0
                 for sub in _split_by_step(iv, per_step)]) if iv else 0.0,
        }
    syncs: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in runtime:
        if step_of(r["start"]) is not None and any(r["name"].startswith(c) for c in _SYNC_CALLS):
            syncs[phase_of(r["start"])][r["name"]] += 1
    dtoh = defaultdict(int)
    for g in gpu:
        if "dtoh" in g["name"].lower() or "device -> pageable" in g["name"].lower():
            op = op_by_corr.get(g["linked"])
            t = launch_ns.get(g["corr"], cpu_ops[op]["start"] if op is not None else g["start"])
            if step_of(t) is not None:
                dtoh[phase_of(t)] += 1

    def avg(d: dict[str, float]) -> dict[str, float]:
        return {k: v / n for k, v in d.items()}

    top_kernels = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "device": device, "steps": n,
        "step_ms_profiled": statistics.fmean((s["end"] - s["start"]) / 1e6 for s in steps),
        "gpu_busy_ms": statistics.fmean(busy), "gpu_span_ms": statistics.fmean(span),
        "by_category_ms": {c: avg(v) for c, v in sorted(cats.items())},
        "kernels_by_category": {c: round(v / n, 1) for c, v in sorted(counts.items())},
        "kernel_classes_ms": {c: dict(sorted(avg(v).items(), key=lambda kv: -kv[1]))
                              for c, v in sorted(classes.items())},
        "top_ops_by_category_ms": {c: dict(sorted(avg(v).items(), key=lambda kv: -kv[1])[:8])
                                   for c, v in sorted(origins.items())},
        "phases": phase_stats,
        "syncs_per_step": {ph: {k: v / n for k, v in d.items()} for ph, d in syncs.items()},
        "dtoh_copies_per_step": {ph: v / n for ph, v in dtoh.items()},
        "top_kernels": [{"name": k[0], "category": k[1], "phase": k[2], "count": v[0] / n,
                         "ms": v[1] / n} for k, v in top_kernels],
    }


def _split_by_step(iv: list[tuple[int, int]],
                   per_step: list[list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """The intervals of ``iv`` grouped by the step whose kernels they are."""
    bounds = [(min(s for s, _ in st), max(e for _, e in st)) for st in per_step if st]
    out: list[list[tuple[int, int]]] = [[] for _ in bounds]
    for s, e in iv:
        for j, (lo, hi) in enumerate(bounds):
            if lo <= s <= hi:
                out[j].append((s, e))
                break
    return [o for o in out if o]


# ---- measuring -----------------------------------------------------------------------------
def measure_breakdown(entrypoint: str, cfg: dict[str, Any], dtype: torch.dtype, device: str, *,
                      warmup: int, steps: int, profile_steps: int,
                      batches: int = 2) -> dict[str, Any]:
    """Time the accuracy benchmark's eager step (CUDA events, per-phase CPU wall), then
    profile ``profile_steps`` steps (+1 discarded) and sort the kernels into categories."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.startswith("cuda")
    t_build = time.perf_counter()
    eager = acc.EagerStep(entrypoint, cfg, dtype, device, n_batches=max(1, batches))
    build_s = time.perf_counter() - t_build
    try:
        for i in range(warmup):
            eager.run(i)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        times: list[float] = []
        cpu_phase: dict[str, list[float]] = defaultdict(list)

        def timer(phase: str) -> Any:
            class _T:
                def __enter__(self) -> None:
                    self.t0 = time.perf_counter()

                def __exit__(self, *exc: Any) -> None:
                    cpu_phase[phase].append(1e3 * (time.perf_counter() - self.t0))
            return _T()

        for i in range(steps):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                eager.run(i, timer)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                eager.run(i, timer)
                times.append(1e3 * (time.perf_counter() - t0))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        t_prof = time.perf_counter()
        with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
            for i in range(profile_steps + 1):
                with record_function("gemc::step"):
                    eager.run(i, lambda ph: record_function(f"gemc::{ph}"))
                    sync()
        t_parse = time.perf_counter()
        result = analyze(prof.profiler.kineto_results.events(), skip_steps=1)
        result.update({
            "step_ms": statistics.median(times), "step_min_ms": min(times),
            "step_max_ms": max(times), "timed_steps": steps,
            "cpu_phase_wall_ms": {ph: statistics.median(v) for ph, v in cpu_phase.items()},
            "build_s": build_s, "profile_s": t_parse - t_prof,
            "parse_s": time.perf_counter() - t_parse,
        })
        result["gpu_idle_ms"] = max(result["step_ms"] - result["gpu_busy_ms"], 0.0) if cuda \
            else None
        return result
    finally:
        eager.close()


# ---- report --------------------------------------------------------------------------------
def _pred_cat(pred: dict[str, Any], cat: str, ph: str) -> float:
    return float(pred.get("by_category_ms", {}).get(cat, {}).get(ph, 0.0))


def _meas_cat(meas: dict[str, Any], cat: str, ph: str) -> float:
    return float(meas.get("by_category_ms", {}).get(cat, {}).get(ph, 0.0))


def _cat_total(d: dict[str, Any], cat: str) -> float:
    return float(sum(d.get("by_category_ms", {}).get(cat, {}).values()))


def compare(pred: dict[str, Any], meas: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the side-by-side table: category, per phase pred/meas, totals, kernels."""
    from gemc.cost_model.eager import CATEGORIES
    cats = list(CATEGORIES) + sorted(set(meas.get("by_category_ms", {})) - set(CATEGORIES))
    rows = []
    for cat in cats:
        row: dict[str, Any] = {"category": cat}
        for ph in ("fwd", "bwd", "opt"):
            row[f"pred_{ph}_ms"] = _pred_cat(pred, cat, ph)
            row[f"meas_{ph}_ms"] = _meas_cat(meas, cat, ph)
        row["meas_other_ms"] = _meas_cat(meas, cat, "other")
        row["pred_ms"] = _cat_total(pred, cat)
        row["meas_ms"] = _cat_total(meas, cat)
        row["diff_ms"] = row["pred_ms"] - row["meas_ms"]
        row["pred_kernels"] = pred.get("kernels_by_category", {}).get(cat, 0)
        row["meas_kernels"] = meas.get("kernels_by_category", {}).get(cat, 0)
        rows.append(row)
    return rows


def print_config(row: dict[str, Any]) -> None:
    name, pred, meas = row["config"], row.get("predicted", {}), row.get("measured", {})
    if "error" in row:
        print(f"\n{name}: ERROR {row['error']}", flush=True)
        return
    err = f"{100 * (pred['step_ms'] - meas['step_ms']) / meas['step_ms']:+.1f}%" \
        if meas.get("step_ms") else "n/a"
    print(f"\n{name}  step: pred {pred.get('step_ms', 0):.2f} ms, meas {meas['step_ms']:.2f} ms "
          f"(min {meas['step_min_ms']:.2f}, profiled {meas['step_ms_profiled']:.2f}), err {err}"
          f"  [{meas['device']}; build {meas['build_s']:.1f} s, profile "
          f"{meas['profile_s']:.1f} s, parse {meas['parse_s']:.1f} s]")
    hdr = (f"  {'category':<14}{'pred fwd':>9}{'meas fwd':>9}{'pred bwd':>9}{'meas bwd':>9}"
           f"{'pred opt':>9}{'meas opt':>9}{'pred':>9}{'meas':>9}{'pred-meas':>10}"
           f"{'kern p/m':>12}")
    print(hdr)
    for r in row["comparison"]:
        other = f"  (+{r['meas_other_ms']:.2f} outside phases)" if r["meas_other_ms"] > 0.005 \
            else ""
        print(f"  {r['category']:<14}{r['pred_fwd_ms']:9.2f}{r['meas_fwd_ms']:9.2f}"
              f"{r['pred_bwd_ms']:9.2f}{r['meas_bwd_ms']:9.2f}{r['pred_opt_ms']:9.2f}"
              f"{r['meas_opt_ms']:9.2f}{r['pred_ms']:9.2f}{r['meas_ms']:9.2f}"
              f"{r['diff_ms']:+10.2f}{r['pred_kernels']:>6}/{r['meas_kernels']:<6}{other}")
    p_busy, m_busy = pred.get("gpu_busy_ms", 0.0), meas["gpu_busy_ms"]
    print(f"  {'GPU busy':<14}{'':54}{p_busy:9.2f}{m_busy:9.2f}{p_busy - m_busy:+10.2f}")
    if meas.get("gpu_idle_ms") is not None:
        p_idle = pred.get("gpu_idle_ms", 0.0)
        print(f"  {'GPU idle':<14}{'':54}{p_idle:9.2f}{meas['gpu_idle_ms']:9.2f}"
              f"{p_idle - meas['gpu_idle_ms']:+10.2f}   (step - busy: waits on CPU/syncs)")
    print(f"  {'step':<14}{'':54}{pred.get('step_ms', 0):9.2f}{meas['step_ms']:9.2f}"
          f"{pred.get('step_ms', 0) - meas['step_ms']:+10.2f}")
    print(f"  CPU dispatch predicted {pred.get('cpu_dispatch_ms', 0):.2f} ms; per phase "
          "(meas CPU wall unprofiled | profiled CPU wall, GPU busy, GPU span):")
    for ph in ("fwd", "bwd", "opt", "other"):
        st = meas["phases"].get(ph, {})
        label = {"fwd": "forward", "bwd": "backward", "opt": "optimizer",
                 "other": "zero_grad"}[ph]
        wall = meas.get("cpu_phase_wall_ms", {}).get(label, float("nan"))
        sy = meas.get("syncs_per_step", {}).get(ph, {})
        sync_txt = ", ".join(f"{k} x{v:g}" for k, v in sy.items())
        dtoh = meas.get("dtoh_copies_per_step", {}).get(ph, 0)
        print(f"    {ph:<6} cpu {wall:8.2f} | cpu {st.get('cpu_wall_ms', 0):8.2f}  "
              f"busy {st.get('gpu_busy_ms', 0):8.2f}  span {st.get('gpu_span_ms', 0):8.2f}"
              f"  D2H {dtoh:g}{'  syncs: ' + sync_txt if sync_txt else ''}")
    for cat, cls in meas.get("kernel_classes_ms", {}).items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in list(cls.items())[:6])
        ops = ", ".join(f"{k} {v:.2f}" for k, v in
                        list(meas.get("top_ops_by_category_ms", {}).get(cat, {}).items())[:4])
        print(f"    {cat:<14} kernels: {parts}\n    {'':<14} ops:     {ops}")
    print("  top kernels (ms/step, count/step):")
    for k in meas.get("top_kernels", [])[:15]:
        print(f"    {k['ms']:8.3f} ms {k['count']:6g}x  {k['category']:<13} {k['phase']:<5} "
              f"{k['name'][:150]}")
    sys.stdout.flush()


def dtype_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each model/preset/batch measured in both bf16 and fp32: per category the
    bf16 - fp32 time and the bf16/fp32 ratio, measured and predicted."""
    from gemc.cost_model.eager import CATEGORIES
    by = {r["config"]: r for r in rows if "measured" in r and "predicted" in r}
    out = []
    for name, r in by.items():
        if not name.endswith("/bf16"):
            continue
        other = by.get(name[: -len("bf16")] + "fp32")
        if other is None:
            continue
        cats = []
        for cat in (*CATEGORIES, "busy", "idle", "step"):
            vals = []
            for row in (r, other):
                p, m = row["predicted"], row["measured"]
                if cat == "busy":
                    vals.append((p["gpu_busy_ms"], m["gpu_busy_ms"]))
                elif cat == "idle":
                    vals.append((p.get("gpu_idle_ms", 0.0), m.get("gpu_idle_ms") or 0.0))
                elif cat == "step":
                    vals.append((p["step_ms"], m["step_ms"]))
                else:
                    vals.append((_cat_total(p, cat), _cat_total(m, cat)))
            (pb, mb), (pf, mf) = vals
            cats.append({"category": cat, "pred_bf16": pb, "pred_fp32": pf, "meas_bf16": mb,
                         "meas_fp32": mf,
                         "pred_ratio": pb / pf if pf > 0 else None,
                         "meas_ratio": mb / mf if mf > 0 else None,
                         "bf16_missing_ms": mb - pb})
        out.append({"pair": name[: -len("/bf16")], "categories": cats})
    return out


def print_pairs(pairs: list[dict[str, Any]]) -> None:
    for p in pairs:
        print(f"\nbf16 vs fp32, {p['pair']}:  (bf16 meas-pred = what the model misses in bf16)")
        print(f"  {'category':<14}{'pred bf16':>10}{'meas bf16':>10}{'pred fp32':>10}"
              f"{'meas fp32':>10}{'pred b/f':>9}{'meas b/f':>9}{'bf16 m-p':>10}")
        for c in p["categories"]:
            pr = f"{c['pred_ratio']:.2f}" if c["pred_ratio"] is not None else "-"
            mr = f"{c['meas_ratio']:.2f}" if c["meas_ratio"] is not None else "-"
            print(f"  {c['category']:<14}{c['pred_bf16']:10.2f}{c['meas_bf16']:10.2f}"
                  f"{c['pred_fp32']:10.2f}{c['meas_fp32']:10.2f}{pr:>9}{mr:>9}"
                  f"{c['bf16_missing_ms']:+10.2f}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/cost_model_breakdown.json")
    parser.add_argument("--configs", default=None,
                        help="comma list of model/preset/bBATCH/dtype (default: "
                        + ",".join(DEFAULT_CONFIGS) + ")")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny presets on the CPU, profiler CPU activity only")
    parser.add_argument("--calibration", default="auto",
                        help="calibration file, 'auto' (shipped for the GPU) or 'none'")
    parser.add_argument("--gpu", default=None, help="GPU spec to predict for (default: the "
                        "visible CUDA device, else h200)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="profiled steps after one discarded (default 2)")
    parser.add_argument("--batches", type=int, default=2,
                        help="distinct batches cycled (the accuracy benchmark uses 4; drawing "
                        "DLRM's on the CPU takes seconds each)")
    args = parser.parse_args(argv)

    from gemc.cost_model.calibration import default_calibration, load_calibration
    from gemc.cost_model.hardware import get_gpu, gpu_from_device_name

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.smoke:
        print("no CUDA GPU: use --smoke for a CPU check", file=sys.stderr)
        return 2
    gpu_name = args.gpu
    if gpu_name is None:
        spec = gpu_from_device_name(torch.cuda.get_device_name(0)) if cuda else None
        gpu_name = spec.name if spec else "h200"
    gpu_name = get_gpu(gpu_name).name
    calibration = None if args.calibration == "none" else (
        default_calibration(gpu_name) if args.calibration == "auto"
        else load_calibration(args.calibration))
    configs = [c.strip() for c in (args.configs.split(",") if args.configs else
                                   (SMOKE_CONFIGS if args.smoke else DEFAULT_CONFIGS))
               if c.strip()]
    steps = args.steps or (2 if args.smoke else 5)
    profile_steps = args.profile_steps or (1 if args.smoke else 2)
    warmup = 1 if args.smoke and args.warmup == 3 else args.warmup

    t_all = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in configs:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"config": name}
        try:
            model, preset, batch, dname = name.split("/")
            entrypoint = f"{acc.MODELS[model]}:build"
            cfg = {"preset": preset, "batch_size": int(batch.lstrip("b"))}
            row["predicted"] = acc.predict(entrypoint, cfg, acc.DTYPES[dname], gpu_name,
                                           calibration)
            row["measured"] = measure_breakdown(entrypoint, cfg, acc.DTYPES[dname], device,
                                                warmup=warmup, steps=steps,
                                                profile_steps=profile_steps,
                                                batches=args.batches)
            row["comparison"] = compare(row["predicted"], row["measured"])
        except Exception as exc:  # one broken config is one row
            import traceback
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc(limit=6)
            print(row["traceback"], file=sys.stderr)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print_config(row)
        print(f"  ({row['wall_s']:.1f} s)", flush=True)
        _write(args.out, gpu_name, device, calibration, rows, t_all)  # partial results
    pairs = dtype_pairs(rows)
    print_pairs(pairs)
    report = _write(args.out, gpu_name, device, calibration, rows, t_all)
    print(f"\nwrote {args.out} ({report['elapsed_s']:.0f} s)")
    return 1 if any("error" in r for r in rows) else 0


def _write(path: str, gpu_name: str, device: str, calibration: Any, rows: list[dict[str, Any]],
           t_all: float) -> dict[str, Any]:
    """Write the report so far (atomically): a run cut short keeps its finished configs."""
    report = {"benchmark": "cost_model_breakdown", "gpu": gpu_name,
              "environment": acc._environment(device, calibration), "configs": rows,
              "dtype_pairs": dtype_pairs(rows), "elapsed_s": time.perf_counter() - t_all}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, out)
    return report


if __name__ == "__main__":
    sys.exit(main())

"""Per-step metrics, the rank-0 progress line, and the numbers the run report needs.

MFU, precisely: the plan's ``model.train_flops_per_step`` is the FLOPs of one forward and
backward of the model's representative batch (3x the forward's GEMM/attention FLOPs as the
compiler counted them). Every rank runs one such batch per step, so

    MFU = train_flops_per_step / (step_seconds * peak_flops_per_gpu)

(equivalently world_size x FLOPs over world_size x peak). ``peak_flops_per_gpu`` is the
datasheet dense peak of the plan's GPU (``gemc.cost_model.hardware``) for the dtype most
FLOPs run in: bf16/fp16 under autocast, TF32 when fp32 matmuls may use it, else fp32. On
the CPU there is no meaningful peak and MFU is reported as null.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepRecord:
    step: int  # completed-step count after this step (1-based)
    loss: float
    ms: float
    data_ms: float


@dataclass
class Metrics:
    """What one rank measured."""

    records: list[StepRecord] = field(default_factory=list)

    def timing(self, warmup: int) -> dict[str, float | None]:
        """Step-time statistics over the steps after ``warmup``."""
        times = [r.ms for r in self.records[warmup:]] or [r.ms for r in self.records]
        if not times:
            return {"mean": None, "median": None, "p90": None, "min": None, "steps": 0}
        ordered = sorted(times)
        return {
            "mean": statistics.fmean(times),
            "median": statistics.median(times),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "min": ordered[0],
            "steps": len(times),
        }


def memory_stats(device: torch.device) -> dict[str, Any]:
    """Peak memory of this process: the CUDA allocator's on GPU, the RSS high-water on CPU."""
    if device.type == "cuda":
        return {
            "kind": "cuda_max_memory_allocated",
            "peak_bytes": int(torch.cuda.max_memory_allocated(device)),
            "reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        }
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    return {"kind": "cpu_peak_rss", "peak_bytes": int(peak_kb) * 1024}


def peak_flops(gpu_name: str | None, compute_dtype: str, device: torch.device) -> dict[str, Any]:
    """The datasheet peak this run's MFU is measured against, or why there is none."""
    if device.type != "cuda":
        return {"flops": None, "note": "CPU run: no datasheet peak, MFU not reported"}
    try:
        from gemc.cost_model.hardware import get_gpu
    except ImportError as exc:  # the cost model is optional on a runner host
        return {"flops": None, "note": f"gemc.cost_model unavailable: {exc}"}
    dtype = compute_dtype
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    try:
        spec = get_gpu(gpu_name or torch.cuda.get_device_name(device))
    except Exception as exc:  # unknown GPU: say so rather than invent a peak
        return {"flops": None, "note": f"no datasheet for this GPU: {exc}"}
    return {"flops": spec.peak_flops(dtype), "dtype": dtype, "gpu": spec.name, "source": "datasheet"}


class Progress:
    """One ``\\r``-rewritten stderr line on rank 0 (a line every ~10% when not a TTY)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.every = max(1, (total - start) // 10)

    def update(self, rec: StepRecord, samples_per_s: float | None) -> None:
        if not self.enabled:
            return
        done = rec.step
        width = 24
        frac = done / max(self.total, 1)
        bar = "#" * int(width * frac) + "." * (width - int(width * frac))
        sps = f" {samples_per_s:,.0f} samples/s" if samples_per_s else ""
        text = (
            f"[{bar}] step {done}/{self.total} loss {rec.loss:.5f} "
            f"{rec.ms:.1f} ms{sps} ({time.perf_counter() - self.t0:.0f}s)"
        )
        if self.tty:
            sys.stderr.write(f"\r\033[K{text}")
        elif (done - self.start) % self.every == 0 or done == self.total:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host() -> str:
    return os.uname().nodename

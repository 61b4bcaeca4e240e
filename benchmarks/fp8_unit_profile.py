"""Where the compiled LayerNorm -> Linear's fwd+bwd spends its time, per variant, under
torch.profiler: host (CPU) time against GPU kernel time, and the top ops of each.

Why: on the H200 the fp8 unit with gemc's Triton quantisation kernels ran 3.80 ms at
M = 8,192 (bf16 1.54 ms) although its pieces timed alone add up to ~1.3 ms, while at
M = 32,768 it beat bf16 (BENCHMARKS.md, "Tenth session" / "Eleventh session"). A unit whose
host time per step exceeds its GPU time is launch-bound, not kernel-bound; this tells the
two apart. Same unit, weights and inputs as ``benchmarks/fp8_breakdown.py``.

    python3 benchmarks/fp8_unit_profile.py --tokens 8192 --out $OUT/fp8_unit_profile.json
    python3 benchmarks/fp8_unit_profile.py --smoke --out /tmp/p.json   # CPU, tiny, aot_eager
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import precision_gemms  # noqa: E402  (a sibling script: the unit, the timer)

VARIANTS = ("bf16", "fp8 aten", "fp8 triton")


def _profile(fn: Any, device: torch.device, iters: int, top: int) -> dict[str, Any]:
    """Host wall per iteration, GPU kernel time per iteration, and the top ops by each."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    # first without the profiler, which adds host time to every op it records: a unit is
    # GPU-bound when the loop returns well before the GPU is done (host < wall)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    plain_host_s = time.perf_counter() - t0
    sync()
    plain_wall_s = time.perf_counter() - t0
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host_s = time.perf_counter() - t0  # the loop's own wall, before waiting on the GPU
        sync()
        wall_s = time.perf_counter() - t0
    events = prof.key_averages()

    def dev_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)))

    # the kernels' own events only: a CPU op (aten::mm) also carries the device time of the
    # kernels it launched, so summing every event counted each ATen kernel twice (the
    # session-11 H200 figures, e.g. bf16 "2.97 ms" of ~1.5 ms of kernels)
    from torch.autograd import DeviceType

    kernels_us = sum(dev_us(e) for e in events if e.device_type != DeviceType.CPU)
    by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_dev = sorted(events, key=dev_us, reverse=True)[:top]
    return {
        "unprofiled_host_ms_per_iter": round(1e3 * plain_host_s / iters, 4),
        "unprofiled_wall_ms_per_iter": round(1e3 * plain_wall_s / iters, 4),
        "host_ms_per_iter": round(1e3 * host_s / iters, 4),
        "wall_ms_per_iter": round(1e3 * wall_s / iters, 4),
        "gpu_kernel_ms_per_iter": round(kernels_us / 1e3 / iters, 4),
        "top_self_cpu": [{"op": e.key, "calls_per_iter": e.count / iters,
                          "self_cpu_us_per_iter": round(e.self_cpu_time_total / iters, 1)}
                         for e in by_cpu],
        "top_self_gpu": [{"op": e.key, "calls_per_iter": e.count / iters,
                          "self_gpu_us_per_iter": round(dev_us(e) / iters, 1)}
                         for e in by_dev if dev_us(e) > 0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="M")
    p.add_argument("--features", type=int, default=4096, help="K = N")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--smoke", action="store_true", help="tiny, on the CPU (aot_eager)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from gemc.backends.torch import fp8

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    backend = "inductor" if cuda else "aot_eager"
    m, k = (args.tokens, args.features) if cuda else (64, 32)
    quantizers = {"bf16": (False, fp8.ATEN_QUANT), "fp8 aten": (True, fp8.ATEN_QUANT),
                  "fp8 triton": (True, fp8.TRITON_QUANT)}
    variants = VARIANTS if cuda else VARIANTS[:2]  # the kernels need a GPU or the interpreter
    aten_grads: list[torch.Tensor] = []
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).mul_(2).add_(0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, k, device=device) / math.sqrt(k)
    report: dict[str, Any] = {"benchmark": "fp8_unit_profile", "m": m, "k": k, "n": k,
                              "device": torch.cuda.get_device_name() if cuda else "cpu",
                              "torch": torch.__version__, "variants": {}}
    for name in variants:
        rowwise, quantizer = quantizers[name]
        torch.manual_seed(1)
        unit = precision_gemms._Unit(k, k, rowwise, not cuda, quantizer).to(device)
        fn = torch.compile(unit, backend=backend)

        def step(u: Any = unit, f: Any = fn) -> Any:
            return precision_gemms._grads(u, x, dy, f, True)

        for _ in range(3):
            grads = step()
        row = _profile(step, device, args.iters, args.top)
        report["variants"][name] = row
        if name == "fp8 aten":
            aten_grads = grads
        elif name == "fp8 triton":  # gemc's kernels quantise to the ATen path's bits
            row["y_dx_dw_equal_to_fp8_aten"] = [bool(torch.equal(g, w))
                                                for g, w in zip(grads, aten_grads)]
            print(f"    y, dx, dW bit-equal to fp8 aten: {row['y_dx_dw_equal_to_fp8_aten']}")
        print(f"{name:12s} host {row['host_ms_per_iter']:8.3f} ms/iter  wall "
              f"{row['wall_ms_per_iter']:8.3f}  GPU kernels {row['gpu_kernel_ms_per_iter']:8.3f}"
              f"  (unprofiled: host {row['unprofiled_host_ms_per_iter']:8.3f} wall "
              f"{row['unprofiled_wall_ms_per_iter']:8.3f})")
        for e in row["top_self_cpu"][:6]:
            print(f"    cpu {e['self_cpu_us_per_iter']:9.1f} us  x{e['calls_per_iter']:<5g} {e['op'][:80]}")
        for e in row["top_self_gpu"][:6]:
            print(f"    gpu {e['self_gpu_us_per_iter']:9.1f} us  x{e['calls_per_iter']:<5g} {e['op'][:80]}")
    out = Path(args.out)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

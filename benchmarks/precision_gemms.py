"""Does compiled row-wise fp8 beat bf16 on a LayerNorm -> Linear, forward + backward?

One command on the H200 (after ``source scripts/device_env.sh``; about 3 minutes)::

    python3 benchmarks/precision.py --gemms --out fp8_gemms.json
    python3 benchmarks/precision.py --gemms --smoke --out /tmp/fp8_gemms.json   # CPU

The unit the zoo's big linears repeat, ``y = Linear(LayerNorm(x))`` with fp32 parameters
under bf16 autocast (as the runner trains), both variants through ``torch.compile``
(Inductor), timed forward + backward (gradients of x, the norm's weight and bias, W and b):

* ``bf16``: the norm and ``nn.Linear`` under autocast -- cuBLAS bf16 GEMMs;
* ``fp8``: the norm, then :func:`gemc.backends.torch.fp8.fp8_linear` with the row-wise
  recipe (all three GEMMs e4m3 with per-row power-of-two scales along the contraction,
  ``torch._scaled_mm``): what graph mode runs for an fp8 site. Its quantisations are ATen
  ops, so Inductor fuses the activation's into the norm's kernel and the output gradient's
  into the kernels that produce or read it.

Shapes: M (tokens) in {4096, 8192, 16384, 32768} -- the zoo's big-linear token counts at
the ``h200`` presets (GEM's heads 4096, Wukong 8192, DLRM-DCNv2 16384, HSTU 32768) -- times
K, N in {1024, 2048, 4096}. M is compiled dynamic (one compile per K, N and variant), so
the 36 shapes cost 18 compiles. Per shape: the median of ``--iters`` CUDA-event timings
after ``--warmup``, the speedup over bf16, and the SQNR (dB) of y, dx and dW against the
same step in fp32. ``--smoke``: two tiny shapes on the CPU (fp8 emulated, AOTAutograd
only): it checks the code, not the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

TOKENS = (4096, 8192, 16384, 32768)
FEATURES = (1024, 2048, 4096)
SMOKE_SHAPES = [(64, 32, 48), (96, 32, 48)]


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = float(((ref - got) ** 2).sum())
    return math.inf if noise == 0 else round(10 * math.log10(float((ref**2).sum()) / noise), 1)


class _Unit(nn.Module):
    """LayerNorm -> Linear, the linear in bf16 (autocast) or row-wise fp8."""

    def __init__(self, k: int, n: int, fp8_rowwise: bool, emulate: bool,
                 quantizer: str = "aten", recipe: Any = None) -> None:
        """``recipe``: an ``Fp8Recipe`` other than row-wise fp8 for all three GEMMs."""
        super().__init__()
        from gemc.fp8_recipe import FP8_ROW, Fp8Recipe

        self.norm, self.linear = nn.LayerNorm(k), nn.Linear(k, n)
        self.fp8_rowwise, self.emulate, self.quantizer = fp8_rowwise, emulate, quantizer
        # Built here, not in forward: torch 2.11's Dynamo cannot construct the recipe
        # dataclass in a traced frame and breaks the graph there.
        self.recipe = recipe or Fp8Recipe.uniform(FP8_ROW)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from gemc.backends.torch import fp8

        h = self.norm(x)
        if not self.fp8_rowwise:
            return self.linear(h)
        return fp8.fp8_linear(h, self.linear.weight, self.linear.bias, self.recipe,
                              emulate=self.emulate, quantizer=self.quantizer)


def _grads(unit: _Unit, x: torch.Tensor, dy: torch.Tensor, fn: Callable[..., torch.Tensor],
           autocast: bool) -> list[torch.Tensor]:
    """y, dx, dW of one forward + backward."""
    x.grad = None
    for p in unit.parameters():
        p.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = fn(x)
    y.backward(dy.to(y.dtype))
    return [y.detach().float(), x.grad.float(), unit.linear.weight.grad.float()]


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def run_shapes(shapes: list[tuple[int, int, int]], device: torch.device, backend: str,
               warmup: int, iters: int, seed: int, quantizer: str = "aten"
               ) -> list[dict[str, Any]]:
    """Both variants on every (M, K, N), compiled once per (K, N) and variant; the fp8
    variant's operands quantised by ``quantizer`` (``fp8.QUANTIZERS``)."""
    emulate = device.type != "cuda"
    compiled: dict[tuple[int, int, bool], tuple[_Unit, Callable[..., torch.Tensor]]] = {}
    out = []
    for m, k, n in shapes:
        torch.manual_seed(seed)
        x = torch.randn(m, k, device=device).mul_(2).add_(0.5).to(torch.bfloat16)
        x.requires_grad_()
        dy = torch.randn(m, n, device=device) / math.sqrt(n)
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "variants": {}}
        ref = None
        for fp8_rowwise in (False, True):
            key = (k, n, fp8_rowwise)
            if key not in compiled:
                torch.manual_seed(seed + k + n)  # the same weights for both variants
                unit = _Unit(k, n, fp8_rowwise, emulate, quantizer).to(device)
                compiled[key] = unit, torch.compile(unit, backend=backend, dynamic=None)
            unit, fn = compiled[key]
            torch._dynamo.maybe_mark_dynamic(x, 0)
            if ref is None:  # the fp32 step, eager
                ref = _grads(unit, x.detach().float().requires_grad_(), dy, unit, False)
            t0 = time.perf_counter()
            got = _grads(unit, x, dy, fn, True)
            first_s = time.perf_counter() - t0
            ms = _time(lambda u=unit, f=fn, a=x, g=dy: _grads(u, a, g, f, True), device,
                       warmup, iters)
            name = "fp8 rowwise" if fp8_rowwise else "bf16"
            row["variants"][name] = {
                "ms": round(ms, 4), "first_call_s": round(first_s, 2),
                **{f"sqnr_{t}_db": _sqnr(r, g) for t, r, g in zip(("y", "dx", "dw"), ref, got)},
            }
        base = row["variants"]["bf16"]["ms"]
        for v in row["variants"].values():
            v["speedup_vs_bf16"] = round(base / v["ms"], 3)
        fp8_v = row["variants"]["fp8 rowwise"]
        print(f"M={m:6d} K={k:5d} N={n:5d}  bf16 {base:8.3f} ms  fp8 {fp8_v['ms']:8.3f} ms "
              f"({fp8_v['speedup_vs_bf16']:.2f}x)  SQNR y {fp8_v['sqnr_y_db']} dB, "
              f"dW {fp8_v['sqnr_dw_db']} dB", file=sys.stderr)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gemms", action="store_true", help="(precision.py's switch to this mode)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="M values, comma-separated")
    p.add_argument("--features", default=",".join(map(str, FEATURES)),
                   help="K and N values, comma-separated")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="two tiny shapes on the CPU")
    p.add_argument("--quantizer", default=None,
                   help="the fp8 operands' quantizer: aten (ATen ops Inductor fuses) or triton "
                        "(gemc's kernels); default: $GEMC_FP8_QUANTIZER, else aten")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from gemc.backends.torch import fp8

    try:
        args.quantizer = fp8.check_quantizer(args.quantizer or fp8.default_quantizer())
    except ValueError as err:
        p.error(str(err))
    t_start = time.perf_counter()
    if args.smoke or not torch.cuda.is_available():
        if not args.smoke:
            print("no GPU: running --smoke", file=sys.stderr)
        device, backend, shapes = torch.device("cpu"), "aot_eager", SMOKE_SHAPES
        args.warmup, args.iters = 1, 2
    else:
        device, backend = torch.device("cuda"), "inductor"
        feats = [int(v) for v in args.features.split(",")]
        shapes = [(m, k, n) for k in feats for n in feats
                  for m in (int(v) for v in args.tokens.split(","))]
    results = run_shapes(shapes, device, backend, args.warmup, args.iters, args.seed,
                         args.quantizer)
    speedups = [r["variants"]["fp8 rowwise"]["speedup_vs_bf16"] for r in results]
    report = report_header("fp8_gemms_compiled", args, device, backend) | {
        "total_s": round(time.perf_counter() - t_start, 1),
        "fp8_speedup_geomean": round(math.exp(statistics.fmean(map(math.log, speedups))), 3),
        "results": results,
    }
    write_report(Path(args.out), report)
    print(f"fp8/bf16 geomean {report['fp8_speedup_geomean']}x over {len(results)} shapes; "
          f"wrote {args.out}")
    return 0


def report_header(name: str, args: argparse.Namespace, device: torch.device,
                  backend: str) -> dict[str, Any]:
    """What every fp8 benchmark report opens with: the command, the date, the machine, the
    software and the options (also ``fp8_breakdown.py``'s)."""
    return {
        "benchmark": name,
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"backend": backend},
    }


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``report`` as JSON at ``out``, atomically (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())

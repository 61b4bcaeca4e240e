"""Does fp8 with fused quantisation beat bf16 on a norm -> linear, fwd + bwd, per GEMM shape?

One command on the H200 (``python3 benchmarks/precision.py --gemms --out fp8_gemms.json``
runs this; so does ``python3 benchmarks/fp8_gemms.py --out fp8_gemms.json``)::

    python3 benchmarks/precision.py --gemms --out fp8_gemms.json
    python3 benchmarks/precision.py --gemms --smoke --out /tmp/fp8_gemms.json   # CPU

Per shape (M tokens in {8192, 16384}, K and N in {2048, 4096}), the unit a transformer or
MLP block repeats -- ``y = Linear(LayerNorm(x))``, x bf16 ``[M, K]``, bf16 weights -- timed
forward + backward (gradients of x, the norm's weight and bias, and W), CUDA events, the
median of ``--iters`` after ``--warmup``:

* ``bf16``: ``F.layer_norm`` then ``F.linear`` in bf16 (cuBLAS), the baseline;
* ``fp8 eager quant``: the same norm, then the previous fp8 linear
  (:func:`gemc.backends.torch.fp8.fp8_linear` with ``one_pass=False``): amax, scale and
  cast as separate eager kernels around ``torch._scaled_mm`` -- what made forced fp8 2.8x
  slower;
* ``fp8 one-pass quant``: the same norm, then ``gemc::fp8_linear``: x quantised by one
  row-wise Triton kernel (a producer gemc does not generate); the module-mode runner's
  ``Fp8Linear`` runs these kernels too now (row-wise, on CUDA);
* ``fp8 fused``: ``gemc::norm_fp8_linear``, the norm writing fp8 and its row scales;
* ``fp8 fused, wgrad bf16``: the same with the weight-gradient GEMM in bf16.

Every fp8 variant runs the three GEMMs of torchao's rowwise recipe (fp8 e4m3 with per-row
power-of-two scales along the contraction) unless its name says otherwise. Reports ms, the
speedup over bf16 and the SQNR (dB) of y and dW against an fp32 computation, per shape.
``--smoke``: one tiny shape on the CPU (emulated fp8, torch-op quantisation): checks the
code, not the speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = [(m, k, n) for m in (8192, 16384) for k in (2048, 4096) for n in (2048, 4096)]
EPS = 1e-5


def _variants() -> dict[str, Callable[..., torch.Tensor]]:
    from gemc.backends.torch import fp8, fp8_ops

    from gemc.fp8_recipe import FP8_ROW, Fp8Recipe

    row = Fp8Recipe.uniform(FP8_ROW)

    def bf16(x, lw, lb, w):
        return F.linear(F.layer_norm(x, (x.shape[1],), lw, lb, EPS), w)

    def eager(x, lw, lb, w):
        return fp8.fp8_linear(F.layer_norm(x, (x.shape[1],), lw, lb, EPS), w, None, row,
                              one_pass=False)

    def one_pass(x, lw, lb, w):
        return fp8_ops.linear(F.layer_norm(x, (x.shape[1],), lw, lb, EPS), w, None)

    def fused(x, lw, lb, w):
        return fp8_ops.norm_linear(x, lw, lb, EPS, w, None)

    def fused_wgrad_bf16(x, lw, lb, w):
        return fp8_ops.norm_linear(x, lw, lb, EPS, w, None, wgrad_fp8=False)

    return {"bf16": bf16, "fp8 eager quant": eager, "fp8 one-pass quant": one_pass,
            "fp8 fused": fused, "fp8 fused, wgrad bf16": fused_wgrad_bf16}


def _inputs(m: int, k: int, n: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(m, k, generator=g, device=device).mul(2).add(0.5).to(bf)
    lw = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(bf)
    lb = (0.1 * torch.randn(k, generator=g, device=device)).to(bf)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(bf)
    return [t.requires_grad_() for t in (x, lw, lb, w)]


def _step(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor
          ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    y = fn(*leaves)
    return y, torch.autograd.grad(y, leaves, dy)


def _time(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor,
          warmup: int, iters: int, device: torch.device) -> float:
    for _ in range(warmup):
        _step(fn, leaves, dy)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, leaves, dy)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            _step(fn, leaves, dy)
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _truth(leaves: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y and dW in fp32 from the same (bf16) values."""
    x, lw, lb, w = (t.detach().float().requires_grad_() for t in leaves)
    y = F.linear(F.layer_norm(x, (x.shape[1],), lw, lb, EPS), w)
    (dw,) = torch.autograd.grad(y, (w,), dy.float())
    return y.detach(), dw


def run_shape(m: int, k: int, n: int, device: torch.device, args: argparse.Namespace
              ) -> dict[str, Any]:
    from gemc.probe_types import sqnr_db

    leaves = _inputs(m, k, n, device, args.seed)
    dy = torch.randn(m, n, device=device, generator=torch.Generator(device=device)
                     .manual_seed(args.seed + 1)).to(torch.bfloat16)
    y32, dw32 = _truth(leaves, dy)
    out: dict[str, Any] = {"m": m, "k": k, "n": n, "variants": {}}
    for name, fn in _variants().items():
        y, grads = _step(fn, leaves, dy)
        rec = {"sqnr_y_db": round(sqnr_db(y32, y.detach().float()), 1),
               "sqnr_dw_db": round(sqnr_db(dw32, grads[-1].float()), 1),
               "ms": round(_time(fn, leaves, dy, args.warmup, args.iters, device), 4)}
        out["variants"][name] = rec
        del y, grads
    base = out["variants"]["bf16"]["ms"]
    for rec in out["variants"].values():
        rec["speedup_vs_bf16"] = round(base / rec["ms"], 3)
    flops = 3 * 2 * m * n * k
    out["bf16_tflops"] = round(flops / (base * 1e-3) / 1e12, 1)
    return out


SHORT = {"bf16": "bf16", "fp8 eager quant": "eager-q", "fp8 one-pass quant": "1-pass-q",
         "fp8 fused": "fused", "fp8 fused, wgrad bf16": "fused gw-bf16"}


def _table(rows: list[dict[str, Any]]) -> str:
    from gemc.table_format import render_table

    names = list(rows[0]["variants"])
    body = []
    for r in rows:
        v = r["variants"]
        body.append([r["m"], r["k"], r["n"], *(v[x]["ms"] for x in names),
                     *(f"{v[x]['speedup_vs_bf16']:.2f}x" for x in names[1:]),
                     v["fp8 fused"]["sqnr_y_db"], v["fp8 fused"]["sqnr_dw_db"]])
    return render_table(
        ["M", "K", "N", *(f"{SHORT[x]} ms" for x in names), *(f"{SHORT[x]} x" for x in names[1:]),
         "fused y dB", "fused dW dB"],
        body, title="LayerNorm -> Linear, fwd + bwd: median ms, speedup (x) over bf16; SQNR of "
                    "the fused path vs fp32")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shapes", default="", help="M,K,N;M,K,N... (default: the 8 of the doc)")
    p.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    if args.smoke:
        shapes, args.warmup, args.iters = [(64, 32, 48)], 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: timings are of the CPU emulation (use --smoke to say so)",
              file=sys.stderr)
    t0 = time.perf_counter()
    rows = []
    for m, k, n in shapes:
        rows.append(run_shape(m, k, n, device, args))
        print(f"M={m} K={k} N={n}: " + ", ".join(
            f"{name} {v['ms']} ms" for name, v in rows[-1]["variants"].items()), file=sys.stderr)
    print(_table(rows))
    report = {
        "benchmark": "fp8_gemms",
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "total_s": round(time.perf_counter() - t0, 1),
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

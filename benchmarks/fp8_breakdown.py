"""Where the compiled row-wise fp8 linear's time goes, piece by piece (issue 21).

On the H200 (torch 2.11) the compiled LayerNorm -> Linear ran 0.82-0.85x bf16 in row-wise
fp8 (BENCHMARKS.md, "fp8 compiled on torch 2.11"), though an fp8 GEMM should run
~1.6-1.9x a bf16 one at these shapes: the work around the GEMMs costs more than they save.
This times every piece separately, for M (tokens) in {8192, 32768}, K = N = 4096::

    source scripts/device_env.sh && python3 benchmarks/fp8_breakdown.py --out fp8_breakdown.json
    TRITON_INTERPRET=1 python3 benchmarks/fp8_breakdown.py --smoke --out /tmp/b.json   # CPU

Pieces (each the median of ``--iters`` CUDA-event timings after ``--warmup``):

* ``gemm``: the three GEMMs of a linear's step in bf16 (``mm``) and in row-wise fp8
  (``torch._scaled_mm`` on operands quantised beforehand, in the layouts it takes:
  fwd ``x @ W^T``, dgrad ``dy @ W``, wgrad ``dy^T @ x``), with TFLOP/s.
* ``quant``: each operand's quantisation as gemc's linear does it today (the ATen ops of
  :func:`gemc.backends.torch.fp8.quantize`, eager, step by step: amax, the power-of-two
  scale, the scaled cast, the layout copy where the operand is not in ``_scaled_mm``'s
  layout), the same ops compiled alone by Inductor (``compiled``: no producer to fuse into),
  and gemc's Triton kernels (:mod:`gemc.backends.triton.fp8_quant`; ``hw``: the hardware
  cast, ``soft``: rounded in fp32 first, as the CPU tests run it), with GB/s and whether
  their fp8 bits and scales equal the ATen path's. The activation ``x`` is timed in fp32
  (what the compiled unit's LayerNorm hands the linear under bf16 autocast) and bf16.
* ``unit``: the whole compiled LayerNorm -> Linear forward + backward
  (``precision_gemms._Unit``): bf16, and row-wise fp8 with each quantizer
  (:data:`gemc.backends.torch.fp8.QUANTIZERS`; ``summary.quantizer_choice`` is the faster),
  and with the wgrad left in bf16 (torchao's ``ROWWISE_WITH_GW_HP``: no operand quantised
  along the tokens), ATen quantizer.

A piece that fails is recorded with its error and the rest still runs. ``--smoke``: one
tiny shape on the CPU (fp8 GEMMs emulated, Inductor replaced by AOTAutograd, the Triton
kernels interpreted: needs ``TRITON_INTERPRET=1`` set before Python starts, else they are
skipped with a note); it checks the code, not the speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import precision_gemms  # noqa: E402  (a sibling script: the unit, the timer)

TOKENS = (8192, 32768)
FEATURES = 4096
SMOKE = ((64, 96), 64)


def _operands(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
              ) -> dict[str, tuple[torch.Tensor, int, bool]]:
    """Every operand a row-wise linear step quantises: (tensor as the GEMM sees it, the dim
    its scales run along, whether it is the right-hand operand ``b``)."""
    xf = x.float()
    return {
        "fwd.x (fp32)": (xf, 1, False), "fwd.x (bf16)": (x, 1, False),
        "fwd.W (fp32)": (w.t(), 0, True),
        "dgrad.dy (bf16)": (dy, 1, False), "dgrad.W (fp32)": (w, 0, True),
        "wgrad.dy (bf16)": (dy.t(), 1, False),
        "wgrad.x (fp32)": (xf, 0, True), "wgrad.x (bf16)": (x, 0, True),
    }


def _relayout(q: torch.Tensor, right: bool) -> torch.Tensor:
    """The layout copy gemc's ATen path makes (``fp8._quantized_operands``), or q itself."""
    from gemc.backends.torch import fp8

    if right:
        return q if fp8._is_col_major(q) else q.t().contiguous().t()
    return q if fp8._is_row_major(q) else q.contiguous()


def _aten_quant(t: torch.Tensor, dim: int, right: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from gemc.backends.torch import fp8

    q, s = fp8.quantize(t, fp8.ROWWISE, dim=dim)
    return _relayout(q, right), s


def _row_kernel(t: torch.Tensor, dim: int) -> bool:
    """Whether gemc's row kernel quantises ``t`` along ``dim`` (else the column kernel, on
    an operand whose scaled slices are strided): the choice ``fp8._kernel_operands`` makes."""
    src = t if dim == 1 else t.t()  # quantised along its dim 1
    return src.stride(1) == 1 or src.stride(0) != 1


def _kernel_quant(t: torch.Tensor, dim: int, right: bool, soft: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """gemc's kernels, laid out and shaped as ``_aten_quant``'s result (no padding: the
    shapes here are multiples of 16)."""
    from gemc.backends.triton.fp8_quant import quantize_cols, quantize_rows

    src = t if dim == 1 else t.t()
    if _row_kernel(t, dim):
        q, s = quantize_rows(src, soft_round=soft)
    else:
        q, s = quantize_cols(src.t(), soft_round=soft)
    return (q.t(), s.t()) if dim == 0 else (q, s)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _piece(results: dict[str, Any], name: str, fn: Callable[[], Any], time_it: Callable,
           nbytes: int | None = None, flops: int | None = None) -> None:
    try:
        ms = time_it(fn)
    except Exception as e:  # noqa: BLE001  (one failing piece must not lose the others)
        results[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"  {name:44s} FAILED {results[name]['error'][:120]}", file=sys.stderr)
        return
    row: dict[str, Any] = {"ms": round(ms, 4)}
    if nbytes:
        row["gb_per_s"] = round(nbytes / ms / 1e6, 1)
    if flops:
        row["tflop_per_s"] = round(flops / ms / 1e9, 1)
    results[name] = row
    extra = "".join(f"  {k} {v}" for k, v in row.items() if k != "ms")
    print(f"  {name:44s} {ms:9.4f} ms{extra}", file=sys.stderr)


def _gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, native: bool,
           time_it: Callable) -> dict[str, Any]:
    from gemc.backends.torch import fp8

    m, k = x.shape
    n = w.shape[0]
    flops = 2 * m * k * n
    wb = w.to(torch.bfloat16)
    out: dict[str, Any] = {}
    for name, fn in (("bf16 fwd x@W^T", lambda: x @ wb.t()), ("bf16 dgrad dy@W", lambda: dy @ wb),
                     ("bf16 wgrad dy^T@x", lambda: dy.t() @ x)):
        _piece(out, name, fn, time_it, flops=flops)
    for gemm, (a, b) in (("fwd", (x, w.t())), ("dgrad", (dy, w)), ("wgrad", (dy.t(), x))):
        qa, qb, sa, sb = fp8._quantized_operands(a, b, fp8.ROWWISE)
        _piece(out, f"fp8 {gemm} _scaled_mm", lambda qa=qa, qb=qb, sa=sa, sb=sb:
               fp8.scaled_mm(qa, qb, sa, sb, emulate=not native), time_it, flops=flops)
    return out


def _quant(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, backend: str, kernels: bool,
           time_it: Callable) -> dict[str, Any]:
    from gemc.backends.torch import fp8

    out: dict[str, Any] = {}
    for name, (t, dim, right) in _operands(x, w, dy).items():
        elt, numel = t.element_size(), t.numel()
        amax = fp8._amax(t, dim)
        scale, inv = fp8.pow2_scale(amax)
        q = (t * inv.to(t.dtype)).to(fp8.E4M3)
        _piece(out, f"{name} aten amax", lambda t=t, d=dim: fp8._amax(t, d), time_it,
               numel * elt)
        _piece(out, f"{name} aten scale", lambda a=amax: fp8.pow2_scale(a), time_it)
        _piece(out, f"{name} aten cast", lambda t=t, i=inv: (t * i.to(t.dtype)).to(fp8.E4M3),
               time_it, numel * (elt + 1))
        if _relayout(q, right) is not q:
            _piece(out, f"{name} aten layout copy", lambda q=q, r=right: _relayout(q, r),
                   time_it, 2 * numel)
        want_q, want_s = _aten_quant(t, dim, right)
        compiled = torch.compile(_aten_quant, backend=backend, dynamic=True)
        _piece(out, f"{name} compiled", lambda t=t, d=dim, r=right, c=compiled: c(t, d, r),
               time_it, numel * (elt + 1))
        if not kernels:
            continue
        passes = elt + 1 if _row_kernel(t, dim) else 2 * elt + 1  # bytes an element
        for soft in (False, True):
            label = f"{name} triton {'soft' if soft else 'hw'}"
            _piece(out, label, lambda t=t, d=dim, r=right, s=soft: _kernel_quant(t, d, r, s),
                   time_it, numel * passes)
            if "error" in out[label]:
                continue
            got_q, got_s = _kernel_quant(t, dim, right, soft)
            out[label]["bits_equal_aten"] = bool(
                torch.equal(got_s, want_s)
                and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)))
            out[label]["layout_ok"] = got_q.stride() == want_q.stride()
    return out


def _units(m: int, k: int, n: int, device: torch.device, backend: str, kernels: bool,
           time_it: Callable, seed: int, compiled: dict[str, Any]) -> dict[str, Any]:
    """The compiled units, built once per variant (``compiled``) with M dynamic."""
    from gemc.backends.torch import fp8

    from gemc.fp8_recipe import BF16, FP8_ROW, Fp8Recipe

    torch.manual_seed(seed)
    x = torch.randn(m, k, device=device).mul_(2).add_(0.5).to(torch.bfloat16).requires_grad_()
    torch._dynamo.maybe_mark_dynamic(x, 0)
    dy = torch.randn(m, n, device=device) / math.sqrt(n)
    out: dict[str, Any] = {}
    # torchao's ROWWISE_WITH_GW_HP: the wgrad in high precision, so neither of its operands
    # is quantised along the tokens (the two column-wise quantisations)
    gw_bf16 = Fp8Recipe(FP8_ROW, FP8_ROW, BF16)
    variants = [("bf16", False, fp8.ATEN_QUANT, None), ("fp8 aten", True, fp8.ATEN_QUANT, None),
                ("fp8 aten wgrad-bf16", True, fp8.ATEN_QUANT, gw_bf16)]
    if kernels:
        variants.append(("fp8 triton", True, fp8.TRITON_QUANT, None))
    for name, rowwise, quantizer, recipe in variants:
        if name not in compiled:
            torch.manual_seed(seed + 1)  # the same weights for every variant
            unit = precision_gemms._Unit(k, n, rowwise, device.type != "cuda", quantizer,
                                         recipe)
            unit = unit.to(device)
            compiled[name] = unit, torch.compile(unit, backend=backend)
        unit, fn = compiled[name]
        label = f"unit {name} fwd+bwd"
        t0 = time.perf_counter()
        try:
            precision_gemms._grads(unit, x, dy, fn, True)
        except Exception as e:  # noqa: BLE001
            out[label] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"  {label:44s} FAILED {out[label]['error'][:120]}", file=sys.stderr)
            continue
        first = round(time.perf_counter() - t0, 2)
        _piece(out, label, lambda u=unit, f=fn: precision_gemms._grads(u, x, dy, f, True),
               time_it)
        if "ms" in out[label]:
            out[label]["first_call_s"] = first
    return out


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    """Totals per step: the three GEMMs, each quantiser's six operands (x in fp32, as the
    compiled unit hands it over), and the units; None where a piece failed."""
    pieces = {**row["gemm"], **row["quant"], **row["unit"]}

    def total(names: list[str]) -> float | None:
        ms = [pieces.get(nm, {}).get("ms") for nm in names]
        return None if None in ms else round(sum(ms), 4)

    ops = ["fwd.x (fp32)", "fwd.W (fp32)", "dgrad.dy (bf16)", "dgrad.W (fp32)",
           "wgrad.dy (bf16)", "wgrad.x (fp32)"]
    eager = [f"{o} aten {s}" for o in ops for s in ("amax", "scale", "cast", "layout copy")
             if f"{o} aten {s}" in pieces]
    s: dict[str, Any] = {
        "bf16_gemms_ms": total([f"bf16 {g}" for g in ("fwd x@W^T", "dgrad dy@W",
                                                      "wgrad dy^T@x")]),
        "fp8_gemms_ms": total([f"fp8 {g} _scaled_mm" for g in ("fwd", "dgrad", "wgrad")]),
        "quant_aten_eager_ms": total(eager),
        "quant_aten_compiled_ms": total([f"{o} compiled" for o in ops]),
        "quant_triton_hw_ms": total([f"{o} triton hw" for o in ops]),
    }
    if s["bf16_gemms_ms"] and s["fp8_gemms_ms"]:
        s["fp8_gemm_speedup"] = round(s["bf16_gemms_ms"] / s["fp8_gemms_ms"], 3)
    units = {nm: pieces.get(f"unit {nm} fwd+bwd", {}).get("ms")
             for nm in ("bf16", "fp8 aten", "fp8 triton", "fp8 aten wgrad-bf16")}
    s["unit_ms"] = units
    quantizers = {nm: units[f"fp8 {nm}"] for nm in ("aten", "triton") if units[f"fp8 {nm}"]}
    if quantizers:  # the same recipe (all three GEMMs fp8), each quantizer
        s["quantizer_choice"] = min(quantizers, key=quantizers.__getitem__)
    fp8_units = {nm: v for nm, v in units.items() if nm != "bf16" and v}
    if fp8_units and units["bf16"]:
        best = min(fp8_units, key=fp8_units.__getitem__)
        s["best_fp8_unit"] = best
        s["best_fp8_vs_bf16"] = round(units["bf16"] / fp8_units[best], 3)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="M values")
    p.add_argument("--features", type=int, default=FEATURES, help="K = N")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-units", action="store_true", help="no compiled LayerNorm -> Linear")
    p.add_argument("--smoke", action="store_true", help="one tiny shape on the CPU")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    notes = []
    if args.smoke or not torch.cuda.is_available():
        if not args.smoke:
            notes.append("no GPU: ran --smoke")
        device, backend = torch.device("cpu"), "aot_eager"
        tokens, feats = SMOKE
        args.warmup, args.iters = 1, 2
        notes.append("CPU: fp8 GEMMs emulated (dequantise + fp32 matmul), times meaningless")
    else:
        device, backend = torch.device("cuda"), "inductor"
        tokens, feats = tuple(int(v) for v in args.tokens.split(",")), args.features
    from gemc.backends.torch import fp8

    native = fp8.hardware_fp8(device)
    kernels = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if not kernels:
        notes.append("Triton kernels skipped: set TRITON_INTERPRET=1 before Python starts to "
                     "run them on the CPU")
    elif device.type == "cpu":
        notes.append("interpreted: 'triton hw' is the interpreter's own fp8 cast (ties away "
                     "from zero, subnormals flushed), so only 'triton soft' matches ATen's bits")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    def time_it(fn: Callable[[], Any]) -> float:
        return precision_gemms._time(fn, device, args.warmup, args.iters)

    # one compiled quantisation per operand kind and dtype (M dynamic): more than Dynamo's
    # default 8 entries for the one function
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    report = precision_gemms.report_header("fp8_breakdown", args, device, backend) | {
        "notes": notes, "native_fp8": native, "results": []}
    units: dict[str, Any] = {}
    for m in tokens:
        k = n = feats
        print(f"M={m} K={k} N={n}", file=sys.stderr)
        torch.manual_seed(args.seed)
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        w = torch.randn(n, k, device=device) / math.sqrt(k)
        dy = (torch.randn(m, n, device=device) / math.sqrt(n)).to(torch.bfloat16)
        row: dict[str, Any] = {"m": m, "k": k, "n": n}
        with torch.no_grad():
            row["gemm"] = _gemms(x, w, dy, native, time_it)
            row["quant"] = _quant(x, w, dy, backend, kernels, time_it)
        row["unit"] = {} if args.skip_units else _units(m, k, n, device, backend, kernels,
                                                        time_it, args.seed, units)
        row["summary"] = _summary(row)
        print(f"M={m}: {json.dumps(row['summary'])}")
        report["results"].append(row)
        report["total_s"] = round(time.perf_counter() - t_start, 1)
        # after every shape: a timeout keeps what ran
        precision_gemms.write_report(Path(args.out), report)
    print(f"wrote {args.out} in {report['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

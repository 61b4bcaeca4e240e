"""Fused groups (generated Triton) against eager PyTorch and torch.compile on the same subgraph.

    python benchmarks/fusion.py [--cases gemm_gelu,gemm_residual,norm,pointwise,reduction]
                                [--no-compile] [--out results.json]
    python benchmarks/fusion.py --smoke --no-compile          # CPU, TRITON_INTERPRET=1, tiny

Each case is a small function the ``fuse`` pass turns into exactly one group, at the sizes
of the GEM ``h200`` preset (bf16; B=4096 sequences of L=256 at 50% mean fill -> M = 4096 *
256 / 2 = 524288 tokens, d_model 256, MLP ratio 2):

* ``gemm_gelu``   ``gelu(x @ w.T + b)`` for (K, N) in (256, 512), (512, 256), (1024, 1024):
  the MLP up-projection; the backward's dgrad/wgrad GEMMs read the GELU derivative from
  their input tiles (Inductor runs a separate GELU-backward kernel around cuBLAS).
* ``gemm_residual``  ``r + x @ w.T + b`` (out-projection + residual), K = N = 256.
* ``norm``        ``h = x + r; y = layer_norm(h) * m`` (residual add, LayerNorm, mask).
* ``pointwise``   ``silu(a * b + c) * d`` with a per-column ``b``.
* ``reduction``   ``(x * m).sum(1)``: the masked pooling over the sequence, [4096, 256, 256].

Each case is timed as forward and as forward+backward (``torch.autograd.grad`` of all
inputs), for eager (the baseline), ``torch.compile`` of the same function, and gemc's
kernel (``GraphRunner``'s path: the generated source through ``codegen.host``). On CUDA,
``triton.testing.do_bench`` (median); on CPU (``--smoke``) one wall-clock run, only to check
nothing crashes. Every case also reports gemc's max abs error against eager at its size and
the cost model's predicted fwd+bwd ms before/after fusion. Target: each fused group at least
as fast as torch.compile on the same subgraph (fwd+bwd). Prints a table; ``--out`` writes
JSON (environment, rows, targets).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

M_H200 = 4096 * 256 // 2


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    shapes: list[tuple[int, ...]]
    flops: float = 0.0  # forward FLOPs (GEMMs), for TFLOP/s


def _gemm_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def _gemm_residual(x, w, b, r):
    return r + F.linear(x, w, b)


def _norm(x, r, w, b, m):
    h = x + r
    return h, F.layer_norm(h, (h.shape[-1],), w, b) * m


def _pointwise(a, b, c, d):
    return F.silu(a * b + c) * d


def _reduction(x, m):
    return (x * m).sum(1)


def cases(smoke: bool) -> dict[str, list[Case]]:
    m = 37 if smoke else M_H200
    d = 24 if smoke else 256
    seq = (3, 5, d) if smoke else (4096, 256, d)
    dims = [(20, 40)] if smoke else [(256, 512), (512, 256), (1024, 1024)]
    return {
        "gemm_gelu": [Case(f"gemm+bias+gelu K={k} N={n}", _gemm_gelu, [(m, k), (n, k), (n,)],
                           2.0 * m * n * k) for k, n in dims],
        "gemm_residual": [Case(f"gemm+bias+residual K=N={d}", _gemm_residual,
                               [(m, d), (d, d), (d,), (m, d)], 2.0 * m * d * d)],
        "norm": [Case(f"residual+layernorm+mask N={d}", _norm,
                      [(m, d), (m, d), (d,), (d,), (m, 1)])],
        "pointwise": [Case(f"silu(a*b+c)*d N={d}", _pointwise, [(m, d), (d,), (m, d), (m, d)])],
        "reduction": [Case(f"masked sum over L {list(seq)}", _reduction,
                           [seq, (seq[0], seq[1], 1)])],
    }


# ---------------------------------------------------------------------------------------


class _Fn(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.fn(*xs)


def gemc_kernel(case: Case, dtype: torch.dtype) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The case's one fused group, compiled by gemc's passes (captured on meta)."""
    from gemc.backends.triton.codegen.host import make_runner
    from gemc.cost_model.calibration import default_calibration
    from gemc.cost_model.topology import parse_topology
    from gemc.passes.classify_ops import ClassifyOps
    from gemc.passes.count_flops_bytes import CountFlopsBytes
    from gemc.passes.fuse import Fuse
    from gemc.passes.predict_time import PredictTime

    from gemc.context import PassContext
    from gemc.plan_builder import kernel_entries

    with torch.device("meta"):
        example = tuple(torch.empty(s, dtype=dtype) for s in case.shapes)
    gm = torch.export.export(_Fn(case.fn), example, strict=False).graph_module
    topo = parse_topology("h200:1x1")
    ctx = PassContext(topology=topo, calibration=default_calibration(topo.gpu.name))
    for p in (ClassifyOps(), CountFlopsBytes(), PredictTime(), Fuse()):
        gm, _ = p.run(gm, ctx)
    entries = kernel_entries(gm, ctx)
    if len(entries) != 1:
        raise RuntimeError(f"{case.name}: expected one fused group, got {len(entries)}")
    entry = entries[0]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    run = make_runner(entry["code"], entry["binding"])
    order = [placeholders.index(n) for n in entry["binding"]["inputs"]]

    def call(*xs: torch.Tensor) -> Any:
        outs = run(*(xs[i] for i in order))
        return outs if len(outs) > 1 else outs[0]

    call.impl = run.impl  # type: ignore[attr-defined]
    return call, entry


def bench_ms(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm up; the CPU run only checks that nothing crashes
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def host_and_kernels(fn: Callable[[], Any], calls: int = 10) -> dict[str, Any]:
    """Where one CUDA call's time goes: the host's time to issue it (not waiting for the
    GPU; ``calls`` back to back stay well inside the launch queue) and the GPU's kernel
    time (profiler). A do_bench median near ``host_ms`` and far above ``kernel_ms`` means
    the call is bound by the host, not by its kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_ms = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    per_name: dict[str, float] = {}
    for e in gpu:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.device_time_total / calls
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:4]
    return {"host_ms": host_ms, "kernel_ms": sum(per_name.values()) / 1e3,
            "kernels": len(gpu) / calls,
            "top_kernels": "; ".join(f"{name[:40]} {us:.0f}" for name, us in top)}


def host_profile(fn: Callable[[], Any], calls: int, top: int = 15) -> str:
    """The host's time per call by function (cProfile, ``calls`` calls, own time first):
    which Python (ours, autograd's, Triton's launcher) a host-bound call spends."""
    import cProfile
    import io
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return f"{calls} calls\n" + text.getvalue().split("\n", 3)[-1]


@dataclasses.dataclass
class Row:
    case: str
    mode: str
    variant: str
    ms: float | None = None
    baseline: bool = False
    speedup: float | None = None  # eager ms / this ms
    vs_compile: float | None = None  # torch.compile ms / this ms
    tflops: float | None = None
    max_abs_err: float | None = None
    predicted_before_ms: float | None = None
    predicted_after_ms: float | None = None
    path: str | None = None  # a GEMM group's path per direction (host.GemmPath choice)
    host_ms: float | None = None  # host time of one call, GPU not waited for (CUDA only)
    kernel_ms: float | None = None  # GPU kernel time of one call (profiler; CUDA only)
    kernels: float | None = None  # kernels (and memsets/copies) launched per call
    top_kernels: str | None = None  # the longest kernels of one call, us each
    host_profile: str | None = None  # --profile-host: gemc's host time by function
    error: str | None = None


def _outputs(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def run_case(case: Case, device: torch.device, dtype: torch.dtype, compile_: bool,
             gen: torch.Generator, profile_host: int = 0) -> list[Row]:
    rows: list[Row] = []
    inputs = [torch.randn(s, generator=gen).to(device, dtype).requires_grad_()
              for s in case.shapes]
    variants: list[tuple[str, Callable[..., Any] | None, dict[str, Any]]] = [
        ("eager", case.fn, {})]
    if compile_:
        variants.append(("torch.compile", torch.compile(case.fn), {}))
    try:
        kernel, entry = gemc_kernel(case, dtype)
        variants.append(("gemc fused", kernel, entry))
    except Exception as exc:  # noqa: BLE001 - a failed variant is a result, not a crash
        rows.append(Row(case.name, "fwd+bwd", "gemc fused", error=f"{type(exc).__name__}: {exc}"))
    with torch.no_grad():
        expected = [o.float() for o in _outputs(case.fn(*inputs))]
    grads = [torch.randn(o.shape, generator=gen).to(device, dtype) for o in expected]
    for variant, fn, entry in variants:
        if fn is None:
            continue

        def fwd(fn: Callable[..., Any] = fn) -> Any:
            return fn(*inputs)

        def fwd_bwd(fn: Callable[..., Any] = fn) -> Any:
            return torch.autograd.grad(_outputs(fn(*inputs)), inputs, grads, allow_unused=True)

        err = None
        for mode, body in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            row = Row(case.name, mode, variant, baseline=variant == "eager")
            try:
                if err is None and variant != "eager":
                    got = [o.float() for o in _outputs(fwd())]
                    err = max(float((g - e).abs().max()) for g, e in zip(got, expected))
                row.ms = bench_ms(body, device)
                row.max_abs_err = err
                if case.flops:
                    row.tflops = case.flops * (3 if mode == "fwd+bwd" else 1) / row.ms / 1e9
                if entry and mode == "fwd+bwd":
                    row.predicted_before_ms = entry["predicted"]["before_ms"]
                    row.predicted_after_ms = entry["predicted"]["after_ms"]
                if device.type == "cuda" and mode == "fwd+bwd":
                    for key, value in host_and_kernels(body).items():
                        setattr(row, key, value)
                if profile_host and mode == "fwd+bwd" and variant == "gemc fused":
                    row.host_profile = host_profile(body, profile_host)
                chosen = getattr(getattr(fn, "impl", None), "chosen", None)
                if chosen:
                    row.path = " ".join(sorted({f"{k[0]}:{v}" for k, v in chosen.items()}))
            except Exception as exc:  # noqa: BLE001
                row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.synchronize()
    for row in rows:
        base = next((r for r in rows if r.mode == row.mode and r.variant == "eager" and r.ms),
                    None)
        comp = next((r for r in rows if r.mode == row.mode and r.variant == "torch.compile"
                     and r.ms), None)
        if row.ms:
            row.speedup = base.ms / row.ms if base else None
            row.vs_compile = comp.ms / row.ms if comp else None
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row]) -> None:
    head = (f"{'case':34} {'mode':8} {'variant':14} {'ms':>9} {'x eager':>8} {'x compile':>9} "
            f"{'TFLOP/s':>8} {'max err':>9} {'pred before/after ms':>21} gemm path")
    print(head)
    print("-" * len(head))
    for r in rows:
        pred = ("" if r.predicted_before_ms is None else
                f"{r.predicted_before_ms:.3f}/{r.predicted_after_ms:.3f}")
        print(f"{r.case[:34]:34} {r.mode:8} {r.variant:14} {_fmt(r.ms, '9.3f')} "
              f"{_fmt(r.speedup, '8.2f')} {_fmt(r.vs_compile, '9.2f')} {_fmt(r.tflops, '8.1f')} "
              f"{_fmt(r.max_abs_err, '9.2e')} {pred:>21} {r.path or ''}")
    split = [r for r in rows if r.host_ms is not None]
    if split:
        print("\nfwd+bwd, where one call's time goes (host: issuing it without waiting for the "
              "GPU; kernels: GPU kernel time):")
        for r in split:
            print(f"  {r.case[:34]:34} {r.variant:14} do_bench {_fmt(r.ms, '7.3f')}  host "
                  f"{r.host_ms:7.3f}  kernels {r.kernel_ms:7.3f} ({r.kernels:4.1f})  "
                  f"{r.top_kernels}")
    for r in rows:
        if r.host_profile:
            print(f"\nhost profile, {r.case} / {r.variant} fwd+bwd: {r.host_profile}")
    for r in rows:
        if r.error:
            print(f"  ! {r.case} / {r.mode} / {r.variant}: {r.error}")


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """Each fused group (fwd+bwd) at least as fast as torch.compile on the same subgraph."""
    out = []
    for r in rows:
        if r.variant == "gemc fused" and r.mode == "fwd+bwd":
            out.append({"target": f"{r.case}: fused fwd+bwd vs torch.compile",
                        "required_speedup": 1.0, "measured_speedup": r.vs_compile,
                        "met": r.vs_compile is not None and r.vs_compile >= 1.0})
    return out


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "device": str(device),
           "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def device_and_dtype(ap: argparse.ArgumentParser, smoke: bool
                     ) -> tuple[torch.device, torch.dtype]:
    """CUDA in bf16, or (``--smoke`` only) the CPU in fp32 under ``TRITON_INTERPRET=1``, set
    before any kernel is imported."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not smoke:
            ap.error("no CUDA device: only --smoke runs here (under TRITON_INTERPRET=1)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.float32 if smoke else torch.bfloat16


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, fp32 (CPU interpreter)")
    ap.add_argument("--cases", default="gemm_gelu,gemm_residual,norm,pointwise,reduction")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--profile-host", type=int, default=0, metavar="CALLS",
                    help="cProfile gemc's fwd+bwd over CALLS calls and print where the host "
                         "time goes (0: off)")
    args = ap.parse_args(argv)
    device, dtype = device_and_dtype(ap, args.smoke)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    table = cases(args.smoke)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(wanted) - set(table)
    if unknown:
        ap.error(f"unknown cases: {sorted(unknown)}; known: {sorted(table)}")
    rows: list[Row] = []
    for name in wanted:
        for case in table[name]:
            print(f"... {case.name}", file=sys.stderr, flush=True)
            rows += run_case(case, device, dtype, not args.no_compile, gen, args.profile_host)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows)
    report = {"environment": environment(device), "smoke": args.smoke, "dtype": str(dtype),
              "m_tokens": 37 if args.smoke else M_H200, "compile": not args.no_compile,
              "seed": seed, "results": [dataclasses.asdict(r) for r in rows],
              "targets": targets(rows)}
    for t in report["targets"]:
        got = t["measured_speedup"]
        verdict = "NOT RUN" if got is None else ("MET" if t["met"] else "NOT MET")
        print(f"target {verdict}: {t['target']} >= 1.0x (measured {_fmt(got, '.2f')}x)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""Where the zoo's attentions spend their fwd+bwd time on a GPU: the kernels, or the host.

    python3 benchmarks/attention_gpu_time.py --out attention_gpu_time.json     # GPU, ~2 min
    python3 benchmarks/attention_gpu_time.py --smoke                           # CPU: runs

Why: ``benchmarks/kernels.py --cases zoo`` times each call with ``triton.testing.do_bench``,
whose CUDA events bracket one call: any time the GPU waits for the host between the call's
launches is counted. gemc's jagged attention launches from Python (an autograd Function, the
launch-config choice, two or three Triton kernels and their buffers) where padded cuDNN SDPA
is one C++ call, and the same gemc kernel has timed 0.67 ms on one machine and 1.0-1.18 ms on
another while cuDNN's time stayed put (BENCHMARKS.md, nineteenth session): a host-bound
measurement would look like that. So each variant (gemc's kernel and padded masked SDPA at
each zoo model's shape, :func:`kernels._zoo_attentions`, lengths uniform in 1..L) is timed
four ways, fwd+bwd:

- ``do_bench_ms``: as ``kernels.py`` times it (the issue's figure);
- ``graph_ms``: the same call replayed from a CUDA graph (no host in the loop: the GPU's
  time alone), where the call can be captured;
- ``kernels_ms``: the sum of the GPU kernels' (and memsets' / copies') durations per call,
  from a torch.profiler trace, with the five costliest kernels by name;
- ``host_ms``: the host's time to issue one call while the GPU is held busy (so nothing
  waits for the GPU): what the host alone costs.

``do_bench_ms`` well above both ``graph_ms`` and ``kernels_ms``, with ``host_ms`` near it,
says the call is host-bound; ``kernels_ms`` near ``do_bench_ms`` says the kernels are the
time.

TransAct (``--models transact``, issue 17) is timed as its compiled graph runs its attention:
in its packed region over padding representatives (``kernels.transact_region``: the
model's batch and mask, ``packed_tokens.rep_attention`` on the region's layout), three
ways: the eager call (what ``kernels.py`` times: its ops launched one by one from Python),
the same call under ``torch.compile`` (the form a training step runs: the graph executor
emits ``inductor_graph._p_rep_attention`` into the graph Inductor compiles, so the bias op
and the attention are nodes of a compiled graph, their movedims views), and
``gemc::rep_key_bias`` alone (forward); against padded masked SDPA at the model's shape. gemc's variants (:data:`GEMC_VARIANTS`) run with the default launch configs and
autotuned (``GEMC_AUTOTUNE=1``); HSTU's also with the fast sigmoid, with dq fused into the
dk/dv kernel, and with its relative bias ``[B, 1, L, L]`` (its gradient included), as the
model runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernels as kbench  # noqa: E402  (benchmarks/kernels.py: the zoo's shapes)

Call = Callable[[], Any]


def graph_ms(fn: Call, reps: int = 10) -> float | str:
    """Median ms of one call replayed from a CUDA graph of ``reps`` calls; the reason as a
    string where the call cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        del graph
        return statistics.median(times)
    except Exception as exc:  # noqa: BLE001 - not capturable is a finding, not a crash
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def host_ms(fn: Call, calls: int = 20) -> float:
    """The host's ms to issue one call while the GPU is busy with a sleep kernel (the calls
    queue behind it: no call waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU clock cycles, longer than the calls' issue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e3 / calls


def host_profile(fn: Call, calls: int = 50, top: int = 30) -> str:
    """Where the host's time to issue ``calls`` calls goes, by function (cProfile, own time
    first), the GPU held busy as in :func:`host_ms` so no call waits for it. Why: gemc's
    attention measured 1.0-1.4 ms of host a fwd+bwd on an H100 where cuDNN's took 0.35
    (session 25); which of its Python steps cost that is what a fix needs."""
    import cProfile
    import io
    import pstats

    fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(3e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write(launch_counts(stats, calls) + "\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def _launchers() -> dict[str, Any]:
    """The functions a gemc kernel launch passes through, by the name a report gives them:
    Triton's launch (compiled, or the interpreter's), its autotuner, and gemc's direct
    path past the autotuner on a decided config (``backends/triton/direct_launch.py``)."""
    from gemc.backends.triton.direct_launch import DirectAutotuner
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    out = {"triton launches (JITFunction.run)": JITFunction.run,
           "Autotuner.run": Autotuner.run, "direct (DirectAutotuner.run)": DirectAutotuner.run}
    try:
        from triton.runtime.interpreter import InterpretedFunction

        out["interpreted launches (InterpretedFunction.run)"] = InterpretedFunction.run
    except ImportError:
        pass
    return out


def launch_counts(stats: Any, calls: int) -> str:
    """One line: how many times per call each of :func:`_launchers` ran, from a cProfile
    ``pstats.Stats``. Why: the host's cost of a gemc call is mostly per launch (issue 17:
    two zero-fill launches and three ``Autotuner.run``s of a fwd+bwd's five launches), and
    the counts show it on the CPU as on the GPU."""
    where = {name: (fn.__code__.co_filename, fn.__code__.co_firstlineno, fn.__code__.co_name)
             for name, fn in _launchers().items()}
    counts = {name: sum(row[0] for key, row in stats.stats.items() if key == at) / calls
              for name, at in where.items()}
    return "launches a call: " + ", ".join(f"{name} {n:g}" for name, n in counts.items())


def kernels_ms(fn: Call, calls: int = 10) -> dict[str, Any]:
    """GPU activity per call from a profiler trace: kernels, memsets and copies summed, and
    the five costliest kernel names with their ms per call."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    by_name: dict[str, float] = {}
    total = 0.0
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in ev:
            total += ev["dur"]
            name = ev.get("name", "?")[:90]
            by_name[name] = by_name.get(name, 0.0) + ev["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {"kernels_ms": total / calls / 1e3,
            "top": [[name, us / calls / 1e3] for name, us in top]}


def measure(name: str, fn: Call, device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": name}
    try:
        row["do_bench_ms"] = kbench.bench_ms(fn, device)
        if device.type == "cuda":
            row["graph_ms"] = graph_ms(fn)
            row.update(kernels_ms(fn))
            row["host_ms"] = host_ms(fn)
    except Exception as exc:  # noqa: BLE001 - a failed variant is a result
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def _inputs(shape: dict[str, Any], dtype: torch.dtype, device: torch.device,
            gen: torch.Generator) -> dict[str, Any]:
    batch, L, H, D = shape["batch"], shape["max_len"], shape["heads"], shape["head_dim"]
    lengths = torch.randint(1, L + 1, (batch,), generator=gen)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)
    total = int(lengths.sum())
    q, k, v, g = (torch.randn(total, H, D, generator=gen).to(device, dtype) for _ in range(4))
    pos = torch.arange(L, device=device)
    visible = (pos[None, None, :] < lengths.to(device)[:, None, None]).expand(-1, L, -1)
    if shape["causal"]:
        visible = visible & (pos[:, None] >= pos[None, :])
    visible = visible[:, None]
    safe = visible | ~visible.any(-1, keepdim=True)
    from gemc.backends.triton import jagged_to_padded

    with torch.no_grad():
        padded = [jagged_to_padded(x, offsets, L).transpose(1, 2).contiguous()
                  for x in (q, k, v, g)]
    bias = (0.1 * torch.randn(batch, 1, L, L, generator=gen)).to(device, dtype)
    return {"offsets": offsets, "jagged": (q, k, v, g), "padded": padded, "safe": safe,
            "bias": bias, "L": L, "scale": 1.0 / math.sqrt(D), "tokens": total}


def _gemc_call(x: dict[str, Any], kind: str, causal: bool, with_bias: bool) -> Call:
    from gemc.backends.triton import jagged_attention

    q, k, v, g = (t.detach().clone() for t in x["jagged"])
    leaves = [t.requires_grad_() for t in (q, k, v)]
    bias = x["bias"].detach().clone().requires_grad_() if with_bias else None
    wrt = [*leaves, bias] if bias is not None else leaves

    def call() -> Any:
        out = jagged_attention(*leaves, x["offsets"], x["L"], scale=x["scale"], causal=causal,
                               kind=kind, bias=bias)
        return torch.autograd.grad(out, wrt, g)

    return call


def _sdpa_call(x: dict[str, Any], backend: Any) -> Call:
    from torch.nn.attention import sdpa_kernel

    qp, kp, vp, gp = x["padded"]
    leaves = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]

    def call() -> Any:
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=x["safe"], scale=x["scale"])
        return torch.autograd.grad(out, leaves, gp)

    return call


GEMC_VARIANTS = {
    # (with HSTU's relative bias, autotuned, fast sigmoid, dq fused into the dk/dv kernel)
    "silu": [(False, False, False, False), (False, True, False, False),
             (False, True, True, False), (False, True, False, True), (False, True, True, True),
             (True, False, False, False), (True, True, False, False), (True, True, True, False)],
    "softmax": [(False, False, False, False), (False, True, False, False)],
}
"""gemc's variants per score function: the defaults first, then the module's switches
(``jagged_attention.FAST_SIGMOID``, ``FUSED_SILU_BACKWARD``) that the silu kernels read."""


def _transact_rows(smoke: bool, dtype: torch.dtype, device: torch.device,
                   gen: torch.Generator) -> dict[str, Any]:
    """TransAct's attention in its packed region (module doc), timed four ways per row."""
    from gemc.backends.triton import packed_tokens as pt

    preset = "tiny" if smoke else "h200"
    batch = kbench.transact_batch(preset, gen, device)
    region = kbench.transact_region(batch, dtype, gen, device)
    b, s, h, head_dim = batch.shape
    shape = {"batch": b, "max_len": s, "heads": h, "head_dim": head_dim,
             "kind": "softmax", "causal": False}
    q, k, v, g = region.inputs
    leaves = (q, k, v)
    print(f"== transact {shape} tokens={region.layout.total} "
          f"kept keys={int(batch.kept.sum())}", flush=True)

    def eager() -> Any:
        return torch.autograd.grad(region.fwd(), leaves, g)

    compiled_fwd = torch.compile(region.fwd, dynamic=False)

    def compiled() -> Any:
        return torch.autograd.grad(compiled_fwd(), leaves, g)

    def bias_only() -> Any:
        return pt.rep_key_bias(region.mask, True, region.layout)

    rows = [measure("gemc region (eager call)", eager, device),
            measure("gemc region (torch.compile)", compiled, device),
            measure("gemc::rep_key_bias alone (fwd)", bias_only, device)]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        padded = [t.detach().clone() for t in _transact_padded(region, batch)]
        x = {"padded": padded, "safe": batch.mask[:, None, None, :].to(dtype),
             "scale": batch.scale}
        for label, backend in (("sdpa cudnn masked", SDPBackend.CUDNN_ATTENTION),
                               ("sdpa efficient masked", SDPBackend.EFFICIENT_ATTENTION)):
            rows.append(measure(label, _sdpa_call(x, backend), device))
    return {"shape": shape, "tokens": region.layout.total,
            "mean_kept_keys": float(batch.kept.float().mean()), "rows": rows}


def _profile_transact(path: Path, smoke: bool, dtype: torch.dtype, device: torch.device,
                      gen: torch.Generator) -> None:
    """``--profile-host`` for TransAct: the region attention's eager call (fwd+bwd) and
    padded cuDNN SDPA, as for the other models."""
    batch = kbench.transact_batch("tiny" if smoke else "h200", gen, device)
    region = kbench.transact_region(batch, dtype, gen, device)
    q, k, v, g = region.inputs
    calls = [("gemc region (eager call)",
              lambda: torch.autograd.grad(region.fwd(), (q, k, v), g))]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend

        x = {"padded": _transact_padded(region, batch),
             "safe": batch.mask[:, None, None, :].to(dtype), "scale": batch.scale}
        calls.append(("sdpa cudnn masked", _sdpa_call(x, SDPBackend.CUDNN_ATTENTION)))
    with path.open("a") as f:
        for label, fn in calls:
            ms = f"{host_ms(fn):.3f}" if device.type == "cuda" else "-"
            f.write(f"==== transact: {label}, host ms a call {ms}\n")
            f.write(host_profile(fn, 5 if smoke else 50))


FWD_BLOCKS = ((64, 32, 4, 2, 96), (64, 32, 4, 2, None))
"""(BLOCK_M, BLOCK_N, warps, stages, maxnreg) of the forward ``--transact-blocks`` times at
TransAct's region shape, the short-row pick first (capped at 96 registers a thread: 5
programs an SM where its 122 allow 4; thirty-second session, H100: 0.143 ms against 0.154;
a cap of 80, 32-row tiles and five other uncapped configs timed slower there or in the
thirty-first session)."""
ROW_BLOCKS = ((64, 1, 4, 1, None), (64, 0, 4, 1, None), (32, 1, 4, 1, None),
              (32, 1, 4, 1, 128))
"""(BLOCK, KEY_MAJOR, warps, stages, maxnreg) of the one-program-per-row softmax backward
``--transact-blocks`` times, its pick at TransAct's rows first (KEY_MAJOR: the tiles
transposed, keys by queries; thirty-fourth session, H100: 0.304 ms against query-major's
0.333; maxnreg: the registers a thread capped, so more programs fit an SM;
``softmax_row_backward``'s configs say why). Query-major configs that timed slower in the
thirty-second session (two stages, a cap of 96, 8 warps) are not timed again."""


def _force_config(name: str, params: dict[str, int], warps: int, stages: int,
                  maxnreg: int | None = None) -> None:
    """Make kernel ``name``'s heuristic pick ``params`` (added to its configs if absent) and
    forget its earlier picks: what a timing of one config needs."""
    import triton
    from gemc.backends.triton import config_choice as cc

    hook, tuner = cc._KERNELS[name]
    want = (params, warps, stages, maxnreg)
    if not any(cc._matches(c, want) for c in tuner.configs):
        tuner.configs.append(triton.Config(dict(params), num_warps=warps, num_stages=stages,
                                           maxnreg=maxnreg))
    hook.prefer = lambda args, want=want: [want]
    cc.forget("jagged_attention.")


def _transact_blocks(smoke: bool, dtype: torch.dtype, device: torch.device,
                     gen: torch.Generator) -> dict[str, Any]:
    """TransAct's region attention fwd+bwd (eager call) by CUDA graph replay and kernel sum
    at each forward config of :data:`FWD_BLOCKS` (the backward as it runs by default), then
    at each row-kernel config of :data:`ROW_BLOCKS` (the row kernel on, the forward's
    short-row pick), each checked against fp32 padded SDPA (forward). Off a GPU (the
    interpreter runs one config a kernel) each list's first entry runs, unforced."""
    import importlib

    from gemc.backends.triton import config_choice as cc
    from gemc.backends.triton import softmax_row_backward  # noqa: F401  (registers its hook)

    J = importlib.import_module("gemc.backends.triton.jagged_attention")  # the module

    batch = kbench.transact_batch("tiny" if smoke else "h200", gen, device)
    region = kbench.transact_region(batch, dtype, gen, device)
    q, k, v, g = region.inputs
    want = region.padded_reference()
    scale = max(1.0, float(want.abs().max()))
    fwd_name, row_name = "jagged_attention._fwd_kernel", "jagged_attention._bwd_softmax_row_kernel"
    hooks = {n: cc._KERNELS[n][0].prefer for n in (fwd_name, row_name)}
    flag = J.FUSED_SOFTMAX_SHORT_ROWS
    gpu = device.type == "cuda"
    rows = []

    def one(label: str, name: str, params: dict[str, int], warps: int, stages: int,
            maxnreg: int | None = None) -> None:
        if gpu:
            _force_config(name, params, warps, stages, maxnreg)
        err = float((region.fwd().detach().float() - want).abs().max()) / scale
        row = measure(label, lambda: torch.autograd.grad(region.fwd(), (q, k, v), g), device)
        row["max_err"] = err
        row["configs"] = {n.removeprefix("jagged_attention."): c
                          for n, c in cc.ran("jagged_attention.").items() if c}
        rows.append(row)

    def fastest(timed: list[dict[str, Any]], configs: tuple) -> tuple:
        ok = [(r["graph_ms"], c) for r, c in zip(timed, configs) if "graph_ms" in r]
        return min(ok, key=lambda t: t[0])[1] if ok else configs[0]

    try:
        fwd_configs = FWD_BLOCKS if gpu else FWD_BLOCKS[:1]
        for bm, bn, w, st, cap in fwd_configs:
            capped = f" {cap}r" if cap else ""
            one(f"fwd {bm}x{bn} {w}w {st}s{capped}", fwd_name, {"BLOCK_M": bm, "BLOCK_N": bn},
                w, st, cap)
        fwd_best = fastest(rows[-len(fwd_configs):], fwd_configs)
        cc._KERNELS[fwd_name][0].prefer = hooks[fwd_name]
        J.FUSED_SOFTMAX_SHORT_ROWS = True
        row_configs = ROW_BLOCKS if gpu else ROW_BLOCKS[:1]
        for block, keys, w, st, cap in row_configs:
            capped = f" {cap}r" if cap else ""
            one(f"row kernel {block}{' keys' if keys else ''} {w}w {st}s{capped}", row_name,
                {"BLOCK": block, "KEY_MAJOR": keys}, w, st, cap)
        if gpu:  # the fastest of each together: what the picks would run
            row_best = fastest(rows[-len(row_configs):], row_configs)
            bm, bn, w, st, cap = fwd_best
            _force_config(fwd_name, {"BLOCK_M": bm, "BLOCK_N": bn}, w, st, cap)
            block, keys, rw, rst, rcap = row_best
            one(f"fastest of each: fwd {fwd_best}, row {row_best}", row_name,
                {"BLOCK": block, "KEY_MAJOR": keys}, rw, rst, rcap)
    finally:
        J.FUSED_SOFTMAX_SHORT_ROWS = flag
        for n, prefer in hooks.items():
            cc._KERNELS[n][0].prefer = prefer
        cc.forget("jagged_attention.")
    return {"tokens": region.layout.total, "rows": rows,
            "compiled": {n.removeprefix("jagged_attention."): compiled_resources(n)
                         for n in (fwd_name, row_name)}}


def compiled_resources(name: str) -> list[dict[str, Any]]:
    """Per variant of kernel ``name`` compiled in this process: its block sizes, warps,
    stages, registers a thread, spills and shared memory. Why: a latency-bound kernel's
    time follows how many programs an SM holds at once, which these bound (an H100 SM has
    65,536 registers and 228 KiB of shared memory); the timings alone cannot say which."""
    from gemc.backends.triton import config_choice as cc

    jit = cc._KERNELS[name][1].fn
    names = getattr(jit, "arg_names", [])

    def arg_name(key: Any) -> str:  # a constant's key: (argument index,) or a name
        return names[key[0]] if isinstance(key, tuple) and key[0] < len(names) else str(key)

    out = []
    for caches in getattr(jit, "device_caches", {}).values():
        for kernel in caches[0].values():
            meta = kernel.metadata
            consts = getattr(getattr(kernel, "src", None), "constants", {}) or {}
            blocks = {arg_name(k): v for k, v in consts.items()
                      if "BLOCK" in arg_name(k) and arg_name(k) != "BLOCK_D"}
            out.append({"blocks": blocks,
                        "warps": getattr(meta, "num_warps", None),
                        "stages": getattr(meta, "num_stages", None),
                        "regs": getattr(kernel, "n_regs", None),
                        "spills": getattr(kernel, "n_spills", None),
                        "shared": getattr(meta, "shared", None)})
    return out


def _transact_padded(region: Any, batch: Any) -> list[torch.Tensor]:
    """q, k, v and the output gradient ``[B, H, S, D]``: the region's values scattered to
    the padded positions (the representatives' copies), SDPA's layout."""
    from gemc.backends.triton import packed_tokens as pt

    with torch.no_grad():
        return [pt.scatter(x.detach(), (0, 2), region.layout).contiguous()
                for x in region.inputs]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: checks it runs)")
    ap.add_argument("--models", default="hstu,mmoe,sasrec_bst,transact")
    ap.add_argument("--profile-host", type=Path,
                    help="only profile the host's issue of each model's gemc call (defaults) "
                    "and of padded SDPA (cProfile, GPU held busy); write the stats here")
    ap.add_argument("--transact-blocks", action="store_true",
                    help="only TransAct's region attention at each forward and row-kernel "
                    "config (FWD_BLOCKS, ROW_BLOCKS), by graph replay and kernel sum")
    ap.add_argument("--defaults-only", action="store_true",
                    help="gemc's default launch configs only (with and without HSTU's bias), "
                    "and masked cuDNN SDPA: a short device call's rows")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import importlib

    from gemc.backends.triton import config_choice

    kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
    gen = torch.Generator().manual_seed(0)
    shapes = dict(kbench._zoo_attentions("tiny" if args.smoke else "h200"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                               else "cpu", "torch": torch.__version__, "models": {}}
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    models = "transact" if args.transact_blocks else args.models
    for model in models.split(","):
        if model == "transact":
            if args.transact_blocks:
                results["models"]["transact_blocks"] = _transact_blocks(
                    args.smoke, dtype, device, gen)
            elif args.profile_host:
                _profile_transact(args.profile_host, args.smoke, dtype, device, gen)
            else:
                results["models"][model] = _transact_rows(args.smoke, dtype, device, gen)
            continue
        shape = dict(shapes[model])
        kind, causal = shape["kind"], shape["causal"]
        x = _inputs(shape, dtype, device, gen)
        print(f"== {model} {shape} tokens={x['tokens']}", flush=True)
        if args.profile_host:
            calls = [("gemc", _gemc_call(x, kind, causal, False))]
            if device.type == "cuda":
                from torch.nn.attention import SDPBackend

                calls.append(("sdpa cudnn masked", _sdpa_call(x, SDPBackend.CUDNN_ATTENTION)))
            with args.profile_host.open("a") as f:
                for label, fn in calls:
                    ms = f"{host_ms(fn):.3f}" if device.type == "cuda" else "-"
                    f.write(f"==== {model}: {label}, host ms a call {ms}\n")
                    f.write(host_profile(fn, 5 if args.smoke else 50))
            continue
        rows = []
        flags = kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD
        try:
            for with_bias, tuned, fast, fused in GEMC_VARIANTS[kind]:
                if args.defaults_only and (tuned or fast or fused):
                    continue
                os.environ[config_choice.AUTOTUNE_ENV] = "1" if tuned else "0"
                kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD = fast, fused
                config_choice.forget("jagged_attention.")
                name = "gemc" + "".join(label for label, on in (
                    (" +bias", with_bias), (" autotuned", tuned), (" fast-sigmoid", fast),
                    (" fused-dq", fused)) if on)
                row = measure(name, _gemc_call(x, kind, causal, with_bias), device)
                row["configs"] = {k.removeprefix("jagged_attention."): v
                                  for k, v in config_choice.ran("jagged_attention.").items()
                                  if v}
                print(json.dumps({"configs": row["configs"]}), flush=True)
                rows.append(row)
        finally:
            os.environ.pop(config_choice.AUTOTUNE_ENV, None)
            kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD = flags
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend

            for label, backend in (("sdpa cudnn masked", SDPBackend.CUDNN_ATTENTION),
                                   ("sdpa efficient masked", SDPBackend.EFFICIENT_ATTENTION)):
                if args.defaults_only and backend != SDPBackend.CUDNN_ATTENTION:
                    continue
                rows.append(measure(label, _sdpa_call(x, backend), device))
        results["models"][model] = {"shape": shape, "tokens": x["tokens"], "rows": rows}
    results["versus_cudnn"] = versus_cudnn(results["models"])
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(args.out)
    return results


GEMC_FIGURE_ROW = {"transact": "gemc region (torch.compile)"}
"""Per model, the gemc row that is its figure (the form its training step runs: TransAct's
attention in its packed region under ``torch.compile``); ``gemc`` (the defaults) otherwise."""


def versus_cudnn(models: dict[str, Any]) -> dict[str, Any]:
    """Per model, gemc's figure row against padded masked cuDNN SDPA, fwd+bwd, by both
    measures side by side: ``by_do_bench`` (the issue's figure: the host's issue of a call
    included) and ``by_graph`` (CUDA graph replay of both: their GPU time alone). Why both:
    a call whose host outruns its kernels reads slower by do_bench than on the GPU
    (TransAct's region, thirtieth session: 0.48-0.77x by one, 1.64-1.70x by the other), and
    in a step whose GPU is busy elsewhere, or replayed as CUDA graphs, the host is hidden.
    None where a row or a measure is missing (a CPU run has no graph timing)."""
    out: dict[str, Any] = {}
    for model, entry in models.items():
        by = {r["variant"]: r for r in entry.get("rows", [])}
        mine = by.get(GEMC_FIGURE_ROW.get(model, "gemc"), {})
        cudnn = by.get("sdpa cudnn masked", {})

        def ratio(key: str, mine: dict = mine, cudnn: dict = cudnn) -> float | None:
            a, b = mine.get(key), cudnn.get(key)
            ok = isinstance(a, float) and isinstance(b, float) and a > 0
            return b / a if ok else None

        out[model] = {"gemc_row": mine.get("variant"), "by_do_bench": ratio("do_bench_ms"),
                      "by_graph": ratio("graph_ms")}
    return out


if __name__ == "__main__":
    main()

"""Where the host's time to issue one HSTU attention fwd+bwd goes, without a profiler.

    python3 benchmarks/launch_overhead_probe.py              # GPU, ~30 s
    python3 benchmarks/launch_overhead_probe.py --smoke      # CPU: checks it runs

Why: issue 17. gemc's jagged silu attention at HSTU's zoo shape takes ~0.53 ms of GPU
kernels a fwd+bwd and ~0.70 ms of host to issue (``attention_gpu_time.py``, twenty-seventh
session): ``do_bench`` times the host, and the same kernels read 0.56 ms in one process and
0.75 in another. cProfile's own overhead (a call per Python function) distorts a breakdown
of code made of many small calls, so this times each piece directly, the GPU held busy by a
sleep kernel (nothing waits for it), as microseconds per call:

- the whole fwd+bwd, and the forward alone under ``no_grad``;
- each of the call's Triton launches three ways: through ``JITFunction.run`` (what a launch
  costs), the compiled kernel's launcher called with the arguments ``JITFunction.run``
  handed it (the C launcher alone: the floor), and the ``binder`` that specialises the
  arguments (the part of ``JITFunction.run`` that scales with their number);
- an empty ``autograd.Function`` fwd+bwd and ``torch.empty`` (PyTorch's own floor);
- padded cuDNN SDPA fwd+bwd at the same shape (what gemc is compared with). A call that
  blocks on the GPU reads as the sleep's length over the calls: with 200 calls queued
  behind the sleep cuDNN's did (5.6 ms on an H100; ``attention_gpu_time.py``'s host_ms,
  20 calls, read it at 0.21 ms), so that row says something in it blocked, not what its
  host costs;
- the inclusive host time of each step of gemc's call (:data:`STEPS`), each wrapped in a
  timer for one pass over the calls. The wrappers add to the whole (``steps_us``' "whole
  call" against ``whole_fwd_bwd_us``: 34 us on one H100's host, 256 on another's).

``--sweep``: instead, TransAct's region attention with each of its three kernels run at each
config of :data:`SWEEP` in turn (the other two at their defaults), that kernel's GPU time
from a profiler trace: which tile, warp count and pipeline depth suit rows of ~50 tokens.

``--transact N``: instead, TransAct's region attention (``kernels.transact_region``) fwd+bwd
N times, then its ``do_bench`` time and the launch configs its kernels ran (run it under
``ncu`` to read its kernels' counters, and with ``GEMC_AUTOTUNE=1`` for the tuned configs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attention_gpu_time as agt  # noqa: E402
import kernels as kbench  # noqa: E402


def host_us(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    """Microseconds of host per call of ``fn`` after one untimed call, the GPU held busy
    (no call waits for it)."""
    fn()
    return _issue_seconds(fn, calls, cuda) * 1e6 / calls


def _issue_seconds(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    """Seconds the host takes to issue ``calls`` calls of ``fn`` while a sleep kernel holds
    the GPU (on a GPU), then waits for them."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return elapsed


class _Launches:
    """Records each Triton launch of a call: the JIT function, its arguments, and (on the
    GPU) the compiled kernel's launcher arguments as ``JITFunction.run`` passed them."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __enter__(self) -> _Launches:
        from triton.runtime import jit

        self._jit = jit
        self._orig = jit.JITFunction.run
        seen = self.seen
        orig = self._orig

        def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            entry = {"fn": fn, "args": args, "kwargs": dict(kwargs), "grid": grid}
            kernel = orig(fn, *args, grid=grid, warmup=warmup, **kwargs)
            entry["kernel"] = kernel
            seen.append(entry)
            return kernel

        jit.JITFunction.run = run
        return self

    def __exit__(self, *exc: Any) -> None:
        self._jit.JITFunction.run = self._orig


def _launcher_args(entry: dict[str, Any]) -> tuple[Any, ...] | None:
    """The arguments ``JITFunction.run`` hands the compiled kernel's launcher for this
    launch, captured by running it once with the launcher wrapped; None where the kernel
    has no ``run`` launcher (the interpreter)."""
    kernel = entry["kernel"]
    if kernel is None or not hasattr(kernel, "_run") or not hasattr(kernel, "packed_metadata"):
        return None
    launcher = kernel.run  # a property: loads the module and makes ``_run`` the first time
    got: list[tuple[Any, ...]] = []

    def capture(*a: Any) -> Any:
        got.append(a)
        return launcher(*a)

    kernel._run = capture
    try:
        entry["fn"].run(*entry["args"], grid=entry["grid"], warmup=False, **entry["kwargs"])
    finally:
        kernel._run = launcher
    return got[0] if got else None


def launch_rows(call: Callable[[], Any], calls: int, cuda: bool) -> list[dict[str, Any]]:
    """Each Triton launch of one ``call``, timed three ways (module doc)."""
    with _Launches() as rec:
        call()
    return [_launch_row(entry, calls, cuda) for entry in rec.seen]


def _launch_row(entry: dict[str, Any], calls: int, cuda: bool) -> dict[str, Any]:
    """One recorded launch timed three ways (module doc)."""
    fn, args, kwargs, grid = entry["fn"], entry["args"], entry["kwargs"], entry["grid"]
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
    row: dict[str, Any] = {"kernel": name, "args": len(args) + len(kwargs)}
    row["jit_run_us"] = host_us(lambda: fn.run(*args, grid=grid, warmup=False, **kwargs),
                                calls, cuda)
    largs = _launcher_args(entry) if cuda else None
    if largs is None:
        return row
    kernel = entry["kernel"]
    row["launcher_us"] = host_us(lambda: kernel.run(*largs), calls, cuda)
    binder = fn.device_caches[torch.cuda.current_device()][-1]
    bind_kwargs = dict(kwargs, debug=False)
    try:
        row["binder_us"] = host_us(lambda: binder(*args, **bind_kwargs), calls, cuda)
    except TypeError as exc:  # the binder's keywords differ between Triton versions
        row["binder_us"] = f"{type(exc).__name__}: {exc}"[:120]
    return row


STEPS = (
    ("gemc.backends.triton.jagged_attention", "JaggedAttentionFunction.forward"),
    ("gemc.backends.triton.jagged_attention", "JaggedAttentionFunction.backward"),
    ("gemc.backends.triton.jagged_attention", "_attention_forward"),
    ("gemc.backends.triton.jagged_attention", "_attention_backward"),
    ("gemc.backends.triton.jagged_attention", "written_rows"),
    ("gemc.backends.triton.jagged_attention", "_meta"),
    ("gemc.backends.triton.silu_key_block_backward", "silu_key_block_backward"),
    ("gemc.backends.triton.direct_launch", "DirectAutotuner.run"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("torch.autograd", "grad"),
)
"""(module, attribute) of each step :func:`step_rows` times; a step imported by name
into another module is timed where it is called through its own module only."""


def step_rows(call: Callable[[], Any], calls: int, cuda: bool) -> dict[str, float]:
    """Inclusive host us a call of each of :data:`STEPS` (module doc), and ``call`` itself."""
    import importlib

    spent: dict[str, float] = {}
    undo = []
    for module_name, attr in STEPS:
        module = importlib.import_module(module_name)
        owner_name, _, name = attr.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        key = f"{module_name.rsplit('.', 1)[-1]}.{attr}"
        spent[key] = 0.0

        def timed(*a: Any, _fn: Any = fn, _key: str = key, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_key] += time.perf_counter() - start

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        undo.append((owner, name, raw))
    try:
        call()
        for k in spent:  # the untimed call's steps left out
            spent[k] = 0.0
        spent["whole call"] = _issue_seconds(call, calls, cuda)
    finally:
        for owner, name, raw in reversed(undo):
            setattr(owner, name, raw)
    return {k: round(v * 1e6 / calls, 2) for k, v in spent.items()}


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g


SWEEP = ((16, 64, 2, 1), (32, 32, 2, 1), (32, 32, 4, 1), (32, 64, 4, 1), (32, 64, 4, 2),
         (64, 32, 4, 1), (64, 32, 4, 2), (64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 8, 1),
         (64, 64, 8, 2), (128, 32, 4, 2), (128, 64, 8, 2), (128, 64, 4, 1))
"""(BLOCK_M, BLOCK_N, warps, stages) ``--sweep`` runs each kernel at."""


def sweep(smoke: bool, dtype: torch.dtype, device: torch.device, gen: torch.Generator
          ) -> list[dict[str, Any]]:
    """``--sweep`` (module doc): one row per (kernel, config)."""
    import importlib

    import triton

    ja = importlib.import_module("gemc.backends.triton.jagged_attention")

    batch = kbench.transact_batch("tiny" if smoke else "h200", gen, device)
    region = kbench.transact_region(batch, dtype, gen, device)
    q, k, v, g = region.inputs

    def call() -> Any:
        return torch.autograd.grad(region.fwd(), (q, k, v), g)

    rows = []
    for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        tuner = getattr(ja, name)
        if not hasattr(tuner, "configs"):  # the interpreter's kernels are not autotuned
            continue
        configs = list(tuner.configs)
        for m, n, w, st in SWEEP[:2] if smoke else SWEEP:
            tuner.configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w,
                                           num_stages=st)]
            tuner.cache.clear()
            row: dict[str, Any] = {"kernel": name, "config": [m, n, w, st]}
            try:
                call()
                if device.type == "cuda":
                    top = agt.kernels_ms(call)
                    row["kernel_ms"] = next((ms for kn, ms in top["top"] if kn.startswith(name)),
                                            None)
                    row["all_kernels_ms"] = top["kernels_ms"]
            except Exception as exc:  # noqa: BLE001 - a config that fails is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
        tuner.configs = configs
        tuner.cache.clear()
    return rows


def transact_calls(n: int, smoke: bool, dtype: torch.dtype, device: torch.device,
                   gen: torch.Generator) -> dict[str, Any]:
    """``--transact``: the region attention's fwd+bwd ``n`` times, its time, its configs."""
    from gemc.backends.triton import config_choice

    batch = kbench.transact_batch("tiny" if smoke else "h200", gen, device)
    region = kbench.transact_region(batch, dtype, gen, device)
    q, k, v, g = region.inputs

    def call() -> Any:
        return torch.autograd.grad(region.fwd(), (q, k, v), g)

    for _ in range(n):
        call()
    result = {"fwd_bwd_ms": kbench.bench_ms(call, device),
              "configs": config_choice.ran("jagged_attention")}
    print(json.dumps(result, default=str), flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: checks it runs)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--sweep", action="store_true",
                    help="TransAct's region kernels over SWEEP's configs instead (module doc)")
    ap.add_argument("--transact", type=int, default=0, metavar="N",
                    help="TransAct's region attention N times instead (module doc)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    calls = 200 if cuda else 2
    gen = torch.Generator().manual_seed(0)
    if args.sweep:
        rows = sweep(args.smoke, dtype, device, gen)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
        return {"sweep": rows}
    if args.transact:
        return transact_calls(args.transact, args.smoke, dtype, device, gen)
    shape = dict(next(s for m, s in kbench._zoo_attentions("h200") if m == "hstu"))
    if args.smoke:
        shape.update(batch=2, max_len=16, head_dim=16, heads=2)
    x = agt._inputs(shape, dtype, device, gen)
    full = agt._gemc_call(x, "silu", True, False)
    q, k, v, _ = (t.detach() for t in x["jagged"])
    from gemc.backends.triton import jagged_attention

    def forward() -> Any:
        with torch.no_grad():
            return jagged_attention(q, k, v, x["offsets"], x["L"], scale=x["scale"],
                                    causal=True, kind="silu")

    leaf = torch.zeros(8, device=device, requires_grad=True)
    ones = torch.ones(8, device=device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape,
        "torch": torch.__version__,
        "whole_fwd_bwd_us": host_us(full, calls, cuda),
        "forward_no_grad_us": host_us(forward, calls, cuda),
        "empty_function_fwd_bwd_us": host_us(
            lambda: torch.autograd.grad(_Empty.apply(leaf), (leaf,), ones), calls, cuda),
        "torch_empty_us": host_us(lambda: torch.empty((1024, 4, 128), device=device), calls,
                                  cuda),
        "launches": launch_rows(full, calls, cuda),
        "steps_us": step_rows(full, calls, cuda),
    }
    if cuda:
        from torch.nn.attention import SDPBackend

        result["cudnn_sdpa_fwd_bwd_us"] = host_us(
            agt._sdpa_call(x, SDPBackend.CUDNN_ATTENTION), calls, cuda)
    import triton

    result["triton"] = triton.__version__
    print(json.dumps(result, indent=1, default=str))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()

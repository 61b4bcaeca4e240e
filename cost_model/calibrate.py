"""`gemc calibrate --out FILE`: measure this GPU's kernels and write a calibration file.

Microbenchmarks, each timed with CUDA events over back-to-back launches after warm-up,
the median of several repeats (so launch gaps are included the way a busy stream sees
them): GEMM sweeps in BF16, FP32, TF32 and FP8 (``torch._scaled_mm`` with row-wise scales,
where the GPU and torch support it), device copy and pointwise bandwidth by size,
LayerNorm forward/backward, EmbeddingBag forward/backward (eager, dense gradient) over
rows x dim x bag size, SDPA attention forward/backward over lengths, foreach AdamW (fp32
and bf16 states), eager dispatch overheads, the eager step's components at the example
models' shapes (EmbeddingBag with hot-head ids, key-padding-masked SDPA, bf16 pointwise and
LayerNorm), and NCCL collectives when more than one GPU is visible. A section that fails is
skipped with a note; the file is written atomically (tmp + rename) with each section's
seconds in ``section_s``. The format is documented in calibration.py. Budget: about a
minute on one H200 (``--quick``: well under).

    python -m gemc.cost_model.calibrate --out h200.json [--quick]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .calibration import FORMAT, VERSION, CalibrationError, validate_calibration
from .hardware import gpu_from_device_name


def _sync() -> None:
    torch.cuda.synchronize()


def time_cuda(fn: Callable[[], Any], *, warmup: int = 2, min_time: float = 0.01,
              repeats: int = 3, max_iters: int = 200) -> float:
    """Median seconds per call of fn over back-to-back launches (CUDA events)."""
    for _ in range(warmup):
        fn()
    _sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    _sync()
    one = max(start.elapsed_time(end) * 1e-3, 1e-7)
    iters = int(min(max_iters, max(1, min_time / one)))
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        _sync()
        samples.append(start.elapsed_time(end) * 1e-3 / iters)
    return statistics.median(samples)


def _wall(fn: Callable[[], Any], iters: int) -> float:
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - t0) / iters


# ---- sections -------------------------------------------------------------------------
def measure_launch(quick: bool) -> dict[str, float]:
    """GPU gap between tiny kernels (from a CUDA graph, so the CPU is not the limit) and
    the CPU cost of one eager op, one view, and one autograd node in backward."""
    x = torch.zeros(16, device="cuda")
    out: dict[str, float] = {}
    try:
        n = 200
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1)
        out["kernel_s"] = time_cuda(g.replay, min_time=0.005) / n
    except Exception:  # graphs unsupported here: the events' view of a tiny kernel
        out["kernel_s"] = time_cuda(lambda: x.add_(1), min_time=0.005)
    iters = 500 if quick else 3000
    out["eager_op_s"] = _wall(lambda: torch.add(x, 1), iters)
    out["eager_view_op_s"] = _wall(lambda: x.view(4, 4), iters)
    out["eager_bwd_op_s"] = _eager_bwd_op_s()
    return out


def _eager_bwd_op_s(depth: int = 200, reps: int = 20) -> float:
    """CPU time of one autograd node in backward (with its kernel launch): a chain of
    ``depth`` muls, forward graphs built (and warm) before the backward alone is timed.
    (Timing forward+backward minus forward over a few cold iterations came out <= 0.)"""
    w = torch.ones(16, device="cuda", requires_grad=True)

    def chain() -> torch.Tensor:
        y = w
        for _ in range(depth):
            y = y * 1.0001
        return y.sum()

    for _ in range(3):  # warm the autograd engine, the allocator and the kernels
        chain().backward()
    samples = []
    for _ in range(3):
        losses = [chain() for _ in range(reps)]
        _sync()
        t0 = time.perf_counter()
        for loss in losses:
            loss.backward()
        _sync()
        samples.append((time.perf_counter() - t0) / (reps * (depth + 2)))
        del losses
    return max(statistics.median(samples), 1e-7)


def _gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    ms = (128, 1024, 8192, 32768) if not quick else (256, 4096, 32768)
    nks = (128, 512, 2048, 8192) if not quick else (256, 2048, 8192)
    return [(m, n, k) for m in ms for n in nks for k in nks]


def measure_gemm(quick: bool, notes: list[str]) -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                                  ("tf32", torch.float32, True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            rows = []
            for m, n, k in _gemm_shapes(quick):
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                b = torch.randn(k, n, device="cuda", dtype=dtype)
                rows.append([m, n, k, time_cuda(lambda a=a, b=b: torch.mm(a, b))])
                del a, b
            out[name] = rows
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    try:
        out["fp8"] = _measure_fp8(quick)
    except Exception as exc:
        notes.append(f"fp8 GEMM skipped: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return out


def _measure_fp8(quick: bool) -> list[list[float]]:
    """Row-wise scaled FP8 (e4m3) GEMMs through torch._scaled_mm, BF16 out."""
    if not hasattr(torch, "float8_e4m3fn") or torch.cuda.get_device_capability() < (8, 9):
        raise RuntimeError("this GPU or torch has no FP8 GEMM")
    rows = []
    for m, n, k in _gemm_shapes(quick):
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
        sa = torch.ones(m, 1, device="cuda", dtype=torch.float32)
        sb = torch.ones(1, n, device="cuda", dtype=torch.float32)

        def run(a=a, b=b, sa=sa, sb=sb) -> torch.Tensor:
            return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

        rows.append([m, n, k, time_cuda(run)])
    return rows


def _sizes(quick: bool) -> list[int]:
    exps = range(16, 31, 2) if quick else range(14, 32)
    return [1 << e for e in exps]  # elements... as bytes below


_NORM_HIDDEN = 1024


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (_NORM_HIDDEN,), w, b)


def measure_memory(quick: bool) -> dict[str, list[list[float]]]:
    copy, pointwise, norm = [], [], []
    for nbytes in _sizes(quick):
        numel = max(nbytes // 4, 1)
        x = torch.empty(numel, device="cuda")
        y = torch.empty_like(x)
        copy.append([2 * numel * 4, time_cuda(lambda x=x, y=y: y.copy_(x))])
        z = torch.empty_like(x)
        pointwise.append([3 * numel * 4, time_cuda(lambda x=x, y=y, z=z: torch.add(x, y,
                                                                                  out=z))])
        del x, y, z
        hidden = _NORM_HIDDEN
        rows_n = max(numel // hidden, 1)
        xin = torch.randn(rows_n, hidden, device="cuda", requires_grad=True)
        w = torch.ones(hidden, device="cuda", requires_grad=True)
        b = torch.zeros(hidden, device="cuda", requires_grad=True)
        fwd = time_cuda(lambda xin=xin, w=w, b=b: _layer_norm(xin, w, b))
        out = _layer_norm(xin, w, b)
        g = torch.ones_like(out)
        bwd = time_cuda(lambda out=out, g=g, xin=xin, w=w, b=b: torch.autograd.grad(
            out, (xin, w, b), g, retain_graph=True))
        norm.append([2 * rows_n * hidden * 4, fwd, bwd])
        del xin, out, g
    return {"copy": copy, "pointwise": pointwise, "norm": norm}


def measure_embedding(quick: bool) -> list[dict[str, Any]]:
    recs = []
    rows_list = (100_000, 10_000_000) if not quick else (1_000_000,)
    dims = (32, 128)
    bag_sizes = (1, 10, 50) if not quick else (1, 20)
    dtypes = (("fp32", torch.float32), ("bf16", torch.bfloat16))
    bags = 8192
    for dname, dtype in dtypes:
        for rows in rows_list:
            for dim in dims:
                emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", device="cuda", dtype=dtype)
                for bag in bag_sizes:
                    ids = torch.randint(0, rows, (bags * bag,), device="cuda")
                    offsets = torch.arange(0, bags * bag, bag, device="cuda")
                    fwd = time_cuda(lambda emb=emb, ids=ids, offsets=offsets: emb(ids, offsets))
                    out = emb(ids, offsets)
                    g = torch.ones_like(out)
                    bwd = time_cuda(lambda out=out, g=g, emb=emb: torch.autograd.grad(
                        out, emb.weight, g, retain_graph=True), min_time=0.005)
                    recs.append({"rows": rows, "dim": dim, "bags": bags, "bag_size": bag,
                                 "dtype": dname, "fwd_s": fwd, "bwd_s": bwd})
                    del out, g
                del emb
                torch.cuda.empty_cache()
    return recs


def measure_attention(quick: bool) -> list[dict[str, Any]]:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    recs = []
    lengths = (128, 512, 2048) if quick else (64, 128, 256, 512, 1024, 2048, 4096)
    configs = [("bf16", torch.bfloat16, d, c) for d in (64, 128) for c in (False, True)]
    configs += [("fp32", torch.float32, 64, False)]
    for dname, dtype, head_dim, causal in configs:
        for length in lengths:
            batch, heads = max(1, 65536 // length), 4
            if dtype == torch.float32:
                batch = max(1, batch // 4)
            q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype,
                                   requires_grad=True) for _ in range(3))
            fwd = time_cuda(lambda q=q, k=k, v=v, c=causal: sdpa(q, k, v, is_causal=c))
            out = sdpa(q, k, v, is_causal=causal)
            g = torch.ones_like(out)
            bwd = time_cuda(lambda out=out, g=g, q=q, k=k, v=v: torch.autograd.grad(
                out, (q, k, v), g, retain_graph=True))
            recs.append({"batch": batch, "heads": heads, "q_len": length, "kv_len": length,
                         "head_dim": head_dim, "causal": causal, "dtype": dname,
                         "fwd_s": fwd, "bwd_s": bwd})
            del q, k, v, out, g
    return recs


# parameter bytes; up to the example presets' ~1.3e9 parameters (2.6 GB bf16, 5.2 GB fp32)
_OPTIMIZER_SIZES = tuple(1 << e for e in (18, 20, 22, 24, 26, 28, 30, 31, 32))
_OPTIMIZER_SIZES_QUICK = tuple(1 << e for e in (20, 26, 30, 32))


def measure_optimizer(quick: bool) -> dict[str, list[list[float]]]:
    """torch's foreach AdamW (the eager default) over 16 equal tensors, by parameter bytes,
    with params, grads and both states in fp32 ("adamw_foreach") and in bf16
    ("adamw_foreach_bf16": a model cast with .to(bfloat16) keeps bf16 states)."""
    out: dict[str, list[list[float]]] = {}
    sizes = _OPTIMIZER_SIZES_QUICK if quick else _OPTIMIZER_SIZES
    for key, dtype in (("adamw_foreach", torch.float32), ("adamw_foreach_bf16", torch.bfloat16)):
        elt = torch.empty((), dtype=dtype).element_size()
        rows = []
        for total in sizes:
            numel = total // elt
            n_tensors = 16 if numel >= 16 * 1024 else 1
            params = [torch.nn.Parameter(torch.zeros(numel // n_tensors, device="cuda",
                                                     dtype=dtype)) for _ in range(n_tensors)]
            for p in params:
                p.grad = torch.ones_like(p)
            opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
            rows.append([total, time_cuda(opt.step, warmup=2, min_time=0.01)])
            del opt, params
            torch.cuda.empty_cache()
        out[key] = rows
    return out


# ---- the eager step's components at the example models' shapes ------------------------
# Shapes of the h200 presets (examples/dlrm, examples/gem) written out here, since the cost
# model imports nothing from examples/: DLRM tables of <= 1.5M rows x 128, bags of 16384..
# 65536 with pooling 1..100; GEM tables 1e5..4e6 rows x 64/96/128, B 1024..4096, pooling
# 1..30; ids drawn like their make_batch (rows * u**3: a hot head). GEM attention: 4 heads
# of 64 over a key-padding-masked history of 256, self (q 256) and cross (q 32).
def _skewed_ids(rows: int, n: int) -> torch.Tensor:
    u = torch.rand(n, device="cuda")
    return (u.pow_(3).mul_(rows)).long().clamp_(max=rows - 1)


def measure_embedding_skewed(quick: bool) -> list[dict[str, Any]]:
    """EmbeddingBag (sum, include_last_offset, dense gradient) at the presets' shapes with
    skewed ids, fp32 and bf16: forward, and backward to the weight (zero-filled dense
    gradient + sort + segment sums: what eager runs). Same fields as embedding_bag plus
    ids='skewed'."""
    recs = []
    shapes = [(1_500_000, 128, 16384, 1), (1_500_000, 128, 16384, 10),
              (1_500_000, 128, 16384, 100), (1_500_000, 128, 65536, 10),
              (100_000, 64, 1024, 10), (4_000_000, 128, 1024, 30), (100_000, 96, 4096, 1)]
    if quick:
        shapes = shapes[1:3] + shapes[4:5]
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for rows, dim, bags, bag in shapes:
            emb = torch.nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True,
                                        device="cuda", dtype=dtype)
            ids = _skewed_ids(rows, bags * bag)
            offsets = torch.arange(0, bags * bag + 1, bag, device="cuda")
            fwd = time_cuda(lambda emb=emb, ids=ids, offsets=offsets: emb(ids, offsets))
            out = emb(ids, offsets)
            g = torch.ones_like(out)
            bwd = time_cuda(lambda out=out, g=g, emb=emb: torch.autograd.grad(
                out, emb.weight, g, retain_graph=True), min_time=0.005)
            recs.append({"rows": rows, "dim": dim, "bags": bags, "bag_size": bag,
                         "dtype": dname, "ids": "skewed", "fwd_s": fwd, "bwd_s": bwd})
            del emb, out, g, ids
        torch.cuda.empty_cache()
    return recs


def measure_attention_masked(quick: bool) -> list[dict[str, Any]]:
    """SDPA with a boolean key-padding mask [B, 1, 1, L] (GEM's history attention): with a
    mask bf16 cannot take the flash kernel, so the unmasked curve may not hold."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    recs = []
    shapes = [(1024, 4, 256, 256, 64), (4096, 4, 256, 256, 64), (1024, 4, 32, 256, 64),
              (4096, 4, 32, 256, 64)]
    if quick:
        shapes = shapes[:1]
    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for batch, heads, q_len, kv_len, head_dim in shapes:
            q = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=dtype,
                            requires_grad=True)
            k, v = (torch.randn(batch, heads, kv_len, head_dim, device="cuda", dtype=dtype,
                                requires_grad=True) for _ in range(2))
            lengths = torch.randint(1, kv_len + 1, (batch,), device="cuda")
            mask = (torch.arange(kv_len, device="cuda")[None, :] < lengths[:, None])
            mask = mask[:, None, None, :]
            fwd = time_cuda(lambda q=q, k=k, v=v, m=mask: sdpa(q, k, v, attn_mask=m))
            out = sdpa(q, k, v, attn_mask=mask)
            g = torch.ones_like(out)
            bwd = time_cuda(lambda out=out, g=g, q=q, k=k, v=v: torch.autograd.grad(
                out, (q, k, v), g, retain_graph=True))
            recs.append({"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len,
                         "head_dim": head_dim, "causal": False, "masked": True, "dtype": dname,
                         "fwd_s": fwd, "bwd_s": bwd})
            del q, k, v, out, g, mask
    return recs


def measure_memory_bf16(quick: bool) -> dict[str, list[list[float]]]:
    """pointwise (a + b) and LayerNorm fwd/bwd on bf16 tensors: [bytes, seconds] with bytes
    counted at 2 per element (as op_cost counts a bf16 op)."""
    pointwise, norm = [], []
    for nbytes in (1 << e for e in (range(20, 31, 5) if quick else range(18, 32, 2))):
        numel = max(nbytes // 2, 1)
        x = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        y, z = torch.empty_like(x), torch.empty_like(x)
        pointwise.append([3 * numel * 2, time_cuda(lambda x=x, y=y, z=z: torch.add(x, y,
                                                                                  out=z))])
        del x, y, z
        rows_n = max(numel // _NORM_HIDDEN, 1)
        xin = torch.randn(rows_n, _NORM_HIDDEN, device="cuda", dtype=torch.bfloat16,
                          requires_grad=True)
        w = torch.ones(_NORM_HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.zeros(_NORM_HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fwd = time_cuda(lambda xin=xin, w=w, b=b: _layer_norm(xin, w, b))
        out = _layer_norm(xin, w, b)
        g = torch.ones_like(out)
        bwd = time_cuda(lambda out=out, g=g, xin=xin, w=w, b=b: torch.autograd.grad(
            out, (xin, w, b), g, retain_graph=True))
        norm.append([2 * rows_n * _NORM_HIDDEN * 2, fwd, bwd])
        del xin, out, g
    return {"pointwise_bf16": pointwise, "norm_bf16": norm}


def measure_eager_components(quick: bool) -> dict[str, Any]:
    """What an eager bf16/fp32 step runs that the generic sweeps may miss."""
    out: dict[str, Any] = {}
    for key, fn in (("embedding_bag_skewed", measure_embedding_skewed),
                    ("attention_masked", measure_attention_masked),
                    ("memory_bf16", measure_memory_bf16)):
        result = fn(quick)
        if isinstance(result, dict):
            out.update(result)
        else:
            out[key] = result
        torch.cuda.empty_cache()
    return out


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], queue: Any) -> None:
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    out: dict[str, list[list[float]]] = {op: [] for op in
                                          ("all_reduce", "all_gather", "reduce_scatter",
                                           "all_to_all")}
    for nbytes in sizes:
        numel = max(nbytes // 4 // world * world, world)
        buf = torch.ones(numel, device="cuda")
        out_buf = torch.empty_like(buf)
        shard = torch.empty(numel // world, device="cuda")
        ops = {
            "all_reduce": lambda buf=buf: dist.all_reduce(buf),
            "all_gather": lambda buf=buf, shard=shard: dist.all_gather_into_tensor(buf, shard),
            "reduce_scatter": lambda buf=buf, shard=shard: dist.reduce_scatter_tensor(shard,
                                                                                       buf),
            "all_to_all": lambda buf=buf, out_buf=out_buf: dist.all_to_all_single(out_buf, buf),
        }
        for op, fn in ops.items():
            dist.barrier()
            t = time_cuda(fn, warmup=3, min_time=0.01)
            out[op].append([numel * 4, t])
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def measure_collectives(quick: bool, notes: list[str]) -> dict[str, Any]:
    world = torch.cuda.device_count()
    if world < 2:
        notes.append("collectives not measured: one GPU visible (the model uses NVLink/NIC "
                     "datasheet bandwidth at NCCL efficiencies)")
        return {"skipped": "one GPU visible"}
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [1 << e for e in (range(12, 31, 3) if quick else range(10, 31, 2))]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_collective_worker, args=(world, port, sizes, queue), nprocs=world,
                       join=True, start_method="spawn")
    return {"ranks": world, **queue.get()}


# ---- driver ---------------------------------------------------------------------------
def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=False)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_calibration(out_path: str, *, quick: bool = False,
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Measure the current CUDA GPU and write the calibration file atomically."""
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not torch.cuda.is_available():
        raise CalibrationError(
            "gemc calibrate needs a CUDA GPU; none is visible to torch",
            where=f"torch {torch.__version__} (cuda={torch.version.cuda})",
            fix="run it on the GPU machine you plan for (a CUDA build of torch, a visible GPU)")
    props = torch.cuda.get_device_properties(0)
    spec = gpu_from_device_name(props.name)
    if spec is None:
        raise CalibrationError(f"no datasheet spec for GPU {props.name!r}",
                               where="cost_model/hardware.py",
                               fix="add its GPUSpec (peaks, HBM) to cost_model/hardware.py")
    torch.manual_seed(0)
    notes: list[str] = []
    data: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": {"name": spec.name, "device_name": props.name,
                "sm_count": props.multi_processor_count,
                "total_memory_bytes": int(props.total_memory),
                "capability": list(torch.cuda.get_device_capability())},
        "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "driver": _driver_version(),
                     "cudnn": torch.backends.cudnn.version()},
        "quick": quick,
    }
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("launch", lambda: measure_launch(quick)),
        ("gemm", lambda: measure_gemm(quick, notes)),
        ("memory", lambda: measure_memory(quick)),
        ("embedding_bag", lambda: measure_embedding(quick)),
        ("attention", lambda: measure_attention(quick)),
        ("optimizer", lambda: measure_optimizer(quick)),
        ("eager_components", lambda: measure_eager_components(quick)),
        ("collectives", lambda: measure_collectives(quick, notes)),
    ]
    t_all = time.perf_counter()
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # one broken section must not lose the others
            notes.append(f"{name} skipped: {type(exc).__name__}: {str(exc).splitlines()[:1]}")
            say(f"  {name}: FAILED ({exc}); see notes\n{traceback.format_exc(limit=3)}")
            continue
        finally:
            torch.cuda.empty_cache()
        if name in ("memory", "eager_components"):
            data.update(result)
        else:
            data[name] = result
        data.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        say(f"  {name}: {time.perf_counter() - t0:.1f} s")
    data["notes"] = notes
    data["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    validate_calibration(data, out_path)
    directory = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    say(f"wrote {out_path} ({data['elapsed_s']} s)")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemc.cost_model.calibrate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="calibration file to write (JSON)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (under a minute)")
    args = parser.parse_args(argv)
    try:
        run_calibration(args.out, quick=args.quick)
    except CalibrationError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

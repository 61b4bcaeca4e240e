"""Predicted time and peak memory of one *eager* PyTorch training step on one GPU.

This is what benchmarks/cost_model_accuracy.py checks the cost model against: the
annotated graph's ops run one kernel launch at a time, so the step is the GPU's kernel
time *or* the CPU's dispatch time, whichever the stream waits on. We replay it as a queue:

    cpu_t += dispatch_i;  gpu_t = max(gpu_t, cpu_t) + kernel_i

over the forward in graph order, the backward in reverse order, then the optimizer
(torch's default foreach AdamW over every parameter, embedding tables included, since
eager EmbeddingBag gradients are dense). Dispatch costs come from the calibration's launch
section (defaults below when there is none).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from gemc import ir
from gemc.ir import OpKind

from .activations import saved_activation_bytes
from .calibration import Calibration
from .hardware import GPUSpec
from .memory import eager_peak_bytes
from .op_cost import node_cost, optimizer_time

# CPU time of one eager op through the dispatcher, a view, one autograd node in backward,
# and one tensor of a foreach optimizer op: typical of a recent x86 host with torch 2.x.
DEFAULT_DISPATCH = {"eager_op_s": 8e-6, "eager_view_op_s": 3e-6, "eager_bwd_op_s": 12e-6,
                    "foreach_tensor_s": 0.4e-6}
# ATen ops that read a device value on the host (cudaMemcpy D2H + stream sync) when run
# eagerly on CUDA: the CPU waits there for every kernel queued so far, so the GPU then
# idles while the CPU dispatches what follows. repeat_interleave with a tensor of repeats
# checks ``(repeats >= 0).all().item()`` even when given output_size.
HOST_SYNC_OPS = frozenset({"repeat_interleave", "nonzero", "masked_select", "unique",
                           "_unique2", "unique_consecutive", "_local_scalar_dense", "item",
                           "bincount", "histc"})
EMBEDDING_BWD_KERNELS = 20  # CPU-side, without a measurement: ~20 one-kernel autograd nodes
_OPT_PASSES = 8  # foreach AdamW launches 8 ops (see kernels.optimizer_bytes)

# Where the GPU time of an eager step goes, in the groups a profiler trace can be sorted
# into (benchmarks/cost_model_breakdown.py sorts measured kernels the same way).
CATEGORIES = ("gemm", "attention", "embedding_fwd", "embedding_bwd", "norm", "pointwise",
              "optimizer")
PHASES = ("fwd", "bwd", "opt")


def category_of(kind: OpKind, phase: str) -> str | None:
    """The breakdown category of a node's forward ("fwd") or backward ("bwd") kernels;
    None for views and placeholders (no kernels)."""
    if kind in (OpKind.VIEW, OpKind.INPUT, OpKind.PARAM, OpKind.OUTPUT, OpKind.COMM):
        return None
    if kind is OpKind.EMBEDDING:
        return "embedding_fwd" if phase == "fwd" else "embedding_bwd"
    return {OpKind.GEMM: "gemm", OpKind.ATTENTION: "attention",
            OpKind.NORM: "norm"}.get(kind, "pointwise")


@dataclass(frozen=True)
class EagerStepPrediction:
    step_s: float
    gpu_busy_s: float        # kernels alone, no waiting on the CPU
    cpu_s: float             # dispatch alone
    forward_s: float
    backward_s: float
    optimizer_s: float
    cost_model: str          # "calibrated" or "roofline"
    memory: dict[str, float] = field(default_factory=dict)
    by_kind_ms: dict[str, float] = field(default_factory=dict)
    # category -> phase ("fwd", "bwd", "opt") -> ms of GPU kernel time; and kernel counts
    by_category_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    kernels_by_category: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step_ms": 1e3 * self.step_s, "gpu_busy_ms": 1e3 * self.gpu_busy_s,
                "cpu_dispatch_ms": 1e3 * self.cpu_s, "forward_ms": 1e3 * self.forward_s,
                "backward_ms": 1e3 * self.backward_s, "optimizer_ms": 1e3 * self.optimizer_s,
                "cost_model": self.cost_model,
                "memory_gb": {k: v / 1e9 for k, v in self.memory.items()},
                "by_kind_ms": dict(sorted(self.by_kind_ms.items())),
                "by_category_ms": {c: dict(p) for c, p in self.by_category_ms.items()},
                "kernels_by_category": dict(self.kernels_by_category),
                "gpu_idle_ms": 1e3 * max(self.step_s - self.gpu_busy_s, 0.0)}


def dispatch_costs(calibration: Calibration | None) -> dict[str, float]:
    d = dict(DEFAULT_DISPATCH)
    if calibration is not None:
        for key in ("eager_op_s", "eager_view_op_s", "eager_bwd_op_s"):
            value = getattr(calibration, key, None)
            if value:
                d[key] = float(value)
    # An EmbeddingBag is one graph node but many kernels: its dense-gradient backward
    # launches ~30 (fill, radix-sort passes, scan, segment sums), so its CPU time is
    # ~20x a one-kernel autograd node. Measured where the calibration has dispatch-bound
    # lookups; else as that many one-kernel ops.
    emb = {ph: calibration.embedding_dispatch_s(ph) if calibration is not None else None
           for ph in ("fwd", "bwd")}
    d["embedding_fwd_s"] = max(emb["fwd"] or 2 * d["eager_op_s"], d["eager_op_s"])
    d["embedding_bwd_s"] = max(emb["bwd"] or EMBEDDING_BWD_KERNELS * d["eager_bwd_op_s"],
                               d["eager_bwd_op_s"])
    return d


def syncs_host(node: fx.Node) -> bool:
    """Whether eager CUDA runs this node with a device-to-host sync (HOST_SYNC_OPS; the
    tensor-repeats overloads of repeat_interleave)."""
    target = node.target
    name = getattr(getattr(target, "overloadpacket", None), "__name__", None) \
        or getattr(target, "__name__", "")
    if name == "repeat_interleave":
        args = list(node.args) + list(node.kwargs.values())
        return any(isinstance(a, fx.Node) for a in args[1:2]) or \
            getattr(target, "_overloadname", "") == "Tensor"
    return name in HOST_SYNC_OPS


def _params(gm: fx.GraphModule) -> tuple[float, int, str]:
    """(numel, tensors, dtype name) of the graph's trainable parameters."""
    from .op_cost import dtype_name
    numel, count, dtype = 0.0, 0, "fp32"
    for node in gm.graph.nodes:
        if node.op != "placeholder" or ir.kind_of(node) is not OpKind.PARAM:
            continue
        dt = ir.dtype_of(node)
        if dt is None or not dt.is_floating_point:
            continue  # integer buffers
        vals = ir.tensor_vals(node)
        if vals and not getattr(vals[0], "requires_grad", True):
            continue
        numel += sum(v.numel() for v in vals)
        count += 1
        dtype = dtype_name(dt)
    return numel, count, dtype


def predict_eager_step(gm: fx.GraphModule, gpu: GPUSpec, calibration: Calibration | None, *,
                       optimizer: str = "adamw") -> EagerStepPrediction:
    """Eager single-GPU fwd + bwd + optimizer step of an annotated graph."""
    disp = dispatch_costs(calibration)
    cpu = gpu_t = 0.0
    busy = 0.0
    sources: set[str] = set()
    by_kind: dict[str, float] = {}
    by_cat: dict[str, dict[str, float]] = {c: dict.fromkeys(PHASES, 0.0) for c in CATEGORIES}
    n_kernels: dict[str, int] = dict.fromkeys(CATEGORIES, 0)

    def account(kind: OpKind, phase: str, seconds: float, kernels: int) -> None:
        cat = category_of(kind, phase)
        if cat is not None and (seconds > 0 or kernels > 0):
            by_cat[cat][phase] += 1e3 * seconds
            n_kernels[cat] += kernels

    backward: list[tuple[float, float]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue  # getitem unpacks a tuple in Python: no dispatch, no kernel
        kind = ir.kind_of(node) or OpKind.OTHER
        cost = node_cost(node, gpu, calibration, eager=True)
        if cost.source != "free":
            sources.add(cost.source)
        is_view = kind is OpKind.VIEW or cost.source == "free"
        is_emb = kind is OpKind.EMBEDDING
        if syncs_host(node):
            cpu = max(cpu, gpu_t)  # the host waits for the queue to drain
        cpu += disp["eager_view_op_s"] if is_view else \
            disp["embedding_fwd_s"] if is_emb else disp["eager_op_s"]
        gpu_t = max(gpu_t, cpu) + cost.fwd_s
        busy += cost.total_s
        by_kind[kind.value] = by_kind.get(kind.value, 0.0) + 1e3 * cost.total_s
        account(kind, "fwd", cost.fwd_s, cost.fwd_kernels)
        account(kind, "bwd", cost.bwd_s, cost.bwd_kernels)
        dt = ir.dtype_of(node)
        if dt is not None and dt.is_floating_point:
            bwd_cpu = disp["embedding_bwd_s"] if is_emb else \
                disp["eager_bwd_op_s"] * (0.5 if is_view else 1.0)
            backward.append((bwd_cpu, cost.bwd_s))
    forward_end = gpu_t
    for bwd_cpu, bwd_gpu in reversed(backward):
        cpu += bwd_cpu
        gpu_t = max(gpu_t, cpu) + bwd_gpu
    backward_end = gpu_t
    numel, tensors, dtype = _params(gm)
    opt_gpu, opt_source = optimizer_time(optimizer, numel, dtype, gpu, calibration, fused=False,
                                         tensors=tensors)
    sources.add(opt_source)
    cpu += _OPT_PASSES * (disp["eager_op_s"] + tensors * disp["foreach_tensor_s"])
    gpu_t = max(gpu_t + opt_gpu, cpu)
    busy += opt_gpu
    by_kind["optimizer"] = 1e3 * opt_gpu
    by_cat["optimizer"]["opt"] = 1e3 * opt_gpu
    n_kernels["optimizer"] = _OPT_PASSES * max(1, tensors // 24)

    saved = saved_activation_bytes(gm, runtime=False)  # eager: captured dtypes, padded
    inputs = float(saved.pop("inputs", 0))
    elt = {"fp32": 4, "bf16": 2, "fp16": 2}.get(dtype, 4)
    memory = eager_peak_bytes(numel * elt, float(sum(saved.values())), optimizer=optimizer,
                              input_bytes=inputs)
    return EagerStepPrediction(
        step_s=gpu_t, gpu_busy_s=busy, cpu_s=cpu, forward_s=forward_end,
        backward_s=backward_end - forward_end, optimizer_s=gpu_t - backward_end,
        cost_model="calibrated" if sources <= {"calibrated"} and calibration is not None
        else "roofline",
        memory=memory, by_kind_ms=by_kind, by_category_ms=by_cat,
        kernels_by_category=n_kernels)

"""Forward and backward time of one op: roofline times measured efficiency.

    t = max(FLOPs / (peak[dtype] · e_compute), bytes / (HBM bandwidth · e_memory))
        + kernels · launch gap

The efficiencies e come from the calibration file, interpolated over the op's shape (GEMM
by M, N, K and dtype; attention by batch·heads, lengths, head dim; embedding lookups by
row bytes, bag size, rows, lookups; memory-bound ops by bytes). Without a calibration the
typical efficiencies below stand in and the cost's ``source`` says "roofline", so a plan
can tell its reader how far to trust it. Since every e ≤ 1, a predicted time is never
below FLOPs/peak nor bytes/bandwidth.

Backward rules: GEMM = its two backward GEMMs (dgrad, wgrad: 2x forward FLOPs); attention
≈ 2.5x forward FLOPs (FlashAttention-2); embedding = gradient sort + scatter (+ the dense
zero-filled gradient of eager PyTorch, or the fused optimizer update of the touched rows
in a TorchRec-style kernel); pointwise, norm, index ≈ 2x forward bytes; loss and
reduction ≈ 1x; views and placeholders are free; ops on integer tensors have no backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from gemc import ir
from gemc.contended_gather import contended_gather
from gemc.ir import OpKind

from . import attention_fit, kernels
from .hardware import GPUSpec

if TYPE_CHECKING:
    from .calibration import Calibration

# Typical achieved fractions of peak on Hopper, for when nothing is calibrated: cuBLAS
# reaches ~70% of dense BF16 peak on large GEMMs, FlashAttention-2 ~35-50% forward and
# ~30-40% backward (Dao 2023), streaming kernels ~75-85% of HBM bandwidth, random row
# gathers ~40%.
ROOFLINE_EFFICIENCY = {"gemm": 0.70, "attention_fwd": 0.45, "attention_bwd": 0.35,
                       "memory": 0.75, "embedding": 0.40}
DEFAULT_KERNEL_LAUNCH_S = 2.5e-6  # gap between back-to-back kernels on one stream
MIN_EFFICIENCY = 1e-3

_FREE = (OpKind.VIEW, OpKind.INPUT, OpKind.PARAM, OpKind.OUTPUT, OpKind.COMM)
_BWD_BYTES = {OpKind.POINTWISE: 2.0, OpKind.NORM: 2.0, OpKind.INDEX: 2.0, OpKind.LOSS: 1.0,
              OpKind.REDUCTION: 1.0, OpKind.OTHER: 1.0}
# kernels the backward of one op launches (also gemc.costing's launch count)
BWD_KERNELS = {OpKind.GEMM: 2, OpKind.ATTENTION: 3, OpKind.EMBEDDING: 3, OpKind.NORM: 2,
               OpKind.POINTWISE: 1, OpKind.INDEX: 2, OpKind.LOSS: 1, OpKind.REDUCTION: 1,
               OpKind.OTHER: 1}


@dataclass(frozen=True)
class OpCost:
    """Seconds of one node's forward and backward kernels on one GPU."""

    fwd_s: float
    bwd_s: float
    source: str            # "calibrated", "fitted" (attention_fit), "roofline" or "free" (views, ...)
    fwd_kernels: int = 1
    bwd_kernels: int = 0

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def total_ms(self) -> float:
        return 1e3 * self.total_s


FREE = OpCost(0.0, 0.0, "free", 0, 0)


def dtype_name(dtype: torch.dtype | str | None) -> str:
    """'bf16', 'fp16', 'fp32', 'fp8' (float64 and unknown float types price as fp32)."""
    if dtype is None:
        return "fp32"
    if isinstance(dtype, str):
        from .hardware import DTYPE_ALIASES
        return DTYPE_ALIASES.get(dtype.removeprefix("torch.").lower(), "fp32")
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if "float8" in str(dtype):
        return "fp8"
    return "fp32"


def element_size(dtype: str) -> int:
    return {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}.get(dtype, 4)


def _factor(calibration: Calibration | None, kind: str) -> float:
    """The run-fitted multiplier of an op kind (1 without a calibration or a fit)."""
    return calibration.factor(kind) if calibration is not None else 1.0


def _launch(calibration: Calibration | None) -> float:
    return calibration.kernel_s if calibration is not None else DEFAULT_KERNEL_LAUNCH_S


def roofline_time(flops: float, nbytes: float, peak_flops: float, bandwidth: float, *,
                  compute_efficiency: float = 1.0, memory_efficiency: float = 1.0) -> float:
    """max(compute time, memory time) at the given fractions of peak."""
    ce = max(compute_efficiency, MIN_EFFICIENCY)
    me = max(memory_efficiency, MIN_EFFICIENCY)
    return max(flops / (peak_flops * ce) if flops > 0 else 0.0,
               nbytes / (bandwidth * me) if nbytes > 0 else 0.0)


def gemm_time(batch: int, m: int, n: int, k: int, dtype: str, gpu: GPUSpec,
              calibration: Calibration | None) -> tuple[float, str]:
    """One (batched) GEMM, launch gap included; past the calibration's largest measured
    shape see :func:`_gemm_beyond_s`. An fp32 GEMM is priced at TF32 where the plan runs
    fp32 matmuls on TF32 (``gpu.fp32_matmul``)."""
    dtype = gpu.gemm_dtype(dtype)
    span = calibration.gemm_span(dtype) if calibration is not None and batch == 1 else None
    if span is not None and (m > span[0][0] or n > span[0][1] or k > span[0][2]):
        t = _gemm_beyond_s(m, n, k, dtype, gpu, calibration, span)
        return t * _factor(calibration, "gemm"), "calibrated"
    return _gemm_s(batch, m, n, k, dtype, gpu, calibration)


def _gemm_s(batch: int, m: int, n: int, k: int, dtype: str, gpu: GPUSpec,
            calibration: Calibration | None, *, factor: bool = True) -> tuple[float, str]:
    eff = None
    if calibration is not None:
        eff = calibration.gemm_efficiency(batch * m, n, k, dtype)
    source = "calibrated" if eff is not None else "roofline"
    if eff is None:
        eff = ROOFLINE_EFFICIENCY["gemm"]
    mem_eff = ROOFLINE_EFFICIENCY["memory"]
    t = roofline_time(kernels.gemm_flops(batch, m, n, k),
                      kernels.gemm_bytes(batch, m, n, k, element_size(dtype)),
                      gpu.peak_flops(dtype), gpu.hbm_bandwidth,
                      compute_efficiency=eff, memory_efficiency=mem_eff)
    t += _launch(calibration)
    return (t * _factor(calibration, "gemm") if factor else t), source


def _gemm_beyond_s(m: int, n: int, k: int, dtype: str, gpu: GPUSpec,
                   calibration: Calibration, span: tuple[tuple[int, int, int], float]) -> float:
    """Seconds of a GEMM larger than any measured along some dimension: the time at the
    largest measured size of that dimension plus the marginal time per unit of it (between
    a quarter of that size and it), oriented with M >= N (cuBLAS computes the transpose at
    the same cost and the calibration measures M furthest), and never below the roofline
    at the best measured efficiency. Why: the efficiency interpolated in log space held
    the per-kernel fixed cost of a 32,768-row GEMM over a million rows; DIN's two MLP
    GEMMs of 1,048,576 x 512/256 x 512 were priced 7.0 ms forward and backward, where the
    H200 profile shows 4.3 ms for all of its GEMMs (data/s8 profiles)."""
    if n > m:
        m, n = n, m
    (cap_m, cap_n, cap_k), best = span
    dims, caps = [m, n, k], [cap_m, cap_n, cap_k]
    axis = max(range(3), key=lambda i: dims[i] / caps[i])
    if dims[axis] <= caps[axis]:
        return _gemm_s(1, m, n, k, dtype, gpu, calibration, factor=False)[0]
    hi, lo = list(dims), list(dims)
    hi[axis], lo[axis] = caps[axis], max(1, caps[axis] // 4)
    t_hi = _gemm_beyond_s(*hi, dtype, gpu, calibration, span)
    t_lo = _gemm_beyond_s(*lo, dtype, gpu, calibration, span)
    slope = max(0.0, (t_hi - t_lo) / (hi[axis] - lo[axis]))
    t = t_hi + (dims[axis] - caps[axis]) * slope
    floor = roofline_time(kernels.gemm_flops(1, m, n, k),
                          kernels.gemm_bytes(1, m, n, k, element_size(dtype)),
                          gpu.peak_flops(dtype), gpu.hbm_bandwidth, compute_efficiency=best,
                          memory_efficiency=ROOFLINE_EFFICIENCY["memory"])
    return max(t, floor + _launch(calibration))


def attention_time(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                   causal: bool, dtype: str, gpu: GPUSpec,
                   calibration: Calibration | None, *,
                   masked: bool = False) -> tuple[float, float, str]:
    """(forward s, backward s, source) of fused scaled-dot-product attention; ``masked``:
    with an attn_mask. A masked bf16 / fp16 call is priced by the law fitted to the
    session-25 H100 run (``attention_fit.masked_sdpa_s``: the calibration's masked curve,
    interpolated by flops efficiency, priced SASRec/BST's d=32 attention 3.7x under its
    measurement), except at a shape the calibration measured itself (its record wins);
    split forward : backward as their flops, 1 : 2.5."""
    if masked and dtype in ("bf16", "fp16"):
        measured = calibration.masked_attention_s(batch, heads, q_len, kv_len, head_dim,
                                                  dtype) if calibration is not None else None
        if measured is not None:
            total, source = measured, "calibrated"
        else:
            total = attention_fit.masked_sdpa_s(batch, heads, q_len, kv_len, head_dim, gpu,
                                                dtype)
            total += _launch(calibration) * 4
            source = "fitted"
        total *= _factor(calibration, "attention")
        share = 1.0 / (1.0 + kernels.ATTENTION_BWD_FLOPS)
        return total * share, total * (1.0 - share), source
    flops = kernels.attention_flops(batch, heads, q_len, kv_len, head_dim, causal)
    nbytes = kernels.attention_bytes(batch, heads, q_len, kv_len, head_dim, element_size(dtype))
    peak = gpu.peak_flops(dtype)
    out: list[float] = []
    source = "calibrated"
    for phase, mult in (("fwd", 1.0), ("bwd", kernels.ATTENTION_BWD_FLOPS)):
        eff = None
        if calibration is not None:
            eff = calibration.attention_efficiency(batch * heads, q_len, kv_len, head_dim,
                                                   causal, dtype, phase, masked=masked)
        if eff is None:
            eff = ROOFLINE_EFFICIENCY[f"attention_{phase}"]
            source = "roofline"
        t = roofline_time(flops * mult, nbytes * (2.0 if phase == "bwd" else 1.0), peak,
                          gpu.hbm_bandwidth, compute_efficiency=eff,
                          memory_efficiency=ROOFLINE_EFFICIENCY["memory"])
        out.append((t + _launch(calibration) * (1 if phase == "fwd" else 3))
                   * _factor(calibration, "attention"))
    return out[0], out[1], source


def jagged_attention_time(batch: int, heads: int, max_len: int, head_dim: int, causal: bool,
                          dtype: str, fill: float, gpu: GPUSpec,
                          calibration: Calibration | None, *, bias_numel: float = 0.0,
                          bias_itemsize: int = 4, kind: str = "softmax") -> float:
    """Forward+backward seconds of gemc's jagged attention kernel
    (``backends/triton/jagged_attention``, softmax or SiLU) over ``batch`` sequences padded
    to ``max_len`` and filled ``fill``: the fused attention's time at the padded shape
    times the fill (its work is over the real tokens: E[len^2] / L^2 <= fill), plus with a
    score bias (``bias_numel`` elements as stored, broadcast to ``[B, H, L, L]`` for the
    kernel) the bias's traffic: every head reads it over the real tokens in the forward
    and in the two backward kernels; its fp32 gradient ``[B, H, L, L]`` is zero-filled
    whole, written over the real tokens, cast back to a narrower bias dtype, and summed
    down to the stored shape (the broadcast's backward).
    Why: the SiLU kernel (HSTU) was priced as its padded op-by-op formula times the fill,
    4.1 ms a layer at HSTU's h200 preset, where the kernel measured as fast as the jagged
    softmax one at the same size (7.35 vs 7.76 ms fwd+bwd, B=4096, L=512, H=4, d=64:
    benchmarks/results/kernels_attention_h200.json, no bias); with HSTU's fp32 bias this
    prices ~0.3 ms of attention and ~0.8 ms of bias traffic a layer.
    In bf16 / fp16 (``kind`` ``softmax`` or ``silu``) the kernels' work is the law fitted
    to the session-25 H100 run instead (``attention_fit``: the real tokens' tiles at the
    kernel family's measured rate; the fused attention times the fill priced MMoE's
    kernel at 0.65 ms where it took 1.71), plus its launches."""
    if dtype in ("bf16", "fp16"):
        scores = attention_fit.jagged_tiles(batch, heads, max_len, fill, causal)
        t = (attention_fit.gemc_kernel_s(scores, head_dim, kind, gpu, dtype)
             + 4 * _launch(calibration)) * _factor(calibration, "attention")
    else:
        fwd, bwd, _ = attention_time(batch, heads, max_len, max_len, head_dim, causal, dtype,
                                     gpu, calibration)
        t = (fwd + bwd) * fill
    if bias_numel > 0:
        full = float(batch) * heads * max_len * max_len
        moved = full * (3.0 * bias_itemsize * fill + 4.0 + 4.0 * fill)
        if bias_itemsize < 4:
            moved += full * (4.0 + bias_itemsize)
        if bias_numel < full:
            moved += full * bias_itemsize + bias_numel * bias_itemsize
        m, _ = memory_time(moved, gpu, calibration, "copy")
        t += m
    return t


def memory_time(nbytes: float, gpu: GPUSpec, calibration: Calibration | None,
                curve: str = "pointwise", flops: float = 0.0,
                dtype: str = "fp32") -> tuple[float, str]:
    """A streaming (memory-bound) kernel moving nbytes, launch gap included."""
    if nbytes <= 0 and flops <= 0:
        return _launch(calibration), "roofline" if calibration is None else "calibrated"
    eff = calibration.memory_efficiency(curve, nbytes, dtype) if calibration is not None \
        else None
    source = "calibrated" if eff is not None else "roofline"
    if eff is None:
        eff = ROOFLINE_EFFICIENCY["memory"]
    t = roofline_time(flops, nbytes, gpu.fp32_flops, gpu.hbm_bandwidth,
                      compute_efficiency=0.5, memory_efficiency=eff)
    return (t + _launch(calibration)) * _factor(calibration, "memory"), source


def embedding_time(rows: int, dim: int, nnz: int, bags: int, dtype: str, gpu: GPUSpec,
                   calibration: Calibration | None, *, dense_grad: bool = False,
                   optimizer: str | None = "adamw") -> tuple[float, float, str]:
    """(forward s, backward s, source) of a pooled lookup of nnz ids into bags.

    ``dense_grad``: eager PyTorch's EmbeddingBag(sparse=False) backward, which zero-fills a
    gradient the size of the table (the optimizer then runs over all rows, priced
    separately). Otherwise a fused TBE-style backward that applies ``optimizer`` to the
    touched rows only (``None``: gradient only)."""
    elt = element_size(dtype)
    fwd_bytes = kernels.embedding_fwd_bytes(nnz, dim, bags, elt)
    bwd_bytes = kernels.embedding_bwd_bytes(nnz, dim, bags, rows, elt, dense_grad=dense_grad)
    if not dense_grad and optimizer:
        touched = kernels.expected_unique_rows(rows, nnz)
        bwd_bytes += kernels.optimizer_bytes(optimizer, touched * dim, elt, fused=True)
    bag_size = nnz / max(bags, 1)
    effs = []
    for phase in ("fwd", "bwd"):
        eff = None
        if calibration is not None:
            eff = calibration.embedding_efficiency(dim * elt, bag_size, rows, nnz, phase,
                                                   dtype)
        effs.append(eff)
    source = "calibrated" if all(e is not None for e in effs) else "roofline"
    e_fwd = effs[0] if effs[0] is not None else ROOFLINE_EFFICIENCY["embedding"]
    e_bwd = effs[1] if effs[1] is not None else ROOFLINE_EFFICIENCY["embedding"]
    launch = _launch(calibration)
    fwd = roofline_time(float(nnz * dim), fwd_bytes, gpu.fp32_flops, gpu.hbm_bandwidth,
                        memory_efficiency=e_fwd) + launch
    bwd = roofline_time(float(nnz * dim), bwd_bytes, gpu.fp32_flops, gpu.hbm_bandwidth,
                        memory_efficiency=e_bwd) + 3 * launch
    f = _factor(calibration, "embedding")
    return fwd * f, bwd * f, source


# The batched lookup kernel's price (gemc.backends.triton.embedding_bag, forward + fused
# backward + row-wise Adagrad), fitted to one shard's measured step on an H100 (twenty-first
# session, ``python benchmarks/fit_lookup_price.py``; data benchmarks/results/lookup_price_s21:
# 40M and 2.5M rows, 16-128 wide, 1.6M and 6.6M ids: one pass -11% to +19% on 12 points,
# two phases -4% to +12% on 9). Two terms, both in HBM-equivalent bytes so that they
# scale with the GPU's bandwidth (an assumption: only the H100 was measured):
# - the byte count below (rows gathered, pooled outputs, gradients, touched rows' update)
#   moves at BATCHED_LOOKUP_EFFICIENCY of HBM: the count is an upper bound (the fused kernel
#   keeps part of it in registers), so the fitted share is ~1;
# - every id costs BATCHED_ID_BYTES more (its launch group's sort, run heads and the per-id
#   gradient rows' ordered reads: ~0.64 ns an id on the H100), whatever the width. Before,
#   only 3 index reads an id were charged: a 16-column shard of a 40M-row table at 6.6M ids
#   measured 5.19 ms against 2.23 priced (and 128 columns 12.4 against 16.8), so column
#   shards, which each see every id of their table, were priced as if narrow were cheap.
# - a column shard's second phase (``split_squares``: the squares pass, written per id and
#   read back by the update) costs BATCHED_SPLIT_ID_BYTES an id more: 0.60-0.66 ns measured
#   at every width (9.15 ms against 5.19 for the 16-column shard above).
BATCHED_LOOKUP_EFFICIENCY = 1.0
BATCHED_ID_BYTES = 2200.0
BATCHED_SPLIT_ID_BYTES = 2180.0


def batched_embedding_bytes(rows: int, dim: int, nnz: int, bags: int, dtype: str,
                            optimizer: str | None, storage_bytes: float | None = None
                            ) -> float:
    """HBM bytes one table moves in a batched lookup kernel, forward and fused backward +
    ``optimizer`` (see :func:`batched_embedding_time`), without the per-id terms."""
    elt = element_size(dtype)
    narrower = 0.0 if storage_bytes is None else elt - storage_bytes
    touched = kernels.expected_unique_rows(rows, nnz)
    nbytes = kernels.embedding_fwd_bytes(nnz, dim, bags, elt) - float(nnz) * dim * narrower \
        + kernels.embedding_bwd_bytes(nnz, dim, bags, rows, elt, dense_grad=False)
    if optimizer:
        nbytes += kernels.optimizer_bytes(optimizer, touched * dim, elt, fused=True) \
            - 2.0 * touched * dim * narrower  # the weight rows' read and write
    # whole sectors: every gathered row, and the touched rows the update reads and writes
    waste = kernels.row_sector_waste(dim, elt - narrower)
    return nbytes + float(nnz) * waste + (2.0 * touched * waste if optimizer else 0.0)


def batched_embedding_time(rows: int, dim: int, nnz: int, bags: int, dtype: str,
                           gpu: GPUSpec, calibration: Calibration | None,
                           optimizer: str | None, storage_bytes: float | None = None,
                           split_squares: bool = False) -> float:
    """Seconds one table adds to a batched lookup kernel (every table of a rank in one
    forward and one fused backward+optimizer launch: the runner's
    ``gemc.backends.triton.embedding_bag``, and TorchRec's TBE): its bytes
    (:func:`batched_embedding_bytes`) and its ids' fixed work, priced as fitted on the
    kernel itself (BATCHED_* above), no launch of its own (the rank's kernel floor is
    step_model.batched_floor_s). Why not the calibrated curve: that is measured on eager
    EmbeddingBag, one table at a time with a dense gradient (~30 CPU-launched kernels
    each), and priced the GEM h200 plan's 102 tables at 22 ms where the batched kernels
    measured ~5 ms. A run-fitted ``embedding`` factor corrects the result
    (``gemc calibrate --from-run``).

    ``split_squares``: the table is a column shard under row-wise Adagrad, updated in two
    phases (its squares first, summed over the row's shards); the second phase's per-id
    work is added (its all-reduce is a collective, priced where it is placed).

    ``storage_bytes``: bytes of one stored weight element when the table is stored narrower
    than ``dtype`` (bf16 / fp8 storage, gemc.table_precision): the gathered rows and the
    updated rows' read and write move that many; outputs, gradients and the fp32 optimizer
    state do not change. Weight rows move in whole 32-byte sectors
    (kernels.row_sector_waste): a bf16 8-wide column shard's 16-byte row costs a sector."""
    nbytes = batched_embedding_bytes(rows, dim, nnz, bags, dtype, optimizer, storage_bytes)
    nbytes += float(nnz) * (BATCHED_ID_BYTES + (BATCHED_SPLIT_ID_BYTES if split_squares
                                                else 0.0))
    t = nbytes / (gpu.hbm_bandwidth * BATCHED_LOOKUP_EFFICIENCY)
    return t * _factor(calibration, "embedding")


# kernels the sparse optimizer launches to sum a sparse gradient's rows without a sync
# (sparse_optim.summed_rows: the padding keys, the sort, the run heads and their numbers,
# the zeroed slots, the ordered gather, the add, the run keys, the distinct count, the
# slot gathers; counted from the code) and the guards the row update adds around them
_SUMMED_ROWS_KERNELS = 20
# a narrower-stored table's: the unique of its ids, the gradients' concatenation and sum
_NARROW_ROWS_KERNELS = 10
# Host seconds a lookup called out of the compiled graph adds (graph mode's SPARSE route,
# a ``torch._dynamo.disable``d call of the table module): four transitions between
# compiled pieces (out of and back into the graph, forward and backward), each a guard
# check, AOTAutograd's runtime wrapper and an autograd node, ~40 us of Python each. An
# estimate, not measured in isolation (GEM's two routed tables and DIN's 18 do not
# separate it from the routes' device time).
ROUTED_LOOKUP_S = 1.5e-4
# CPU seconds one eager op takes to issue when the calibration has no measurement
# (cost_model/eager.py's default)
DEFAULT_EAGER_OP_S = 8e-6


def eager_table_time(path: str, rows: int, dim: int, nnz: int, bags: int, lookups: int,
                     dtype: str, gpu: GPUSpec, calibration: Calibration | None,
                     optimizer: str | None, storage_bytes: float | None = None,
                     replicas: int = 1, hot_ids: float = 0.0) -> tuple[float, float, float]:
    """(forward s, backward s, optimizer s) of a table the runner looks up outside the
    batched kernel (``path``: gemc.table_lookup's ``sparse`` or ``dense_grad``), from the
    bytes it moves (kernels.eager_lookup_bytes, kernels.eager_update_bytes) and its
    launches. Contiguous passes (zero-fills, whole-gradient scans, the row update's
    elementwise ops) stream at the calibrated memory efficiency; gathers and scatters of
    rows at ``ROOFLINE_EFFICIENCY["embedding"]``, as the batched kernel's. ``replicas``:
    a data-parallel table's replica count: on several, its step is the bucketed one
    (sparse_optim.ReplicaBucket, kernels.replica_update_bytes): its rows added into the
    step's bucket and one masked pass over the table, no sync (the bucket's all-reduce is
    priced once a step with the communication, step_model.replica_all_reduce_s).

    The optimizer step is eager and table by table: a table's step takes the longer of its
    device time and issuing its kernels (``eager_op_s`` each). On ``dense_grad`` it is one
    masked pass over the table-sized gradient (one kernel); on ``sparse`` the gradient's
    rows are summed by sort and segment and updated in ATen ops. Neither waits on the
    device, except a table stored narrower (the unique of its ids): one issue after
    that sync while the GPU waits. Why priced by path: DIN's 16 weighted bags of 1M rows each pay a
    read of their 0.26 GB dense gradient for ~40k touched rows; priced as the fused
    kernel (no gradient at all) its tables came to 2.5 ms of a 39 ms step predicted at
    18.6 ms.

    ``hot_ids``: lookups of the table's most looked-up row a step
    (kernels.hottest_row_ids; the caller passes 0 for a pooled dense-gradient lookup, whose
    ATen backward sorts its ids instead of adding them atomically). The sparse path adds
    one row's duplicates into one slot (kernels.COALESCE_DUPLICATE_S each: measured on the
    coalesce it replaced, which summed them in sequence; the add's contended atomics are
    not measured yet); an unpooled lookup's dense gradient (Inductor's atomic scatter) adds
    them one after another too: its scatter takes the longer of its bytes and that chain
    (kernels.DENSE_GRAD_HOT_ADD_S, measured on DIN's history tables). Why: DIN's padded histories put
    half a million ids on one pad row; priced by bytes alone, its sparse route came to
    22.5 ms against 318 ms measured."""
    elt = element_size(dtype)
    launch = _launch(calibration)
    rows_eff = ROOFLINE_EFFICIENCY["embedding"]
    bw = gpu.hbm_bandwidth

    def stream_s(nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        t, _ = memory_time(nbytes, gpu, calibration, "pointwise")
        return t / _factor(calibration, "memory") - launch  # launches counted below

    looked = kernels.eager_lookup_bytes(path, rows, dim, nnz, bags, lookups, elt)
    dense = path == "dense_grad"
    fwd_k = lookups if dense else 3 * lookups
    bwd_k = (2 * lookups + max(0, lookups - 1)) if dense else 3 * lookups
    fwd = looked["fwd_rows"] / (bw * rows_eff) + fwd_k * launch
    rows_s = looked["bwd_rows"] / (bw * rows_eff)
    if dense:  # the scatter of an unpooled lookup: its hottest row's adds in sequence
        rows_s = max(rows_s, hot_ids * kernels.DENSE_GRAD_HOT_ADD_S)
    bwd = stream_s(looked["bwd_stream"]) + rows_s + bwd_k * launch
    opt = 0.0
    if optimizer:
        narrow = storage_bytes is not None and storage_bytes < elt
        row_kernels = kernels.EAGER_ROW_UPDATE.get(optimizer.lower(), (0.0, 0))[1]
        if replicas > 1:  # the bucketed step (kernels.replica_update_bytes)
            upd = kernels.replica_update_bytes(rows, dim, nnz, optimizer, elt, replicas,
                                               storage_bytes)
            ops = kernels.REPLICA_KERNELS if not narrow else (
                _NARROW_ROWS_KERNELS + kernels.REPLICA_KERNELS - 1 + row_kernels
                + kernels.REPLICA_NARROW_EXTRA_KERNELS)
            # its ids' rows added into the table-sized segment: the dense gradient's
            # contended adds on the hottest row
            chain = hot_ids * kernels.DENSE_GRAD_HOT_ADD_S
        else:
            upd = kernels.eager_update_bytes(path, rows, dim, nnz, optimizer, elt,
                                             storage_bytes)
            ops = 1 if dense else (_NARROW_ROWS_KERNELS if narrow else _SUMMED_ROWS_KERNELS) \
                + row_kernels
            chain = 0.0 if dense else hot_ids * kernels.COALESCE_DUPLICATE_S
        device = stream_s(upd["stream"]) + upd["rows"] / (bw * rows_eff) + ops * launch \
            + chain
        issue = (calibration.eager_op_s if calibration is not None else None) \
            or DEFAULT_EAGER_OP_S
        syncs = 0 if dense else int(narrow)
        opt = max(device, ops * issue) + issue * syncs
    f = _factor(calibration, "embedding")
    return fwd * f, bwd * f, opt * f


def optimizer_time(optimizer: str, numel: float, dtype: str, gpu: GPUSpec,
                   calibration: Calibration | None, *, fused: bool = False,
                   tensors: int = 1) -> tuple[float, str]:
    """One optimizer step over numel parameters (torch's foreach implementation unless
    fused). foreach launches one kernel per op per chunk of tensors. Calibrated from the
    measurement of the parameters' dtype where the file has one ("adamw_foreach_bf16"),
    else the fp32 one at the same parameter bytes."""
    elt = element_size(dtype)
    if calibration is not None and not fused and optimizer.lower() == "adamw":
        rate = None
        if dtype != "fp32":
            rate = calibration.optimizer_param_rate(f"adamw_foreach_{dtype}", numel * elt)
        rate = rate or calibration.optimizer_param_rate("adamw_foreach", numel * elt)
        if rate:
            return (numel * elt / rate + _launch(calibration) * 8 * max(1, tensors // 24)) \
                * _factor(calibration, "optimizer"), "calibrated"
    t, source = memory_time(kernels.optimizer_bytes(optimizer, numel, elt, fused=fused), gpu,
                            calibration, "copy")
    n_kernels = 1 if fused else 8 * max(1, tensors // 24)
    t /= _factor(calibration, "memory")  # memory_time applied it; optimizers have their own
    return (t + _launch(calibration) * (n_kernels - 1)) * _factor(calibration, "optimizer"), \
        source


def gather_rows_backward_time(weight: fx.Node, index: fx.Node,
                               calibration: Calibration | None) -> float:
    """Seconds of the backward of a gather the runner sends through ``gemc::gather_rows``
    (gemc.contended_gather): the weight's gradient zeroed, then ``_row_sums_kernel`` at its
    measured rate per id and row element (kernels.ROW_SUMS_S_PER_ID). Why not by bytes: the
    kernel is bound by its compare of ids against rows; priced as a scatter of its bytes,
    HSTU's 16 such backwards came to ~1.5 ms of a step that spent 13.4 ms in them. Fewer
    rows than ``MIN_IDS_PER_ROW`` ids each do not take this route: plain atomics, priced by
    bytes (the contention that made the route necessary is no longer paid)."""
    w, ix = weight.meta["val"], index.meta["val"]
    width = int(w.numel()) // max(1, int(w.shape[0]))
    t = float(ix.numel()) * width * kernels.ROW_SUMS_S_PER_ID + 2 * _launch(calibration)
    return t * _factor(calibration, "memory")


# ---- fx nodes ---------------------------------------------------------------------------
def jagged_silu_kernel_time(facts: Mapping[str, Any], output: fx.Node,
                            named: Mapping[str, fx.Node], dtype: str,
                            itemsize: Callable[[fx.Node], int], gpu: GPUSpec,
                            calibration: Calibration | None, in_region: bool = False
                            ) -> float:
    """Forward+backward seconds of one matched SiLU attention (match-silu-attention's
    ``facts`` on its ``output`` node; ``named``: the graph's nodes by name) run as the
    jagged kernel in ``dtype``: ``jagged_attention_time`` with its bias, plus the guard's
    read of the key mask (or offsets) and the padded <-> jagged copies of q, k, v, the
    output and their gradients (16 passes over the output's size), each tensor at
    ``itemsize(node)`` bytes an element (the runner's: autocast, packed sizes). ``in_region``:
    the kernel runs inside a packed token region, on its tokens: no copies."""
    def numel(n: fx.Node | None) -> int:
        val = n.meta.get("val") if n is not None else None
        return int(val.numel()) if isinstance(val, torch.Tensor) else 0

    heads, length, head_dim = int(facts["heads"]), int(facts["max_len"]), int(facts["head_dim"])
    batch = max(1, round(numel(named.get(str(facts["q"]))) / max(1, heads * length * head_dim)))
    bias = named.get(str(facts.get("bias")))
    t = jagged_attention_time(batch, heads, length, head_dim, bool(facts.get("causal")), dtype,
                              float(facts.get("fill", 1.0)), gpu, calibration,
                              bias_numel=numel(bias),
                              bias_itemsize=itemsize(bias) if bias is not None else 4,
                              kind="silu")
    keys = named.get(str(facts.get("mask") or facts.get("offsets")))
    copies = numel(keys) * (itemsize(keys) if keys is not None else 0) \
        + (0.0 if in_region else 16.0 * numel(output) * itemsize(output))
    m, _ = memory_time(copies, gpu, calibration, "copy")
    return t + m


def _first_tensor_dtype(node: fx.Node) -> torch.dtype | None:
    for arg in node.all_input_nodes:
        dt = ir.dtype_of(arg)
        if dt is not None:
            return dt
    return ir.dtype_of(node)


def _has_attn_mask(node: fx.Node) -> bool:
    """An attention node with a mask: classify-ops' ``masked`` where it says, else a tensor
    as SDPA's attn_mask (4th argument; a float there is the flash op's dropout_p)."""
    a = node.meta.get(ir.ATTENTION) or {}
    if "masked" in a:
        return bool(a["masked"])
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return isinstance(mask, fx.Node)


def _has_backward(node: fx.Node) -> bool:
    dt = ir.dtype_of(node)
    return dt is None or dt.is_floating_point or dt.is_complex


def node_cost(node: fx.Node, gpu: GPUSpec, calibration: Calibration | None,
              dtype: str | torch.dtype | None = None, *, eager: bool = False,
              embedding_optimizer: str | None = "adamw") -> OpCost:
    """Forward and backward time of one annotated node (gemc.kind, flops, bytes, gemm,
    attention, table). ``dtype`` overrides the node's own (e.g. 'tf32' for fp32 GEMMs with
    TF32 allowed, or the precision pass's choice). ``eager`` prices embeddings as eager
    PyTorch runs them (dense gradient, optimizer separate)."""
    kind = ir.kind_of(node) or OpKind.OTHER
    if kind in _FREE or node.op in ("placeholder", "output", "get_attr"):
        return FREE
    dt = dtype_name(dtype) if dtype is not None else dtype_name(_first_tensor_dtype(node))
    backward = _has_backward(node)
    flops = float(node.meta.get(ir.FLOPS, 0) or 0)
    nbytes = float(node.meta.get(ir.BYTES, 0) or 0)

    if kind is OpKind.GEMM and node.meta.get(ir.GEMM):
        p = node.meta[ir.GEMM]
        fwd, source = gemm_time(p["batch"], p["m"], p["n"], p["k"], dt, gpu, calibration)
        bwd = 0.0
        if backward:
            for b, m, n, k in kernels.gemm_backward_problems(p["batch"], p["m"], p["n"], p["k"]):
                t, s = gemm_time(b, m, n, k, dt, gpu, calibration)
                bwd += t
                source = source if s == source else "roofline"
        return OpCost(fwd, bwd, source, 1, 2 if backward else 0)

    if kind is OpKind.ATTENTION and node.meta.get(ir.ATTENTION):
        a = node.meta[ir.ATTENTION]
        fwd, bwd, source = attention_time(a["batch"], a["heads"], a["q_len"], a["kv_len"],
                                          a["head_dim"], bool(a.get("causal")), dt, gpu,
                                          calibration, masked=_has_attn_mask(node))
        return OpCost(fwd, bwd if backward else 0.0, source, 1, 3 if backward else 0)

    if kind is OpKind.EMBEDDING and node.meta.get(ir.TABLE):
        t = node.meta[ir.TABLE]
        w_dtype = dtype_name(ir.dtype_of(node.args[0])) if isinstance(node.args[0], fx.Node) \
            else dt
        fwd, bwd, source = embedding_time(
            int(t["rows"]), int(t["dim"]), int(t["nnz"]), int(t.get("batch") or t["nnz"]),
            w_dtype, gpu, calibration, dense_grad=eager,
            optimizer=None if eager else embedding_optimizer)
        return OpCost(fwd, bwd if backward else 0.0, source, 1, 3 if backward else 0)

    if kind in (OpKind.GEMM, OpKind.ATTENTION):  # no shape facts: a compute-bound roofline
        eff = ROOFLINE_EFFICIENCY["gemm"]
        fwd = roofline_time(flops, nbytes, gpu.peak_flops(dt), gpu.hbm_bandwidth,
                            compute_efficiency=eff) + _launch(calibration)
        mult = 2.0 if kind is OpKind.GEMM else kernels.ATTENTION_BWD_FLOPS
        bwd = roofline_time(mult * flops, 2 * nbytes, gpu.peak_flops(dt), gpu.hbm_bandwidth,
                            compute_efficiency=eff) + 2 * _launch(calibration)
        return OpCost(fwd, bwd if backward else 0.0, "roofline", 1, 2 if backward else 0)

    if kind is OpKind.INDEX and backward:
        gather = contended_gather(node)
        if gather is not None:  # the runner's gemc::gather_rows
            fwd, source = memory_time(nbytes, gpu, calibration, "pointwise", flops, dt)
            return OpCost(fwd, gather_rows_backward_time(*gather, calibration), source, 1, 2)

    curve_fwd, curve_bwd = ("norm_fwd", "norm_bwd") if kind is OpKind.NORM else \
        ("pointwise", "pointwise")
    fwd, source = memory_time(nbytes, gpu, calibration, curve_fwd, flops, dt)
    bwd = 0.0
    n_bwd = 0
    if backward:
        mult = _BWD_BYTES.get(kind, 1.0)
        n_bwd = BWD_KERNELS.get(kind, 1)
        bwd, _ = memory_time(mult * nbytes, gpu, calibration, curve_bwd, mult * flops, dt)
        bwd += _launch(calibration) * (n_bwd - 1)
    return OpCost(fwd, bwd, source, 1, n_bwd)

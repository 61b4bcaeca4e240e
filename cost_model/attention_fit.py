"""Attention prices fitted to one GPU run: padded masked SDPA and gemc's attention kernels.

Why: the roofline-and-calibration prices of ``op_cost`` got the zoo's attentions wrong in
both directions (``benchmarks/attention_price_check.py`` on the session-25 H100 run): padded
masked cuDNN SDPA priced 2-7x under what it took, and gemc's kernel priced as the unmasked
fused attention times the fill, so a choice between the two (``passes/attention_choice``)
gave the GEM example's attentions to SDPA where the kernel measures 2-4x faster. This module
prices both from the terms that physically exist, with a few constants fitted to that run.

Source of every fitted constant: ``benchmarks/results/session25/kernels_zoo.json`` (fwd+bwd
``do_bench`` ms, bf16, one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0, gemc at
1ed8fc9; stored by commit 37512a4) and ``attention_gpu_time.log`` beside it (kernel and host
ms of one call, same machine). ``benchmarks/attention_price_check.py --fit`` recomputes them
from those files; the table it prints (priced beside measured, error per row) is in
BENCHMARKS.md, "Twenty-sixth session, helper s26-attnprice".

The terms (``E`` counts score elements over 64 x 64 tiles, the block both kernels work in):

* **padded masked SDPA** (cuDNN, the backend PyTorch picks for a bf16 masked call on Hopper):
  ``E_padded * (SDPA_MASKED_BYTES_PER_SCORE / HBM bandwidth + 14 d / (bf16 peak *
  SDPA_MASKED_EFFICIENCY))``. An explicit mask forbids skipping any tile (no causal saving)
  and costs per score element, whatever the head dim: the measured time per padded score
  element is 6.5-9.1 ps at head dims 32-128 (the flops per element grow 4x), so the mask's
  per-element traffic dominates and the matmuls add a small share. Bytes per element, not
  seconds, so the term scales with a GPU's bandwidth: the H200's own measurements
  (``cost_model/data/h200.json``'s ``attention_masked``; ``kernels_attention_h200.json``'s
  eager padded row) sit at 0.66-0.70x the H100's, its bandwidth ratio.
* **gemc's kernels** (``backends/triton``: the jagged softmax and SiLU kernels, the
  varlen-key kernel of a guarded attention): the work over the real tokens' tiles at an
  achieved fraction of the bf16 peak per kernel family, ``E_real * 14 d / (peak * eff)``.
  Per family because the two kernel families run at different rates
  (:data:`GEMC_SOFTMAX_EFFICIENCY`, :data:`GEMC_SILU_EFFICIENCY`); one rate over head dims
  because the measured time per tile element is proportional to ``d`` (5.1, 10.4 ps at d 32,
  64: a flops-bound kernel). ``E_real`` from the token fill ``f``: lengths uniform with mean
  ``f L`` (:func:`score_share`), each row rounded up to its tiles (half a tile on average).
* **host**: one call's launches and Python, measured (``attention_gpu_time.log``'s
  ``host_ms``): gemc's unsynced call (:data:`GEMC_CALL_HOST_S`) is issued while the GPU runs
  earlier work, so a step pays it only through its launch-bound term; a **guarded call**
  (``key_padding_attention``: a check and one host sync per call, then for a mask that is
  no prefix a stable sort and gathers of k and v, scattered back in the backward) drains
  the GPU queue, so its host time is exposed (:data:`GEMC_GUARDED_CALL_HOST_S`, fitted to
  TransAct's row, its only measurement: that row's error is nil by construction). Where a
  guarded packed region runs the attention on its tokens, the region's one check ahead of
  the graph decides and the call has no sync of its own.

Only bf16 / fp16 calls are priced here (the runner's autocast dtype, the dtype measured);
fp32 attentions keep ``op_cost``'s calibrated prices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import GPUSpec

TILE = 64
"""Score tile of the kernels priced here (gemc's blocks: 64 x 64 in the forward and the
key/value backward; cuDNN's sm90 bprop 64 x 64); a row's length rounds up to it."""

FLOPS_PER_SCORE = 14.0
"""Matmul flops per score element per head dim, forward + backward: 2 matmuls of 2 flops
forward, 2.5x that backward (``kernels.ATTENTION_BWD_FLOPS``)."""

SDPA_MASKED_BYTES_PER_SCORE = 19.09
"""Padded masked SDPA's HBM bytes per padded score element, fwd+bwd (the mask read as a
bias per head in the forward and backward, the boolean mask's conversion): fitted, with
:data:`SDPA_MASKED_EFFICIENCY`, by least squares on the relative error of the four cuDNN
rows of ``session25/kernels_zoo.json`` (see the module doc)."""

SDPA_MASKED_EFFICIENCY = 0.571
"""Padded masked SDPA's matmul rate as a share of the bf16 peak (fitted with the bytes
above: 565 TFLOP/s on the H100's 989.5)."""

GEMC_SOFTMAX_EFFICIENCY = 0.0888
"""gemc's jagged softmax kernel's achieved share of the bf16 peak over its tiles: fitted to
SASRec/BST's (d 32, 1.773 ms) and MMoE's (d 64, causal, 1.685 ms; graph replay 1.714) rows
(88 TFLOP/s). Also the varlen-key kernel's (the same Triton flash loop over kept keys)."""

GEMC_SILU_EFFICIENCY = 0.110
"""gemc's jagged SiLU kernel's share of the bf16 peak: HSTU's kernels by graph replay and
by profile (0.520 / 0.531 ms, ``attention_gpu_time.log``: its ``do_bench`` 1.544 ms is the
host's), d 128, causal (109 TFLOP/s)."""

GEMC_CALL_HOST_S = {"softmax": 1.113e-3, "silu": 1.396e-3}
"""Host seconds of one unsynced fwd+bwd call of gemc's attention op (autograd Function,
launch choice, Triton's launcher, 3-4 kernels): ``host_ms`` of MMoE's and HSTU's default
rows in ``attention_gpu_time.log`` (measured, not fitted; the same host's cProfile run of the
twenty-sixth session at d35e1d7, BENCHMARKS.md "Where gemc's attention spends its host
time", reads 1.09 / 1.41 ms)."""

SDPA_CALL_HOST_S = 0.354e-3
"""Host seconds of one fwd+bwd call of padded masked cuDNN SDPA (HSTU's row of the same
log; measured)."""

GEMC_GUARDED_CALL_HOST_S = 1.64e-3
"""Host seconds a guarded call exposes: its check, the sync, the compaction's sort and
gathers and the kernels' launches, issued with the GPU queue drained. Fitted to TransAct's
row (2.598 ms measured, its GPU work priced 0.96 ms: kernel 0.66, compaction 0.30), so
about the unsynced call's 1.11 ms plus 0.53 ms for the guard."""

SOURCE = ("fitted: benchmarks/results/session25/kernels_zoo.json + attention_gpu_time.log "
          "(H100, gemc 1ed8fc9, commit 37512a4)")


@dataclass(frozen=True)
class GemcAttentionPrice:
    """Seconds of one fwd+bwd call of gemc's attention op, by term."""

    kernel_s: float    # the kernels' work over the real tokens' tiles
    copies_s: float    # padded <-> jagged copies (outside a packed region) and compaction
    host_s: float      # the call's host time (launches, Python; a guarded call's check)
    guarded: bool      # a host sync per call: the host time is exposed

    @property
    def gpu_s(self) -> float:
        return self.kernel_s + self.copies_s

    @property
    def in_step_s(self) -> float:
        """What the call adds to a training step whose host runs ahead: its GPU work, and
        after a per-call sync its host time too (the queue is drained)."""
        return self.gpu_s + (self.host_s if self.guarded else 0.0)

    @property
    def isolated_s(self) -> float:
        """One call timed alone (``do_bench``): host and GPU overlap unless synced."""
        return self.gpu_s + self.host_s if self.guarded else max(self.gpu_s, self.host_s)


def score_share(fill: float) -> float:
    """``E[len^2] / L^2`` for a token fill ``f = E[len] / L``: lengths uniform on
    ``[0, 2 f L]`` up to ``f = 1/2`` (``4 f^2 / 3``), on ``[(2 f - 1) L, L]`` above
    (``(1 + r + r^2) / 3``, ``r = 2 f - 1``): the benchmarks' lengths, uniform in ``1..L``,
    at ``f = 1/2``; ``f = 1`` every row full."""
    f = min(1.0, max(0.0, float(fill)))
    if f <= 0.5:
        return 4.0 * f * f / 3.0
    r = 2.0 * f - 1.0
    return (1.0 + r + r * r) / 3.0


def tiled(length: int) -> int:
    """``length`` rounded up to whole tiles."""
    return TILE * math.ceil(max(1, length) / TILE)


def jagged_tiles(batch: int, heads: int, max_len: int, fill: float, causal: bool) -> float:
    """Score elements over the tiles a jagged self-attention computes: per row of length
    ``n``, ``(n + TILE/2)^2`` (causal: the tiles on and under the diagonal,
    ``m (m + TILE) / 2`` with ``m = n + TILE/2``), at most the padded row's tiles."""
    length = float(max_len)
    mean = min(1.0, max(0.0, fill)) * length
    half = TILE / 2.0
    second = score_share(fill) * length * length + 2.0 * half * mean + half * half
    per_row = (second + TILE * (mean + half)) / 2.0 if causal else second
    full = float(tiled(max_len)) ** 2
    cap = (full + TILE * tiled(max_len)) / 2.0 if causal else full
    return float(batch) * heads * min(per_row, cap)


def varlen_tiles(batch: int, heads: int, queries: int, max_len: int, fill: float) -> float:
    """Score elements over the tiles the varlen-key kernel computes: every query row
    (rounded up to its query block, ``min(64, next power of two)``) over the row's kept
    keys rounded up to their tile (``E[len] + TILE/2``, at most the padded keys)."""
    block = min(TILE, 1 << max(4, math.ceil(math.log2(max(1, queries)))))
    rows = block * math.ceil(max(1, queries) / block)
    keys = min(float(tiled(max_len)), min(1.0, max(0.0, fill)) * max_len + TILE / 2.0)
    return float(batch) * heads * rows * keys


def masked_sdpa_s(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                  gpu: GPUSpec, dtype: str = "bf16") -> float:
    """Fwd+bwd seconds of padded SDPA under an explicit mask (see the module doc)."""
    scores = float(batch) * heads * tiled(q_len) * tiled(kv_len)
    per = SDPA_MASKED_BYTES_PER_SCORE / gpu.hbm_bandwidth \
        + FLOPS_PER_SCORE * head_dim / (gpu.peak_flops(dtype) * SDPA_MASKED_EFFICIENCY)
    return scores * per


def gemc_kernel_s(scores: float, head_dim: int, kind: str, gpu: GPUSpec,
                  dtype: str = "bf16") -> float:
    """Fwd+bwd seconds of gemc's kernels over ``scores`` tile elements (``jagged_tiles`` or
    ``varlen_tiles``); ``kind`` ``softmax`` (jagged and varlen-key) or ``silu``."""
    eff = {"softmax": GEMC_SOFTMAX_EFFICIENCY, "silu": GEMC_SILU_EFFICIENCY}[kind]
    return scores * FLOPS_PER_SCORE * head_dim / (gpu.peak_flops(dtype) * eff)


def jagged_copy_bytes(padded_numel: float, fill: float, itemsize: int) -> float:
    """Bytes of the padded <-> jagged copies of a jagged self-attention run on padded
    tensors: forward q, k, v gathered (read and write the real rows) and the output
    scattered back (read the real rows, write the padded tensor); backward the output's
    gradient gathered and dq, dk, dv scattered back: ``(12 f + 4)`` passes over one padded
    ``[B, L, H d]`` tensor."""
    return (12.0 * min(1.0, fill) + 4.0) * padded_numel * itemsize


def compaction_bytes(padded_numel: float, tensors: int, itemsize: int) -> float:
    """Bytes of a guarded call's compaction (a mask that is no prefix on some row): each
    permuted tensor (k and v; q and the output too for a jagged self-attention) gathered
    forward (read, write) and its gradient scattered back (zeros, read, write): 5 passes."""
    return 5.0 * tensors * padded_numel * itemsize

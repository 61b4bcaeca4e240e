"""Sums over contiguous segments of rows, accumulated in fp32, without atomics.

Why: in a ``packed_tokens`` region a per-sequence operand (``[B, 1, d]``) is gathered to
every token of its row, so its gradient adds up each row's token gradients; a masked sum
over positions does the same in the forward. ``index_add`` did both: in bf16 its atomics
add a row's hundreds of token values in bf16, so it ran in fp32, which first casts the
whole ``[T, d]`` gradient to fp32 and then contends on ``B`` destination rows (the H200
profile of the GEM step, 2026-12-03: five fp32 ``index_add`` launches, 3.1 ms of a 72 ms
step, beside their casts). A row's tokens are contiguous in the packed layout (offsets
order), so one program per (segment, column block) reads them once, adds them in fp32
registers and stores the sum once, in the output's dtype: one pass over ``[T, d]``, no
atomics, and the same result every run.

Off CUDA without the Triton interpreter the same sums run as ATen ops (``index_add`` in
fp32): that is the CPU implementation, not a fallback of the GPU path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETED, cdiv, check_offsets, kernel_runs_on, next_pow2

BLOCK_T = 64 if INTERPRETED else 32
"""Rows a program adds per step: 32 x 128 fp32 accumulators are 32 registers a thread at 4
warps (the sum over them is taken once, after the loop)."""


@triton.jit
def _segment_sum_kernel(x_ptr, offsets_ptr, out_ptr, D, stride_x, BLOCK_T: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    start = tl.load(offsets_ptr + seg).to(tl.int64)
    end = tl.load(offsets_ptr + seg + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for first in range(start, end, BLOCK_T):
        rows = first + tl.arange(0, BLOCK_T)
        mask = (rows < end)[:, None] & cmask[None, :]
        acc += tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    total = tl.sum(acc, 0)
    tl.store(out_ptr + seg.to(tl.int64) * D + cols, total, mask=cmask)


def segment_sum_rows(x: torch.Tensor, offsets: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[s] = x[offsets[s]:offsets[s + 1]].sum(0)`` in fp32, returned in ``dtype``
    (default ``x``'s), for ``x`` of shape ``[T, ...]``; rows past ``offsets[-1]`` are not
    read. Not differentiable by itself: the callers are backward passes and a forward
    whose autograd function gives the gradient."""
    segments = check_offsets(offsets)
    rest = tuple(x.shape[1:])
    dtype = dtype or x.dtype
    if not kernel_runs_on(x):
        return _segment_sum_aten(x, offsets, dtype)
    flat = x.reshape(x.shape[0], math.prod(rest))
    if flat.shape[1] and flat.stride(1) != 1:
        flat = flat.contiguous()
    d = flat.shape[1]
    # the sums leave the kernel in fp32 and torch rounds them (to nearest; the interpreter's
    # own bf16 store truncates); [segments, d] is small beside the [T, d] read
    out = torch.empty((segments, d), dtype=torch.float32, device=x.device)
    if segments and d:
        block_d = min(next_pow2(d, 16), 128)
        _segment_sum_kernel[(segments, cdiv(d, block_d))](
            flat, offsets, out, d, flat.stride(0), BLOCK_T=BLOCK_T, BLOCK_D=block_d,
            num_warps=4)
    return out.view(segments, *rest).to(dtype)


def _segment_sum_aten(x: torch.Tensor, offsets: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    segments = offsets.numel() - 1
    lengths = (offsets[1:] - offsets[:-1]).long()
    used = int(offsets[-1]) - int(offsets[0])
    seg = torch.repeat_interleave(torch.arange(segments, device=x.device), lengths,
                                  output_size=used)
    start = int(offsets[0])
    acc = torch.zeros((segments, *x.shape[1:]), dtype=torch.float32, device=x.device)
    return acc.index_add_(0, seg, x[start:start + used].float()).to(dtype)

"""Zeros into the rows of a jagged attention's outputs that no sequence covers, and nowhere
else, so the outputs need no ``torch.zeros`` first.

Why: the attention kernels (:mod:`.jagged_attention`, :mod:`.silu_key_block_backward`)
store every row of every sequence (``offsets[b]:offsets[b+1]``, or in the padded layout
row ``b``'s first ``len_b`` positions), and only those. The other rows (spare slots past
``offsets[-1]`` of a packed buffer, a padded row's tail) must read zero: a spare slot's
garbage would flow into the token-wise ops after the attention and, through a weight's
gradient, into every parameter (``NaN * 0`` is NaN). Zeroing whole buffers first cost
0.17 ms of MMoE's 1.84-ms attention fwd+bwd on an H100 (four ``[T, H, D]`` fills, 0.55 GB;
``benchmarks/attention_gpu_time.py``, twenty-third session) to zero rows that the kernels
then overwrite. This kernel reads the offsets and writes zeros to the uncovered rows only:
one launch for up to three buffers of the same row shape, no traffic where every row is
covered.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["uninitialised", "zero_uncovered_rows"]


def uninitialised(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """An output buffer that a kernel writes in full (``torch.empty_strided``): the one
    place such buffers are made, so a test can fill them with NaN instead and see that
    every element was written."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)

_BLOCK_R = 64


@triton.jit
def _zero_uncovered_kernel(A, B, C, offsets_ptr, n_rows, row_elems, n_seqs, pad_len,
                           PADDED: tl.constexpr, OUTPUTS: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    # PADDED a constexpr, not a test of pad_len: the two layouts' bounds differ in type
    # (a block of per-row offsets, or one scalar), which a run-time branch cannot merge
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n_rows
    if PADDED:
        b = rows // pad_len
        pos = rows % pad_len
        has = in_range & (b < n_seqs)
        first = tl.load(offsets_ptr + b, mask=has, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + b + 1, mask=has, other=0).to(tl.int64)
        covered = has & (pos < tl.minimum(end - first, pad_len))
    else:
        first = tl.load(offsets_ptr).to(tl.int64)
        end = tl.load(offsets_ptr + n_seqs).to(tl.int64)
        covered = (rows >= first) & (rows < end)
    zero = in_range & (covered == 0)
    if tl.max(zero.to(tl.int32), 0) > 0:
        base = rows[:, None].to(tl.int64) * row_elems
        for e0 in range(0, row_elems, BLOCK_E):
            cols = e0 + tl.arange(0, BLOCK_E)
            mask = zero[:, None] & (cols[None, :] < row_elems)
            tl.store(A + base + cols[None, :],
                     tl.zeros([BLOCK_R, BLOCK_E], A.dtype.element_ty), mask=mask)
            if OUTPUTS > 1:
                tl.store(B + base + cols[None, :],
                         tl.zeros([BLOCK_R, BLOCK_E], B.dtype.element_ty), mask=mask)
            if OUTPUTS > 2:
                tl.store(C + base + cols[None, :],
                         tl.zeros([BLOCK_R, BLOCK_E], C.dtype.element_ty), mask=mask)


def zero_uncovered_rows(buffers: list[torch.Tensor], offsets: torch.Tensor,
                        pad_len: int = 0) -> list[torch.Tensor]:
    """Writes zeros into the rows of ``buffers`` (1 to 3 contiguous ``[N, ...]`` tensors of
    one row shape) that the sequences of ``offsets`` (``[B+1]``) do not cover: with
    ``pad_len == 0`` rows outside ``[offsets[0], offsets[B])``; with ``pad_len > 0`` (the
    padded ``[B, pad_len]`` layout read in place) row ``r``'s position ``r % pad_len`` at or
    past its sequence's length (clamped to ``pad_len``), and every row past ``B * pad_len``.
    Returns ``buffers``."""
    if not 1 <= len(buffers) <= 3:
        raise ValueError(f"zero_uncovered_rows takes 1 to 3 buffers, got {len(buffers)}")
    first = buffers[0]
    for x in buffers:
        if x.shape != first.shape or not x.is_contiguous():
            raise ValueError("zero_uncovered_rows: the buffers must be contiguous and of one "
                             f"shape, got {[tuple(t.shape) for t in buffers]}")
    n_rows = first.shape[0] if first.dim() else 0
    if n_rows == 0 or first.numel() == 0:
        return buffers
    row_elems = first.numel() // n_rows
    a, b, c = (buffers + [first] * 3)[:3]
    _zero_uncovered_kernel[(triton.cdiv(n_rows, _BLOCK_R),)](
        a, b, c, offsets, n_rows, row_elems, offsets.numel() - 1, int(pad_len),
        PADDED=pad_len > 0, OUTPUTS=len(buffers), BLOCK_R=_BLOCK_R,
        BLOCK_E=min(256, triton.next_power_of_2(row_elems)),
    )
    return buffers

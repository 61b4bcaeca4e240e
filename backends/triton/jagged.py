"""Jagged <-> padded conversions in Triton, each the other's backward.

A jagged batch is ``values: [N, *feature]`` with ``offsets: [B+1]`` (int32 or int64):
sequence ``b`` owns rows ``offsets[b]:offsets[b+1]``. Its padded form is
``[B, max_len, *feature]``.

* ``jagged_to_padded(values, offsets, max_len, pad_value)``: position ``l`` of sequence
  ``b`` is ``values[offsets[b] + l]`` when ``l < len_b``, else ``pad_value``. Sequences
  longer than ``max_len`` are truncated (their tail rows get zero gradient).
* ``padded_to_jagged(padded, offsets, total_len)``: row ``r`` of sequence ``b`` (at position
  ``l = r - offsets[b]``) is ``padded[b, l]`` when ``l < max_len``, else 0. ``total_len``
  (``offsets[-1]``) sizes the output; pass it to avoid a host sync.

Both are pure gathers (every output element is written by exactly one program and nothing is
accumulated), so they are deterministic and need no zero-initialised output. The padded ->
jagged kernel finds each row's sequence by a branch-free binary search over ``offsets``
inside the kernel, so no row-to-sequence index tensor is built on the host.

The ``*_reference`` functions are the plain-PyTorch formulation (index / ``index_put``) that
tests compare against and that the benchmark times as the eager baseline.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import config_choice
from .config_choice import Tiles
from .runtime import autotune_configs, check_launchable, check_offsets, next_pow2

__all__ = [
    "jagged_to_padded",
    "padded_to_jagged",
    "jagged_to_padded_reference",
    "padded_to_jagged_reference",
]


def _cfg(rows: int, cols: int, warps: int) -> triton.Config:
    return triton.Config({"BLOCK_R": rows, "BLOCK_D": cols}, num_warps=warps)


# Pure copies: wide column blocks give 16-byte accesses per thread; a few rows per program
# keep enough loads in flight without idle lanes on short sequences.
_COPY_CONFIGS = autotune_configs(
    [_cfg(16, 128, 4), _cfg(32, 128, 8), _cfg(8, 256, 4), _cfg(64, 64, 8)],
    _cfg(8, 16, 1),
)


def _copy_tiles(cfg: triton.Config, args: dict) -> Tiles:
    """A copy stages at most one [BLOCK_R, BLOCK_D] tile (fp32 at the widest)."""
    return Tiles(streamed=cfg.kwargs["BLOCK_R"] * cfg.kwargs["BLOCK_D"] * 4)


@config_choice.autotune(_COPY_CONFIGS, ["D"], name="jagged._jagged_to_padded_kernel", tiles=_copy_tiles)
@triton.jit
def _jagged_to_padded_kernel(
    values, offsets_ptr, padded, max_len, D, stride_v, stride_pb, stride_pl, pad_value,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_l = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + b).to(tl.int64)
    length = tl.load(offsets_ptr + b + 1).to(tl.int64) - start
    col_ok = offs_d[None, :] < D
    present = (offs_l[:, None] < length) & col_ok
    x = tl.load(values + (start + offs_l[:, None]) * stride_v + offs_d[None, :], mask=present)
    x = tl.where(present, x, pad_value)
    dst = padded + b.to(tl.int64) * stride_pb + offs_l[:, None].to(tl.int64) * stride_pl
    tl.store(dst + offs_d[None, :], x.to(padded.dtype.element_ty),
             mask=(offs_l[:, None] < max_len) & col_ok)


@triton.jit
def _sequence_of_rows(offsets_ptr, rows, batch, SEARCH_STEPS: tl.constexpr):
    """For each row, the last ``b`` in [0, batch) with ``offsets[b] <= row`` (its sequence)."""
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + (batch - 1)
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go_right = tl.load(offsets_ptr + mid).to(tl.int64) <= rows
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@config_choice.autotune(_COPY_CONFIGS, ["D"], name="jagged._padded_to_jagged_kernel", tiles=_copy_tiles)
@triton.jit
def _padded_to_jagged_kernel(
    padded, offsets_ptr, values, total_len, batch, max_len, D, stride_v, stride_pb, stride_pl,
    SEARCH_STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < total_len
    b = _sequence_of_rows(offsets_ptr, tl.where(row_ok, rows, 0), batch, SEARCH_STEPS)
    pos = rows - tl.load(offsets_ptr + b).to(tl.int64)
    col_ok = offs_d[None, :] < D
    src = padded + b[:, None] * stride_pb + pos[:, None] * stride_pl + offs_d[None, :]
    x = tl.load(src, mask=(row_ok & (pos < max_len))[:, None] & col_ok, other=0.0)
    tl.store(values + rows[:, None] * stride_v + offs_d[None, :], x, mask=row_ok[:, None] & col_ok)


def _flat_features(x: torch.Tensor, lead: int) -> torch.Tensor:
    """View ``x`` as ``[*x.shape[:lead], prod(feature)]`` with unit stride on the last dim."""
    flat = x.reshape(*x.shape[:lead], math.prod(x.shape[lead:]))
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _jagged_to_padded(values, offsets, max_len: int, pad_value: float) -> torch.Tensor:
    batch = offsets.numel() - 1
    feature = values.shape[1:]
    flat = _flat_features(values, 1)
    padded = torch.empty((batch, max_len, flat.shape[1]), dtype=values.dtype,
                         device=values.device)
    if padded.numel() > 0:
        def grid(cfg):
            return (batch, triton.cdiv(max_len, cfg["BLOCK_R"]),
                    triton.cdiv(flat.shape[1], cfg["BLOCK_D"]))

        _jagged_to_padded_kernel[grid](
            flat, offsets, padded, max_len, flat.shape[1], flat.stride(0), padded.stride(0),
            padded.stride(1), float(pad_value),
        )
    return padded.view(batch, max_len, *feature)


def _padded_to_jagged(padded, offsets, total_len: int) -> torch.Tensor:
    batch, max_len = padded.shape[:2]
    feature = padded.shape[2:]
    flat = _flat_features(padded, 2)
    values = torch.empty((total_len, flat.shape[2]), dtype=padded.dtype, device=padded.device)
    if values.numel() > 0:
        def grid(cfg):
            return (triton.cdiv(total_len, cfg["BLOCK_R"]),
                    triton.cdiv(flat.shape[2], cfg["BLOCK_D"]))

        _padded_to_jagged_kernel[grid](
            flat, offsets, values, total_len, batch, max_len, flat.shape[2], values.stride(0),
            flat.stride(0), flat.stride(1), SEARCH_STEPS=next_pow2(batch).bit_length(),
        )
    return values.view(total_len, *feature)


class JaggedToPadded(torch.autograd.Function):
    """``jagged_to_padded`` whose backward is ``padded_to_jagged`` of the gradient."""

    @staticmethod
    def forward(ctx, values, offsets, max_len, pad_value):  # type: ignore[override]
        ctx.save_for_backward(offsets)
        ctx.total_len = values.shape[0]
        return _jagged_to_padded(values, offsets, max_len, pad_value)

    @staticmethod
    def backward(ctx, grad_padded):  # type: ignore[override]
        (offsets,) = ctx.saved_tensors
        return _padded_to_jagged(grad_padded, offsets, ctx.total_len), None, None, None


class PaddedToJagged(torch.autograd.Function):
    """``padded_to_jagged`` whose backward is ``jagged_to_padded`` of the gradient (pad 0)."""

    @staticmethod
    def forward(ctx, padded, offsets, total_len):  # type: ignore[override]
        ctx.save_for_backward(offsets)
        ctx.max_len = padded.shape[1]
        return _padded_to_jagged(padded, offsets, total_len)

    @staticmethod
    def backward(ctx, grad_values):  # type: ignore[override]
        (offsets,) = ctx.saved_tensors
        return _jagged_to_padded(grad_values, offsets, ctx.max_len, 0.0), None, None


def _total_len(offsets: torch.Tensor, total_len: int | None) -> int:
    return int(offsets[-1].item()) if total_len is None else int(total_len)


def jagged_to_padded(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float = 0.0
) -> torch.Tensor:
    """Pad a jagged batch ``values [N, *f]`` to ``[B, max_len, *f]`` (differentiable)."""
    check_offsets(offsets)
    check_launchable(values, offsets)
    if values.dim() < 1:
        raise ValueError("values must have a leading row dimension")
    return JaggedToPadded.apply(values, offsets, int(max_len), float(pad_value))


def padded_to_jagged(
    padded: torch.Tensor, offsets: torch.Tensor, total_len: int | None = None
) -> torch.Tensor:
    """Drop the padding of ``padded [B, L, *f]``: ``[offsets[-1], *f]`` (differentiable)."""
    batch = check_offsets(offsets)
    check_launchable(padded, offsets)
    if padded.dim() < 2 or padded.shape[0] != batch:
        raise ValueError(f"padded must be [B={batch}, L, ...], got {tuple(padded.shape)}")
    return PaddedToJagged.apply(padded, offsets, _total_len(offsets, total_len))


def _rows_and_positions(offsets: torch.Tensor, total_len: int):
    """Sequence index and position of every jagged row (plain PyTorch)."""
    lengths = (offsets[1:] - offsets[:-1]).long()
    seq = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total_len
    )
    pos = torch.arange(total_len, device=offsets.device) - offsets.long()[seq]
    return seq, pos


def jagged_to_padded_reference(
    values: torch.Tensor, offsets: torch.Tensor, max_len: int, pad_value: float = 0.0
) -> torch.Tensor:
    """``jagged_to_padded`` as eager PyTorch: ``index_put`` of the rows that fit."""
    seq, pos = _rows_and_positions(offsets, values.shape[0])
    keep = pos < max_len
    out = values.new_full((offsets.numel() - 1, max_len, *values.shape[1:]), pad_value)
    return torch.index_put(out, (seq[keep], pos[keep]), values[keep])


def padded_to_jagged_reference(
    padded: torch.Tensor, offsets: torch.Tensor, total_len: int | None = None
) -> torch.Tensor:
    """``padded_to_jagged`` as eager PyTorch: gather the rows, zero those past ``max_len``."""
    total = _total_len(offsets, total_len)
    seq, pos = _rows_and_positions(offsets, total)
    if padded.shape[1] == 0:
        return padded.new_zeros((total, *padded.shape[2:]))
    keep = pos < padded.shape[1]
    rows = padded[seq, pos.clamp(max=padded.shape[1] - 1)]
    return rows * keep.view(-1, *([1] * (padded.dim() - 2))).to(rows.dtype)

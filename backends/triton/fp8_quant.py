"""Row-wise fp8 (e4m3) quantisation in one pass: the operands of ``torch._scaled_mm``.

Why: under torch.compile gemc's fp8 linear leaves its quantisation (amax, power-of-two
scale, cast, layout copy) to Inductor as ATen ops, and on the H200 the compiled LayerNorm ->
Linear ran 0.82-0.85x bf16 (BENCHMARKS.md, "fp8 compiled on torch 2.11") although the fp8
GEMM alone is faster: the quantisation around it costs more than the GEMM saves. These
kernels do it in the fewest passes over the operand, so it can be measured against
Inductor's code (``benchmarks/fp8_breakdown.py``) and used where it wins
(:data:`gemc.backends.torch.fp8.QUANTIZERS`):

* :func:`quantize_rows`: ``x[M, K]`` (any strides, bf16/fp16/fp32) to row-major e4m3 with
  one fp32 scale per row, the amax of each row taken in registers: one read, one fp8 write
  (3 bytes an element from bf16). The forward's ``x`` and ``W`` and the dgrad's ``dy``.
* :func:`quantize_cols`: scales per *column* (amax over M), the output written transposed
  (``[K, M]`` row-major, M zero-padded to a multiple of 16): what the wgrad GEMM ``dy^T x``
  contracts over, in the layout ``_scaled_mm`` takes (``dy^T`` row-major, ``x`` column-major
  = the transpose of a row-major ``[K, M]``), and the dgrad's ``W`` column-major. The
  transpose is the store of the cast, not a separate copy. A column's amax spans all M
  rows, so it is two kernels: partial amaxes over row segments (a ``[S, K]`` fp32 buffer,
  S = M / 512, no atomics), then the cast, which reduces those S values per column first:
  5 bytes an element (2 reads, one fp8 write).

Scales are gemc's: a power of two, ``2^(floor(log2(amax / 448)) + 1)`` with amax floored at
:data:`~gemc.backends.torch.fp8.AMAX_FLOOR` (see :mod:`gemc.backends.torch.fp8` for why a
power of two, not ``448 / amax``: exact dequantisation, the largest value in [224, 448)),
computed from amax's exponent and mantissa bits, so the values and scales are bit-identical
to :func:`gemc.backends.torch.fp8.quantize` and its CPU emulation.

The cast rounds to nearest-even and saturates at +-448 (a scaled value is < 448, so the
clamp never binds on finite input; NaN stays NaN). On a GPU it is the hardware conversion
(``cvt.rn.satfinite``); ``soft_round=True`` rounds in fp32 arithmetic first (exponent from
the bits, the quantum ``2^(e - 3)``, round-half-even by the ``1.5 * 2^23`` trick) so that the
conversion only ever sees representable values. Triton's interpreter needs that: its own
fp32 -> e4m3 conversion rounds ties away from zero and flushes most subnormals (checked on
Triton 3.9), while it stores representable e4m3 values exactly. So on the CPU the soft
rounding is what is tested; the hardware conversion is exercised only on a GPU
(``GEMC_TEST_DEVICE=cuda``, and the breakdown benchmark's bit-identity check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .runtime import (
    INTERPRETED,
    cdiv,
    check_launchable,
    kernel_op,
    launched_directly,
    next_pow2,
)

__all__ = ["ALIGN", "quantize_cols", "quantize_rows"]

E4M3 = torch.float8_e4m3fn
ALIGN = 16
"""Multiple the transposed output's M is zero-padded to (``_scaled_mm``'s K alignment)."""
AMAX_FLOOR = 1e-12  # == gemc.backends.torch.fp8.AMAX_FLOOR (tests check they agree)
ROW_TILE = 8192
"""Elements of a row block held in registers at once: a row of up to this many is read once."""
SEGMENT = 512
"""Rows per partial column amax (:func:`quantize_cols`' first kernel)."""
COL_TILE = (128, 64)
"""(rows, columns) of the cast-and-transpose kernel's tile: 128 rows make each transposed
store 128 contiguous fp8 bytes."""
BLOCK_S = 64
"""Partial amaxes (segments) the cast kernel reduces per step: 64 x 512 = 32,768 rows."""


@triton.jit
def _pow2(e):
    """``2.0 ** e`` for int32 ``e`` in the normal fp32 range, exact (built from the bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_exponent(amax):
    """e with ``2^e`` gemc's scale of ``amax``: frexp's exponent of ``amax / 448``.

    amax = m 2^ea, m in [1, 2), and 448 = 1.75 2^8, so ``floor(log2(amax / 448))`` is
    ``ea - 8`` when m >= 1.75 (mantissa bits >= 0x600000), else ``ea - 9``; frexp's is one
    more.
    The fp32 quotient never rounds across a power of two (the gap below 1.75 is wider than
    half an ulp of the quotient), so this equals torch's ``frexp(amax / 448)``."""
    bits = tl.maximum(amax, 1e-12).to(tl.int32, bitcast=True)
    ea = ((bits >> 23) & 0xFF) - 127
    return ea - 7 - ((bits & 0x7FFFFF) < 0x600000).to(tl.int32)


@triton.jit
def _to_e4m3(y, SOFT: tl.constexpr):
    """Scaled fp32 values to e4m3, round-half-even, saturating at +-448 (see the module doc)."""
    if SOFT:
        a = tl.abs(y)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        r = ((a * _pow2(3 - e) + 12582912.0) - 12582912.0) * _pow2(e - 3)
        r = tl.where(r > 448.0, 448.0, r)
        # the sign bit copied, not ``-r``: Triton negates as 0 - r, which makes -0 +0 on a GPU
        sign = y.to(tl.int32, bitcast=True) & -2147483648
        y = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    return y.to(tl.float8e4nv)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, scale_ptr, M, K, sxm, sxk,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
                       SOFT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sxm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_K)
    if ONE_TILE:  # the whole row block in registers: read once
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        e = _scale_exponent(tl.max(tl.abs(x), 1))
        tl.store(q_rows + cols[None, :], _to_e4m3(x * _pow2(-e)[:, None], SOFT), mask=mask)
    else:  # wide rows: the amax pass, then the cast pass (the re-read mostly from L2)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_rows + (k0 + cols)[None, :] * sxk, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
        e = _scale_exponent(amax)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_rows + (k0 + cols)[None, :] * sxk, mask=mask, other=0.0)
            tl.store(q_rows + (k0 + cols)[None, :],
                     _to_e4m3(x.to(tl.float32) * _pow2(-e)[:, None], SOFT), mask=mask)
    tl.store(scale_ptr + rows, _pow2(e), mask=rmask)


@triton.jit
def _col_amax_kernel(x_ptr, part_ptr, M, K, sxm, sxk, SEGMENT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    end = tl.minimum(seg * SEGMENT + SEGMENT, M)
    for m0 in range(seg * SEGMENT, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                    other=0.0)
        acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(part_ptr + seg * K + cols, tl.max(acc, 0), mask=cmask)


@triton.jit
def _quant_cols_kernel(x_ptr, part_ptr, q_ptr, scale_ptr, M, K, M_pad, S, sxm, sxk,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                       SOFT: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):  # the column amax from the segments' partials
        segs = s0 + tl.arange(0, BLOCK_S)
        part = tl.load(part_ptr + segs[:, None] * K + cols[None, :],
                       mask=(segs < S)[:, None] & cmask[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(part, 0))
    e = _scale_exponent(amax)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sxm + cols[None, :] * sxk, mask=mask,
                other=0.0).to(tl.float32)
    q = _to_e4m3(tl.trans(x * _pow2(-e)[None, :]), SOFT)  # [BLOCK_K, BLOCK_M]: padding is 0
    tl.store(q_ptr + cols.to(tl.int64)[:, None] * M_pad + rows[None, :], q,
             mask=cmask[:, None] & (rows < M_pad)[None, :])
    if pid_m == 0:
        tl.store(scale_ptr + cols, _pow2(e), mask=cmask)


def _check(x: torch.Tensor, where: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{where} quantises a matrix, got shape {tuple(x.shape)}; flatten the "
                         "leading dims into rows first")
    if not x.dtype.is_floating_point or x.dtype == E4M3:
        raise TypeError(f"{where} takes bf16, fp16 or fp32, got {x.dtype}")
    check_launchable(x)


def _soft(soft_round: bool | None) -> bool:
    return INTERPRETED if soft_round is None else bool(soft_round)


# The launch code below runs in three ways: eagerly (the kernels launched by Triton's own
# launcher), traced with symbolic sizes when the ops are ``triton_op``s under torch.compile
# (:func:`torch.library.wrap_triton` records each launch as a graph node that Inductor
# compiles and launches from its generated code), and traced with fake tensors (the ops'
# meta implementation). So the sizes here may be SymInts: nothing calls ``int()`` on the
# token count, the constexprs depend on the feature count alone (a graph specialises on it
# anyway), and the one size-dependent choice is ``torch.sym_max``.


def _rows(x: torch.Tensor, soft: bool, wrap: Callable[[Any], Any] = wrap_triton
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows`' launch: two allocations, one kernel (``wrap``: how kernels
    are launched: traceably in an op, :func:`launched_directly` outside one)."""
    _check(x, "quantize_rows")
    m, k = x.shape
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block_k = min(next_pow2(k, 16), ROW_TILE)
    block_m = min(max(ROW_TILE // block_k, 1), 64)
    wrap(_quant_rows_kernel)[(cdiv(m, block_m),)](
        x, q, scale, m, k, x.stride(0), x.stride(1), BLOCK_M=block_m, BLOCK_K=block_k,
        ONE_TILE=k <= block_k, SOFT=soft, num_warps=8 if block_k >= 2048 else 4)
    return q, scale


def _cols(x: torch.Tensor, soft: bool, wrap: Callable[[Any], Any] = wrap_triton
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_cols`' launch (the padding :data:`ALIGN`): three allocations, two
    kernels (the partials' buffer zeroed instead when there are no rows)."""
    _check(x, "quantize_cols")
    m, k = x.shape
    m_pad = _padded(m)
    qt = torch.empty((k, m_pad), dtype=E4M3, device=x.device)
    scale = torch.empty((k, 1), dtype=torch.float32, device=x.device)
    if k == 0:
        return qt, scale
    bm, bk = COL_TILE
    segments = torch.sym_max(cdiv(m, SEGMENT), 1)
    # flat: a [segments, K] buffer's contiguity check would guard on segments == 1 (M <= 512)
    part = torch.empty((segments * k,), dtype=torch.float32, device=x.device)
    if m == 0:
        part.zero_()
    else:
        wrap(_col_amax_kernel)[(segments, cdiv(k, bk))](
            x, part, m, k, x.stride(0), x.stride(1), SEGMENT=SEGMENT, BLOCK_M=bm, BLOCK_K=bk,
            num_warps=4)
    # BLOCK_S fixed, not sized to the segment count: that count follows the token count,
    # which a constexpr would specialise the graph on (the amax over masked zeros is exact)
    wrap(_quant_cols_kernel)[(torch.sym_max(cdiv(m_pad, bm), 1), cdiv(k, bk))](
        x, part, qt, scale, m, k, m_pad, segments, x.stride(0), x.stride(1), BLOCK_M=bm,
        BLOCK_K=bk, BLOCK_S=BLOCK_S, SOFT=soft, num_warps=4)
    return qt, scale


def quantize_rows(x: torch.Tensor, *, soft_round: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q ``[M, K]`` row-major e4m3, scale ``[M, 1]`` fp32) with ``q * scale`` ~ ``x``, one
    power-of-two scale per row: :func:`gemc.backends.torch.fp8.quantize` (row-wise, dim 1)
    in one kernel. ``soft_round``: round in fp32 before the cast (default: under the
    interpreter only; see the module doc). The default rounding is the op
    ``gemc::fp8_quantize_rows``; the other launches the kernel directly."""
    if _soft(soft_round) == _soft(None):
        return torch.ops.gemc.fp8_quantize_rows.default(x)
    return _rows(x, _soft(soft_round), launched_directly)


def quantize_cols(x: torch.Tensor, *, soft_round: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(qt ``[K, M_pad]`` row-major e4m3, scale ``[K, 1]`` fp32): ``x[M, K]`` quantised per
    column (amax over M), written transposed, M zero-padded to a multiple of :data:`ALIGN`.

    ``qt`` with ``scale`` is the left operand of ``x^T @ ...`` (``dy^T`` of the wgrad) and
    ``qt.t()`` with ``scale.t()`` the right operand of ``... @ x`` in column-major (the
    wgrad's ``x``, the dgrad's ``W``): :func:`gemc.backends.torch.fp8.quantize` along dim 0
    plus the layout copy, in two kernels and no separate transpose. The default rounding
    is the op ``gemc::fp8_quantize_cols``."""
    if _soft(soft_round) == _soft(None):
        return torch.ops.gemc.fp8_quantize_cols.default(x)
    return _cols(x, _soft(soft_round), launched_directly)


# ----------------------------------------------------------------------------- custom ops
#
# For gemc's fp8 linear under torch.compile (``gemc.backends.torch.fp8``, quantizer
# "triton"): one op per operand, outputs fresh and contiguous. Not differentiable: the
# linear quantises detached operands.
#
# On a GPU they are ``triton_op``s, under the interpreter ``custom_op``s
# (``runtime.kernel_op`` says why).


def _padded(m: Any) -> Any:
    """M rounded up to :data:`ALIGN` (an int or a symbolic size)."""
    return (m + ALIGN - 1) // ALIGN * ALIGN


def _quant_op(name: str, launch: Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]],
              shapes: Callable[[Any, Any], tuple[tuple[Any, Any], tuple[Any, Any]]],
              interpreted: bool = INTERPRETED) -> Any:
    """``gemc::<name>(x) -> (q, scale)``: ``launch(x, soft)`` with the default rounding, a
    ``triton_op`` (its launch code its meta implementation), or under the interpreter a
    ``custom_op`` whose fake is shaped by ``shapes(M, K)`` (the fp8 values', the scales')."""
    soft = _soft(None)

    def impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(x, soft)

    def fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_shape, s_shape = shapes(*x.shape)
        return x.new_empty(q_shape, dtype=E4M3), x.new_empty(s_shape, dtype=torch.float32)

    return kernel_op(name, impl, fake, interpreted)


_rows_op = _quant_op("fp8_quantize_rows", _rows, lambda m, k: ((m, k), (m, 1)))
_cols_op = _quant_op("fp8_quantize_cols", _cols, lambda m, k: ((k, _padded(m)), (k, 1)))

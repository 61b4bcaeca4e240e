"""Row-wise fp8 (e4m3) quantisation in one pass, alone or fused into the norm that produces it.

Why: quantising with separate eager kernels (amax, scale arithmetic, multiply, cast) moves
9-17 bytes an element for a bf16 operand, more than the fp8 GEMM saves at the K, N of
recommendation towers (BENCHMARKS.md, "Precision"). Here one program owns whole rows: it
loads a row once, takes its amax in registers, scales and casts it, and writes 1 byte an
element plus one fp32 scale a row. Fused into a LayerNorm / RMSNorm the quantised tensor
costs the producer *less* than its bf16 output would (1 byte instead of 2), so the
quantisation is free.

The scaling is the one of :mod:`gemc.backends.torch.fp8` (one definition of the numbers):
per row ``scale = 2^(floor(log2(amax / 448)) + 1)`` from the row's amax (floored at
``AMAX_FLOOR``), computed here from the fp32 exponent bits (``frexp`` has no Triton
equivalent); dividing by a power of two is exact, so the kernel's fp8 values are
bit-identical to :func:`gemc.backends.torch.fp8.quantize`'s.

Three kernels:

* :func:`rowwise_quant` -- ``x[R, C]`` (any strides) -> ``q[R, C]`` row-major + scales
  ``[R, 1]``: the left operand of a GEMM, or a weight quantised along its input features.
* :func:`colwise_quant` -- ``x[R, C]`` -> ``q[C, R]`` row-major (x transposed) + scales
  ``[C, 1]``: quantisation along dim 0, which the backward GEMMs need (dy and x along the
  tokens for wgrad, W along its output features for dgrad). Two launches over tiles
  (partial column amaxes, then reduce + scale + transposed store): 5 bytes an element for
  bf16.
* :func:`norm_quant` -- LayerNorm (with or without affine) or RMSNorm of ``x[R, C]``
  and quantisation of the result, plus the per-row mean and 1/std the backward needs.

**The fp8 cast and the interpreter.** Triton's CPU interpreter (3.9) rounds fp32 -> e4m3
wrongly (e.g. -7.76 -> -4.0; measured, not assumed), so interpreted kernels write the
*scaled* values (exact: power-of-two scale) to an fp32 staging buffer and the host casts
them with ``Tensor.to(float8_e4m3fn)`` (round to nearest even; never saturating, as no
scaled value exceeds 448). On CUDA the kernel casts in registers with round-to-nearest-even
and writes fp8. So a CPU test checks the amax, the scale, every scaled value and the norm
math bit for bit; the in-register cast itself is checked only by the same tests run on a
GPU (``GEMC_TEST_DEVICE=cuda pytest tests/kernels/test_fp8_quant.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETED, cdiv, check_launchable, next_pow2

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-12  # as gemc.backends.torch.fp8.AMAX_FLOOR (tested equal)
MAX_ROW = 16384
"""Widest row one program holds in registers (fp32: 64 KiB at 8 warps); wider rows are
refused with a clear error rather than spilled."""
COL_BLOCK = 64
COL_ROWS = 64 if INTERPRETED else 128
"""colwise_quant's tile: 128 rows x 64 columns (32 KiB of bf16), R/128 x C/64 programs."""

LAYER, RMS = "layer", "rms"
NORMS = (LAYER, RMS)


@triton.jit
def _pow2_scale(amax):
    """(scale, 1/scale) = 2^(e - 126), 2^(126 - e), e the fp32 exponent field of
    max(amax, floor) / 448: frexp's exponent, so amax / scale lies in [224, 448)."""
    v = tl.maximum(amax, 1e-12) / 448.0
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(e, 253)  # amax = inf: keep both powers finite
    scale = ((e + 1) << 23).to(tl.float32, bitcast=True)
    inv = ((253 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv


@triton.jit
def _store_scaled(q_ptrs, y, inv, mask, STAGE_FP32: tl.constexpr):
    if STAGE_FP32:
        tl.store(q_ptrs, y * inv, mask=mask)
    else:
        tl.store(q_ptrs, (y * inv).to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _rowwise_kernel(x_ptr, q_ptr, s_ptr, C, stride_r, stride_c, BLOCK_C: tl.constexpr,
                    STAGE_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * stride_r + cols * stride_c, mask=mask, other=0.0).to(tl.float32)
    scale, inv = _pow2_scale(tl.max(tl.abs(x), 0))
    _store_scaled(q_ptr + row * C + cols, x, inv, mask, STAGE_FP32)
    tl.store(s_ptr + row, scale)


@triton.jit
def _col_amax_kernel(x_ptr, part_ptr, R, C, stride_r, stride_c, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """Per (row block, column block) tile: the columns' amax over the tile's rows."""
    rb = tl.program_id(0)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    m = (rows < R)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :] * stride_c,
                mask=m, other=0.0).to(tl.float32)
    tl.store(part_ptr + rb.to(tl.int64) * C + cols, tl.max(tl.abs(x), 0), mask=cmask)


@triton.jit
def _col_scale_kernel(x_ptr, part_ptr, q_ptr, s_ptr, R, C, n_rb, stride_r, stride_c,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STAGE_FP32: tl.constexpr):
    """Reduce the columns' partial amaxes, then scale the tile and store it transposed."""
    rb = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in range(0, n_rb):
        amax = tl.maximum(amax, tl.load(part_ptr + i * C + cols, mask=cmask, other=0.0))
    scale, inv = _pow2_scale(amax)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    m = (rows < R)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :] * stride_c,
                mask=m, other=0.0).to(tl.float32)
    # q is x^T, row-major [C, R]
    _store_scaled(q_ptr + cols[None, :].to(tl.int64) * R + rows[:, None], x, inv[None, :], m,
                  STAGE_FP32)
    if rb == 0:
        tl.store(s_ptr + cols, scale, mask=cmask)


@triton.jit
def _norm_kernel(x_ptr, w_ptr, b_ptr, q_ptr, s_ptr, mean_ptr, rstd_ptr, C, stride_r, eps,
                 BLOCK_C: tl.constexpr, RMS_NORM: tl.constexpr, HAS_W: tl.constexpr,
                 HAS_B: tl.constexpr, STAGE_FP32: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS_NORM:
        xc = x
    else:
        mean = tl.sum(x, 0) / C
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / C + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale, inv = _pow2_scale(tl.max(tl.abs(tl.where(mask, y, 0.0)), 0))
    _store_scaled(q_ptr + row * C + cols, y, inv, mask, STAGE_FP32)
    tl.store(s_ptr + row, scale)
    tl.store(rstd_ptr + row, rstd)


# ----------------------------------------------------------------------------- host side


def _stage_dtype() -> torch.dtype:
    return torch.float32 if INTERPRETED else E4M3


def _finish(q: torch.Tensor) -> torch.Tensor:
    """The staged fp32 scaled values cast to e4m3 on the host (interpreter only)."""
    return q.to(E4M3) if q.dtype != E4M3 else q


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _check(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} quantises matrices, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == E4M3:
        raise TypeError(f"{name} takes fp32/bf16/fp16 input, got {x.dtype}")
    check_launchable(x)


def rowwise_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[R, C]`` -> (e4m3 ``[R, C]`` row-major, fp32 scales ``[R, 1]``), one pass."""
    _check(x, "rowwise_quant")
    r, c = x.shape
    if c > MAX_ROW:
        raise ValueError(f"rowwise_quant holds rows of at most {MAX_ROW} values, got {c}")
    q = torch.empty((r, c), dtype=_stage_dtype(), device=x.device)
    s = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    if r and c:
        block = next_pow2(c, 16)
        _rowwise_kernel[(r,)](x, q, s, c, x.stride(0), x.stride(1), BLOCK_C=block,
                              STAGE_FP32=INTERPRETED, num_warps=_warps(block))
    return _finish(q), s


def colwise_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[R, C]`` -> (e4m3 ``x^T`` as ``[C, R]`` row-major, fp32 scales ``[C, 1]``): each
    column of x quantised with its own scale, laid out so its values are contiguous.

    Two launches over a grid of tiles (a column's amax spans every row, more than one
    program should read): the tiles' partial column amaxes, then per tile the reduction
    of its columns' partials (``R / BLOCK_R`` values each, from L2), the scaling and the
    transposed store. x is read twice, the fp8 copy written once."""
    _check(x, "colwise_quant")
    r, c = x.shape
    q = torch.empty((c, r), dtype=_stage_dtype(), device=x.device)
    s = torch.empty((c, 1), dtype=torch.float32, device=x.device)
    if r and c:
        n_rb = cdiv(r, COL_ROWS)
        part = torch.empty((n_rb, c), dtype=torch.float32, device=x.device)
        grid = (n_rb, cdiv(c, COL_BLOCK))
        _col_amax_kernel[grid](x, part, r, c, x.stride(0), x.stride(1), BLOCK_R=COL_ROWS,
                               BLOCK_C=COL_BLOCK, num_warps=4)
        _col_scale_kernel[grid](x, part, q, s, r, c, n_rb, x.stride(0), x.stride(1),
                                BLOCK_R=COL_ROWS, BLOCK_C=COL_BLOCK, STAGE_FP32=INTERPRETED,
                                num_warps=4)
    return _finish(q), s


def norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kind: str = LAYER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise each row of ``x[R, C]`` (``kind`` LayerNorm or RMSNorm, optional affine),
    then quantise it row-wise: (e4m3 ``[R, C]``, scales ``[R, 1]``, mean ``[R]`` (0 for
    RMSNorm), 1/std ``[R]``), all from one read of x."""
    _check(x, "norm_quant")
    if kind not in NORMS:
        raise ValueError(f"norm_quant: unknown norm {kind!r}, use one of {NORMS}")
    if kind == RMS and bias is not None:
        raise ValueError("norm_quant: RMSNorm has no bias")
    r, c = x.shape
    if c > MAX_ROW:
        raise ValueError(f"norm_quant holds rows of at most {MAX_ROW} values, got {c}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.shape != (c,) or not p.is_contiguous()):
            raise ValueError(f"norm_quant: {name} must be contiguous [{c}], got "
                             f"{tuple(p.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((r, c), dtype=_stage_dtype(), device=x.device)
    s = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    mean = (torch.zeros if kind == RMS else torch.empty)(r, dtype=torch.float32,
                                                         device=x.device)
    rstd = torch.empty(r, dtype=torch.float32, device=x.device)
    if r and c:
        block = next_pow2(c, 16)
        _norm_kernel[(r,)](x, weight if weight is not None else x,
                           bias if bias is not None else x, q, s, mean, rstd, c, x.stride(0),
                           float(eps), BLOCK_C=block, RMS_NORM=kind == RMS,
                           HAS_W=weight is not None, HAS_B=bias is not None,
                           STAGE_FP32=INTERPRETED, num_warps=_warps(block))
    return _finish(q), s, mean, rstd

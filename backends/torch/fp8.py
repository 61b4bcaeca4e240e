"""FP8 (e4m3) GEMMs for training: quantization, ``torch._scaled_mm`` and its CPU emulation.

One linear layer runs three GEMMs, and each has its own precision (:class:`GemmChoice`):

=========  ==========================  ===============  ==================================
GEMM       computes                    contraction      fp8 operands (scaled along)
=========  ==========================  ===============  ==================================
``fwd``    ``y[M,N] = x[M,K] W^T``     K (features)     x per token, W per output feature
``dgrad``  ``dx[M,K] = dy[M,N] W``     N (features)     dy per token, W per input feature
``wgrad``  ``dW[N,K] = dy^T x``        M (tokens)       dy per output feature, x per input
=========  ==========================  ===============  ==================================

**Scaling.** Dynamic ("current") scaling: every call measures the amax of each operand and
quantizes with it; nothing is carried between steps, so a spike cannot overflow a stale
scale. *Row-wise* (the default) gives every row of ``a`` and every column of ``b`` its own
scale, taken along the contraction dimension (the only layout ``_scaled_mm`` accepts: scale_a
``[M, 1]``, scale_b ``[1, N]``), so one outlier token or feature costs precision only in its
own row. *Tensor-wise* (one scale per operand) is for operands without outliers.

**Gradients are e4m3 too**, not e5m2: e5m2's wider range served delayed, per-tensor scales
that had to cover a gradient's spread across steps and rows; with a fresh scale per row the
largest value of every row lands in [224, 448), so the range is not needed and e4m3's extra
mantissa bit (about 6 dB of SQNR) is kept. One type also keeps one contract below (older
torch builds' row-wise ``_scaled_mm`` took e4m3 alone; not re-checked on torch 2.11).

**Scales are powers of two** (``2^(floor(log2(amax / 448)) + 1)``): dividing by them is exact in
any float format, so a bf16 operand is scaled in bf16 without rounding (7 bytes moved per
element instead of 11 for an fp32 intermediate), the CPU emulation and the GPU quantize to
bit-identical fp8 values, and the largest magnitude lands in [224, 448) -- at most one
binade of e4m3's range unused, which costs no precision because e4m3's error is relative.
No clamp is needed: a scaled value never exceeds 448.

**Contract** (:func:`check_scaled_mm_args`, what ``torch._scaled_mm`` enforces on CUDA, also
enforced by the emulation so a CPU test catches what would fail on the GPU): ``a`` [M, K]
row-major and ``b`` [K, N] column-major, both float8_e4m3fn; K and N divisible by 16;
tensor-wise scales are single fp32 values, row-wise scales are contiguous fp32 ``[M, 1]``
and ``[1, N]`` with a bf16 output. Outputs here are always bf16 (the only dtype both
scalings accept on every Hopper software stack). Accumulation is fp32 (no fast accum).

**Emulation** (CPU, or ``emulate=True``): the same quantization, then dequantize (exact,
power-of-two scales) and matmul in fp32, rounded to the output dtype -- what the tensor
cores compute up to the order of fp32 accumulation.

The recipe *types* (:class:`GemmChoice`, :class:`Fp8Recipe`, the GEMM names and the
kernel counts the cost model prices) live in :mod:`gemc.fp8_recipe`, in the core, so the
precision pass chooses recipes without importing the runner. Imports torch and that only
(and, lazily, :mod:`gemc.backends.triton.fp8_quant` where the quantizer is ``triton``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from gemc.fp8_recipe import (
    ALIGN,
    ROWWISE,
    SCALINGS,
    TENSORWISE,
    Fp8Recipe,
    GemmChoice,
)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP8_OUT_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- quantization


def _amax(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """max |x| in fp32, over ``dim`` (kept) or the whole tensor: one reduction kernel."""
    if dim is None:
        return torch.linalg.vector_norm(x, ord=math.inf, dtype=torch.float32)
    return torch.linalg.vector_norm(x, ord=math.inf, dim=dim, keepdim=True, dtype=torch.float32)


AMAX_FLOOR = 1e-12
"""amax is floored here so 1/scale stays finite (a gradient row of 1e-40s would give an
infinite inverse and 0 * inf = NaN); values that small quantize to 0 either way."""


def pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1/scale) with scale = 2^e, e = floor(log2(amax / 448)) + 1: amax / scale
    lands in [224, 448).

    ``frexp(amax / 448) = m * 2^e`` with m in [0.5, 1) gives that e; the scale and its
    inverse are exact. The quotient is not formed: CUDA divides by a scalar as a multiply
    by its reciprocal, which rounds an amax one ulp below 448 2^k up to the edge (and the
    scale one binade up), so the e is read from ``frexp(amax) = m' 2^e'`` instead:
    448 = 0.875 2^9, so e = e' - 9, plus one when m' >= 0.875 — exact on every device, and
    the exponent the fused quantisation kernels compute from the bits."""
    mant, exp = torch.frexp(amax.clamp(min=AMAX_FLOOR))
    exp = exp - 9 + (mant >= E4M3_MAX / 512).to(exp.dtype)
    one = torch.ones_like(amax)
    return torch.ldexp(one, exp), torch.ldexp(one, -exp)


def quantize(
    x: torch.Tensor, scaling: str, dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in float8_e4m3fn, scale in fp32): the dequantized value is ``q * scale``.

    ``rowwise`` takes one amax per slice along ``dim`` (the contraction dimension: 1 for the
    left operand ``[M, K]``, 0 for the right ``[K, N]``), ``tensorwise`` one for all.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"unknown scaling {scaling!r}; use one of {SCALINGS}")
    if scaling == ROWWISE and dim is None:
        raise ValueError("row-wise scaling needs the contraction dim")
    amax = _amax(x, dim if scaling == ROWWISE else None)
    scale, inv = pow2_scale(amax)
    # Power-of-two scaling is exact in bf16 and fp32, so stay in x's dtype (fp16's narrow
    # exponent range could under/overflow the inverse: go through fp32 there).
    work = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
    return (work * inv.to(work.dtype)).to(E4M3), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


# ----------------------------------------------------------------------------- scaled matmul


def _is_row_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1) and t.stride(0) >= t.shape[1]


def _is_col_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(0) == 1 or t.shape[0] <= 1) and t.stride(1) >= t.shape[0]


def check_scaled_mm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> str:
    """Raise ValueError where ``torch._scaled_mm`` on Hopper would refuse; return the scaling.

    Applied on every path, so an emulated run on the CPU fails exactly where the GPU would.
    """
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"_scaled_mm takes matrices, got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"shapes cannot be multiplied: {m}x{k} and {k2}x{n}")
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise ValueError(f"operands must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if k % ALIGN or n % ALIGN:
        raise ValueError(
            f"K and N must be divisible by {ALIGN} (a {m}x{k} @ b {k}x{n}); pad or keep bf16"
        )
    if not _is_row_major(a):
        raise ValueError(f"a must be row-major, got strides {a.stride()} for {tuple(a.shape)}")
    if not _is_col_major(b):
        raise ValueError(f"b must be column-major, got strides {b.stride()} for {tuple(b.shape)}")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {scale_a.dtype} and {scale_b.dtype}")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        scaling = TENSORWISE
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"tensor-wise out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    elif tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        scaling = ROWWISE
        if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
            raise ValueError("row-wise scales must be contiguous")
        if out_dtype != torch.bfloat16:
            raise ValueError(f"row-wise scaling only outputs bf16, got {out_dtype}")
    else:
        raise ValueError(
            f"scales must both be single values (tensor-wise) or [M, 1]=[{m}, 1] and "
            f"[1, N]=[1, {n}] (row-wise), got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    if bias is not None:
        if out_dtype == torch.float32:
            raise ValueError("_scaled_mm takes no bias with an fp32 output")
        if bias.dtype not in (torch.bfloat16, torch.float16) or bias.numel() != n:
            raise ValueError(f"bias must be bf16/fp16 with {n} values")
    return scaling


def hardware_fp8(device: torch.device) -> bool:
    """Whether ``device`` runs ``_scaled_mm`` natively (CUDA, compute capability >= 8.9).

    Through ``get_device_properties``, which Dynamo folds to a constant when this runs in a
    compiled linear (``get_device_capability`` it would try to put in the graph)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor) >= (8, 9)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype = FP8_OUT_DTYPE,
    *,
    bias: torch.Tensor | None = None,
    emulate: bool | None = None,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` in ``out_dtype``: ``torch._scaled_mm`` on a
    GPU with fp8 tensor cores, else (or with ``emulate=True``) dequantize + fp32 matmul."""
    check_scaled_mm_args(a, b, scale_a, scale_b, out_dtype, bias)
    if emulate is None:
        emulate = not hardware_fp8(a.device)
    if not emulate:
        return torch._scaled_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
            use_fast_accum=False,
        )
    out = dequantize(a, scale_a) @ dequantize(b, scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _pad_contraction(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad K to a multiple of 16 (exact: zero products). Only the wgrad GEMM contracts
    over tokens, whose count a jagged batch does not promise to align."""
    k = a.shape[1]
    pad = -k % ALIGN
    if not pad:
        return a, b
    a = torch.cat([a, a.new_zeros(a.shape[0], pad)], dim=1)
    b = torch.cat([b, b.new_zeros(pad, b.shape[1])], dim=0)
    return a, b


ATEN_QUANT = "aten"
TRITON_QUANT = "triton"
QUANTIZERS = (ATEN_QUANT, TRITON_QUANT)
"""Who quantises a row-wise fp8 GEMM's operands. ``aten`` (the default): ATen ops in the
traced graph, which Inductor fuses into the operand's producer (a LayerNorm writes the fp8
activation). ``triton``: gemc's kernels (:mod:`gemc.backends.triton.fp8_quant`: one pass
per row-wise operand, the column-wise ones written transposed), which Inductor launches
from its own code on a GPU but does not fuse into, so the producer writes bf16 and the
kernel reads it back. Which is faster is measured, per shape,
by ``benchmarks/fp8_breakdown.py`` on the GPU; tensor-wise scaling always uses ``aten``."""
QUANTIZER_ENV = "GEMC_FP8_QUANTIZER"
"""Environment variable choosing the runner's quantizer (one of :data:`QUANTIZERS`)."""


def check_quantizer(quantizer: str) -> str:
    """``quantizer`` if it is one of :data:`QUANTIZERS`: a misspelt name fails where it is
    given, not as the ATen path silently taken."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"unknown fp8 quantizer {quantizer!r} (from the argument or "
                         f"{QUANTIZER_ENV}); use one of {QUANTIZERS}")
    return quantizer


def default_quantizer() -> str:
    """The quantizer of :data:`QUANTIZER_ENV`, else ``aten``: read where a site is built
    (outside any trace), never inside the compiled linear."""
    return check_quantizer(os.environ.get(QUANTIZER_ENV, ATEN_QUANT))


def _kernel_operands(a: torch.Tensor, b: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_quantized_operands` (row-wise) by gemc's Triton kernels, as ops (``triton_op``s
    on a GPU, which torch.compile decomposes into the kernel launches).

    Each operand is read in the layout it has: ``a`` whose rows are strided (``dy^T`` of the
    wgrad) and ``b`` whose columns are not (``x`` of the wgrad, ``W`` of the dgrad) go
    through the column kernel, which writes the transpose ``_scaled_mm`` wants and pads the
    contraction; the others through the row kernel (``b`` as its transpose's rows). Where
    the contraction needs padding but one side would not be padded by its kernel, both are
    padded first (ATen copies; no linear of gemc's takes that path: only the wgrad contracts
    over tokens, and both of its operands take the column kernel)."""
    from gemc.backends.triton import fp8_quant  # noqa: F401  (registers the ops)

    a_cols = a.stride(1) != 1 and a.stride(0) == 1
    b_rows = b.stride(0) == 1 and b.stride(1) != 1
    # the alignment tested last: on the wgrad's path (both column kernels) a symbolic token
    # count gets no guard on M % 16, so it is not recompiled for that
    if not (a_cols and not b_rows) and a.shape[1] % ALIGN:
        a, b = _pad_contraction(a, b)
        a_cols = b_rows = False
    rows, cols = torch.ops.gemc.fp8_quantize_rows, torch.ops.gemc.fp8_quantize_cols
    qa, sa = cols(a.t()) if a_cols else rows(a)
    qb, sb = rows(b.t()) if b_rows else cols(b)
    return qa, qb.t(), sa, sb.t()


def _quantized_operands(a: torch.Tensor, b: torch.Tensor, scaling: str,
                        quantizer: str = ATEN_QUANT
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qa, qb, scale_a, scale_b) of ``a[M, K] @ b[K, N]``: K padded to 16, each operand
    quantised along K and laid out as ``_scaled_mm`` wants -- ATen ops, traced and fused
    (or gemc's kernels: :data:`QUANTIZERS`)."""
    if quantizer == TRITON_QUANT and scaling == ROWWISE:
        return _kernel_operands(a.detach(), b.detach())
    a, b = _pad_contraction(a.detach(), b.detach())
    qa, sa = quantize(a, scaling, dim=1)
    qb, sb = quantize(b, scaling, dim=0)
    if not _is_row_major(qa):
        qa = qa.contiguous()
    if not _is_col_major(qb):
        qb = qb.t().contiguous().t()
    return qa, qb, sa, sb


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: str = ROWWISE,
    out_dtype: torch.dtype = FP8_OUT_DTYPE,
    *,
    emulate: bool | None = None,
) -> torch.Tensor:
    """``a[M, K] @ b[K, N]`` in fp8 from high-precision operands of any layout.

    Each operand is quantized along K (its own scales), then laid out as ``_scaled_mm``
    wants (row-major a, column-major b) -- the copy, where one is needed, moves fp8 bytes."""
    qa, qb, sa, sb = _quantized_operands(a, b, scaling)
    out = scaled_mm(qa, qb, sa, sb, FP8_OUT_DTYPE, emulate=emulate)
    return out if out_dtype == FP8_OUT_DTYPE else out.to(out_dtype)


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    choice: GemmChoice,
    out_dtype: torch.dtype,
    *,
    emulate: bool | None = None,
) -> torch.Tensor:
    """``a @ b`` in the precision ``choice`` says, returned in ``out_dtype``.

    bf16 on a CPU is emulated: bf16-rounded operands multiplied in fp32 (their products are
    exact there) and the result rounded to bf16 -- what a bf16 GEMM with fp32 accumulation
    computes, without CPUs' slow native bf16 matmul. Under an active autocast the matmuls
    here would be narrowed: callers turn it off (the linear's custom ops do)."""
    if choice.dtype == "fp8":
        return fp8_matmul(a, b, str(choice.scaling), out_dtype, emulate=emulate)
    if choice.dtype == "fp32":
        return (a.float() @ b.float()).to(out_dtype)
    if a.device.type == "cpu":
        out = a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float()
        return out.to(torch.bfloat16).to(out_dtype)
    return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).to(out_dtype)


# ----------------------------------------------------------------------------- custom ops
#
# Why custom ops and not an ``autograd.Function``: Dynamo traces an autograd.Function by
# speculating its forward and backward as subgraphs of a higher-order op, and torch 2.11's
# speculation failed on this one on the H200 (an AssertionError in
# ``overwrite_tensor_vt_proxy`` after a graph break at the call), while torch 2.13's passed.
# A ``torch.library.custom_op`` with a fake and an autograd formula is one node of an ordinary
# ATen graph on every torch version: Dynamo records it by its fake, AOTAutograd traces its
# backward formula (plain Python over ATen ops and these ops) into the backward graph, and
# Inductor calls it. What stays outside the ops -- every quantisation (amax, power-of-two
# scale, cast, layout copy) -- is ATen ops in the traced graphs, so Inductor still fuses the
# activation's quantisation into the kernel that produced it (a LayerNorm), forward and
# backward. Inside the ops only the GEMMs run, with autocast off: a real kernel call is not
# traced, so turning autocast off there is allowed on every version, and a compiled fp32
# GEMM is the eager one (the autograd.Function had to widen it to float64 instead). The
# backward's native fp8 GEMMs are the exception: ``torch._scaled_mm`` has no autocast rule,
# so the formula calls it directly and Inductor launches it without a Python op per call.


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _choice(label: str) -> GemmChoice:
    """The :class:`GemmChoice` of its ``label`` (an op argument is a string)."""
    for choice in (GemmChoice("fp32"), GemmChoice("bf16"), GemmChoice("fp8", ROWWISE),
                   GemmChoice("fp8", TENSORWISE)):
        if choice.label == label:
            return choice
    raise ValueError(f"unknown GEMM choice {label!r}")


@torch.library.custom_op("gemc::fp8_scaled_mm", mutates_args=())
def _scaled_mm_op(qa: torch.Tensor, qb: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, emulate: bool) -> torch.Tensor:
    """:func:`scaled_mm` to bf16 (the quantised operands in ``_scaled_mm``'s layouts)."""
    with _no_autocast(qa.device.type):
        return scaled_mm(qa, qb, scale_a, scale_b, FP8_OUT_DTYPE, emulate=emulate)


@_scaled_mm_op.register_fake
def _(qa: torch.Tensor, qb: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
      emulate: bool) -> torch.Tensor:
    return qa.new_empty(qa.shape[0], qb.shape[1], dtype=FP8_OUT_DTYPE)


@torch.library.custom_op("gemc::wide_mm", mutates_args=())
def _wide_mm_op(a: torch.Tensor, b: torch.Tensor, choice: str, out_dtype: str) -> torch.Tensor:
    """``a @ b`` in fp32 or bf16 (:func:`gemm`) with autocast off."""
    with _no_autocast(a.device.type):
        return gemm(a, b, _choice(choice), _dtype(out_dtype))


@_wide_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, choice: str, out_dtype: str) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1], dtype=_dtype(out_dtype))


def _op_gemm(a: torch.Tensor, b: torch.Tensor, choice: GemmChoice, out_dtype: torch.dtype,
             emulate: bool, quantizer: str = ATEN_QUANT) -> torch.Tensor:
    """:func:`gemm`'s values, its GEMM ``torch._scaled_mm`` (a custom op where emulated) and
    its quantisation ATen ops (or the ``quantizer``'s kernels)."""
    if choice.dtype != "fp8":
        return torch.ops.gemc.wide_mm(a, b, choice.label, _dtype_name(out_dtype))
    qa, qb, sa, sb = _quantized_operands(a, b, str(choice.scaling), quantizer)
    if emulate:
        out = torch.ops.gemc.fp8_scaled_mm(qa, qb, sa, sb, True)
    else:
        # The ATen op itself, not gemc's wrapper op: traced into the backward graph, Inductor
        # calls it as an extern kernel from its generated code, where the wrapper cost a
        # Python custom-op dispatch and these checks per call (~95 us host on the H200,
        # benchmarks/results/session11/fp8_unit_profile.json). The contract is checked here,
        # at trace time; autocast has no rule for ``_scaled_mm`` (its dtypes are explicit).
        check_scaled_mm_args(qa, qb, sa, sb, FP8_OUT_DTYPE)
        out = torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=FP8_OUT_DTYPE,
                               use_fast_accum=False)
    return out if out_dtype == FP8_OUT_DTYPE else out.to(out_dtype)


@torch.library.custom_op("gemc::fp8_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               qx: torch.Tensor | None, qw: torch.Tensor | None, sx: torch.Tensor | None,
               sw: torch.Tensor | None, fwd: str, dgrad: str, wgrad: str, out_dtype: str,
               emulate: bool, quantizer: str = ATEN_QUANT) -> torch.Tensor:
    """``x[M, K] W[N, K]^T + b``: from the quantised ``qx``, ``qw^T`` and their scales when
    ``fwd`` is fp8 (quantised by the caller, outside the op, where Inductor fuses it), else
    from ``x`` and ``weight``. ``x`` and ``weight`` are inputs either way: the autograd
    formula saves them for the backward's GEMMs (``dgrad``, ``wgrad``), whose operands
    ``quantizer`` quantises (:data:`QUANTIZERS`)."""
    dtype = _dtype(out_dtype)
    with _no_autocast(x.device.type):
        if qx is not None and qw is not None and sx is not None and sw is not None:
            y = scaled_mm(qx, qw, sx, sw, FP8_OUT_DTYPE, emulate=emulate).to(dtype)
        else:
            y = gemm(x, weight.t(), _choice(fwd), dtype, emulate=emulate)
        if bias is not None:
            y = y + bias.to(dtype)
    return y


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      qx: torch.Tensor | None, qw: torch.Tensor | None, sx: torch.Tensor | None,
      sw: torch.Tensor | None, fwd: str, dgrad: str, wgrad: str, out_dtype: str,
      emulate: bool, quantizer: str = ATEN_QUANT) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=_dtype(out_dtype))


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias, _, _, _, _, _, dgrad, wgrad, _, emulate, *quantizer = inputs
    ctx.save_for_backward(x, weight)
    ctx.dgrad, ctx.wgrad, ctx.emulate = _choice(dgrad), _choice(wgrad), emulate
    ctx.quantizer = quantizer[0] if quantizer else ATEN_QUANT
    ctx.has_bias = bias is not None


def _linear_backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """dx = dy W (``dgrad``), dW = dy^T x (``wgrad``), db = the fp32 sum of dy: the high-
    precision x and W saved, quantised again along the backward GEMMs' contractions (a
    row-wise scale of the forward is not the scale they need)."""
    x, weight = ctx.saved_tensors
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = _op_gemm(dy, weight, ctx.dgrad, x.dtype, ctx.emulate, ctx.quantizer)
    if ctx.needs_input_grad[1]:
        dw = _op_gemm(dy.t(), x, ctx.wgrad, weight.dtype, ctx.emulate, ctx.quantizer)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = dy.sum(0, dtype=torch.float32)
    return dx, dw, db, *([None] * 10)


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: Fp8Recipe,
    *,
    out_dtype: torch.dtype | None = None,
    emulate: bool | None = None,
    quantizer: str = ATEN_QUANT,
) -> torch.Tensor:
    """``F.linear`` with the recipe's precisions; leading dims of x are flattened into M.
    ``quantizer`` quantises the row-wise operands, forward and backward (:data:`QUANTIZERS`).

    ``out_dtype`` defaults to the autocast dtype when autocast is on (what ``nn.Linear``
    returns there), else x's dtype. ``emulate=None``: emulate unless the device runs
    ``_scaled_mm`` natively.

    One ``gemc::fp8_linear`` node (see the custom ops above for why not an autograd.Function)
    with the forward's quantisations in front of it as ATen ops: under ``torch.compile``
    Inductor fuses the activation's into the kernel that produced it (a LayerNorm writes the
    fp8 activation and its row scales) and the weight's is one pass over the weight; the
    backward formula quantises the output gradient the same way."""
    if out_dtype is None:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if emulate is None:
        emulate = not hardware_fp8(x.device)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    check_quantizer(quantizer)
    qx = qw = sx = sw = None
    with _no_autocast(x.device.type):
        if recipe.fwd.dtype == "fp8":
            qx, qw, sx, sw = _quantized_operands(x2, weight.t(), str(recipe.fwd.scaling),
                                                 quantizer)
        y = torch.ops.gemc.fp8_linear(x2, weight, bias, qx, qw, sx, sw, recipe.fwd.label,
                                      recipe.dgrad.label, recipe.wgrad.label,
                                      _dtype_name(out_dtype), bool(emulate), quantizer)
    return y.reshape(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run as its :class:`Fp8Recipe` says.

    A subclass holding the *same* Parameter objects as the layer it replaces, so FQNs,
    state dicts, optimizers, FSDP and ``reset_parameters`` see no difference. Swap before
    installing hooks or wrappers on the layer: the new module does not inherit them."""

    recipe: Fp8Recipe
    emulate: bool | None
    quantizer: str

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, recipe: Fp8Recipe, *, emulate: bool | None = None,
        quantizer: str | None = None,
    ) -> Fp8Linear:
        """``quantizer``: default :func:`default_quantizer` (read here, not in forward)."""
        check_linear_dims(linear.in_features, linear.out_features)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)  # a Parameter or None, like nn.Linear
        new.recipe, new.emulate = recipe, emulate
        new.quantizer = check_quantizer(quantizer or default_quantizer())
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe, emulate=self.emulate,
                          quantizer=self.quantizer)

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{super().extra_repr()}, fwd={r.fwd.label}, dgrad={r.dgrad.label}, "
            f"wgrad={r.wgrad.label}"
        )


def check_linear_dims(in_features: int, out_features: int) -> None:
    """Every fp8 GEMM of a linear layer has K or N in {in_features, out_features}."""
    if in_features % ALIGN or out_features % ALIGN:
        raise ValueError(
            f"fp8 needs in/out features divisible by {ALIGN}, got {in_features} -> {out_features}"
        )


def swap_linear(
    model: nn.Module, fqn: str, recipe: Fp8Recipe, *, emulate: bool | None = None
) -> Fp8Linear:
    """Replace the ``nn.Linear`` at ``fqn`` by an :class:`Fp8Linear` (in place, same params)."""
    module = model.get_submodule(fqn)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{fqn} is a {type(module).__name__}, not an nn.Linear: fp8 applies "
                         "to linear layers only")
    new = Fp8Linear.from_linear(module, recipe, emulate=emulate)
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
    return new


def swap_linears(
    model: nn.Module, recipes: Mapping[str, Fp8Recipe], *, emulate: bool | None = None
) -> list[str]:
    """Swap every FQN of ``recipes`` whose recipe has an fp8 GEMM; returns those swapped."""
    done = []
    for fqn in sorted(recipes):
        if recipes[fqn].any_fp8:
            swap_linear(model, fqn, recipes[fqn], emulate=emulate)
            done.append(fqn)
    return done

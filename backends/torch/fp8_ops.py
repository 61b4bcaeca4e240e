"""The fp8 linear layer as ``torch.library`` custom ops, with its quantisation fused.

Two ops, one recipe:

* ``gemc::fp8_linear(x, weight, bias, wgrad_fp8)``: ``y = x W^T + b`` for a producer gemc
  does not generate (Inductor's): x is quantised by the one-pass row-wise kernel of
  :mod:`gemc.backends.triton.fp8_quant` (3 bytes an element for bf16, instead of the 9-17
  of eager amax / scale / cast kernels).
* ``gemc::norm_fp8_linear(x, norm_weight, norm_bias, eps, kind, weight, bias, wgrad_fp8)``:
  ``y = Linear(Norm(x))`` where the norm (LayerNorm or RMSNorm) writes its output straight
  in fp8 with its row scales (:func:`~gemc.backends.triton.fp8_quant.norm_quant`): the
  normalised activation never exists in bf16, so quantising it costs nothing and the norm
  writes half the bytes. The backward recomputes the normalised rows from x and the saved
  mean and 1/std (the norm's own backward needs them anyway) for the weight gradient.

**Recipe** (the one torchao calls "rowwise"; learned from its documentation): dynamic
scaling, e4m3 for activations, weights and gradients, one power-of-two scale per row of
each operand along the GEMM's contraction dimension, bf16 output, fp32 accumulation.

=========  ===========================  ============================================
GEMM       computes                     precision
=========  ===========================  ============================================
forward    ``y = x W^T``                fp8: x per token, W per output feature
dgrad      ``dx = dy W``                fp8: dy per token, W per input feature
wgrad      ``dW = dy^T x``              fp8 (``wgrad_fp8``): dy and x per feature,
                                        scaled along the tokens; else bf16 -- torchao's
                                        "rowwise with high-precision grad_weight"
=========  ===========================  ============================================

The bias (added after the GEMM in the output dtype) and its gradient (an fp32 sum) and the
norm's backward (fp32 math on the recomputed rows) are not GEMMs and stay high precision.
The forward saves the high-precision x and W (as a bf16 linear does) and quantises again
along the other axes in the backward: a forward row scale is not the scale a backward GEMM
needs.

**Where it runs.** On CUDA: the Triton kernels and ``torch._scaled_mm`` (fp8 tensor cores,
compute capability >= 8.9). Elsewhere (the CPU tests, CPU probes): the same quantisation as
torch ops (:func:`gemc.backends.torch.fp8.quantize`, which the kernels match bit for bit)
and :func:`gemc.backends.torch.fp8.scaled_mm`'s exact emulation -- dequantise (exact,
power-of-two scales) and multiply in fp32 -- the same numbers as the tensor cores up to the
order of fp32 accumulation. The backward formulas are ordinary torch ops around the opaque
GEMM op, so AOTAutograd traces them and Inductor fuses the norm's backward in graph mode.
"""

from __future__ import annotations

from typing import Any

import torch
from gemc.backends.triton import fp8_quant
from torch import Tensor

from gemc.fp8_recipe import BF16, ROWWISE

from . import fp8

OUT = fp8.FP8_OUT_DTYPE
NORMS = fp8_quant.NORMS


# ----------------------------------------------------------------------------- quantisation


def quant_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x[R, C]`` -> (e4m3 ``[R, C]`` row-major, fp32 ``[R, 1]``), scaled per row (rows
    wider than one program holds go through the tiled column kernel on x^T: same values)."""
    if x.is_cuda:
        if x.shape[1] > fp8_quant.MAX_ROW:
            return fp8_quant.colwise_quant(x.t())
        return fp8_quant.rowwise_quant(x)
    q, s = fp8.quantize(x, ROWWISE, dim=1)
    return q.contiguous(), s


def quant_cols(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x[R, C]`` -> (e4m3 ``x^T`` as ``[C, R]`` row-major, fp32 ``[C, 1]``), per column."""
    if x.is_cuda:
        return fp8_quant.colwise_quant(x)
    q, s = fp8.quantize(x, ROWWISE, dim=0)
    return q.t().contiguous(), s.reshape(-1, 1)


def _row_major(t: Tensor) -> bool:
    return t.stride(1) == 1 or t.shape[1] <= 1


def quant_left(a: Tensor) -> tuple[Tensor, Tensor]:
    """``_scaled_mm``'s left operand ``a[M, K]`` quantised per row: (row-major e4m3, ``[M, 1]``)
    in one pass, by the kernel that reads a's memory order (a transposed view -- dy^T of the
    weight gradient -- is quantised along its columns, which writes it transposed back)."""
    if _row_major(a):
        return quant_rows(a)
    return quant_cols(a.t())


def quant_right(b: Tensor) -> tuple[Tensor, Tensor]:
    """``_scaled_mm``'s right operand ``b[K, N]`` quantised per column: (column-major e4m3,
    ``[1, N]``) in one pass. ``W^T`` of the forward is a row-wise pass over W; any other
    layout takes the column kernel, which writes the column-major copy as it quantises."""
    bt = b.t()
    q, s = quant_rows(bt) if _row_major(bt) else quant_cols(b)
    return q.t(), s.reshape(1, -1)


def norm_rows(x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
              rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(normalised rows without the affine, with it) in fp32, from the saved statistics."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    h = xhat if weight is None else xhat * weight.float()
    return xhat, (h if bias is None else h + bias.float())


def norm_quant(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
               kind: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Normalise and quantise the rows of ``x``: (q, scales, mean, 1/std), the fused kernel on
    CUDA, the same statistics and quantisation as torch ops elsewhere."""
    if x.is_cuda:
        return fp8_quant.norm_quant(x, weight, bias, eps, kind)
    xf = x.float()
    mean = xf.mean(1) if kind == fp8_quant.LAYER else xf.new_zeros(xf.shape[0])
    centred = xf - mean[:, None]
    rstd = (centred.square().mean(1) + eps).rsqrt()
    _, h = norm_rows(x, weight, bias, mean, rstd)
    q, s = quant_rows(h)
    return q, s, mean, rstd


# ----------------------------------------------------------------------------- GEMMs


def forward_gemm(q: Tensor, s: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``(q * s) @ W^T + b`` in bf16: W quantised per output feature."""
    y = _scaled(q, s, *quant_right(weight.t()))
    return y if bias is None else y + bias.to(OUT)


def _scaled(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor) -> Tensor:
    return fp8.scaled_mm(qa, qb, sa, sb, OUT)


def grad_gemms(dy: Tensor, h: Tensor, weight: Tensor, wgrad_fp8: bool, need_dx: bool,
               need_dw: bool) -> tuple[Tensor | None, Tensor | None]:
    """(dgrad ``dy W`` in bf16, wgrad ``dy^T h`` in W's dtype), as the recipe says."""
    dx = dw = None
    if need_dx:
        dx = _scaled(*quant_left(dy), *quant_right(weight))
    if need_dw:
        if wgrad_fp8:
            # the tokens' count need not be aligned: zero-padded (exact) where it is not
            a, b = fp8.pad_contraction(dy.t(), h)
            dw = _scaled(*quant_left(a), *quant_right(b))
        else:
            dw = fp8.gemm(dy.t(), h, BF16, OUT)
        dw = dw.to(weight.dtype)
    return dx, dw


# ----------------------------------------------------------------------------- ops


def _check(x: Tensor, weight: Tensor, where: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: x [M, K] and weight [N, K] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    fp8.check_linear_dims(weight.shape[1], weight.shape[0])


@torch.library.custom_op("gemc::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, wgrad_fp8: bool) -> Tensor:
    """``x[M, K] W[N, K]^T + b`` in bf16, forward GEMM in fp8 (x quantised in one pass)."""
    _check(x, weight, "gemc::fp8_linear")
    q, s = quant_left(x)
    return forward_gemm(q, s, weight, bias)


@fp8_linear.register_fake
def _fp8_linear_fake(x: Tensor, weight: Tensor, bias: Tensor | None, wgrad_fp8: bool
                     ) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=OUT)


@torch.library.custom_op("gemc::fp8_linear_grads", mutates_args=())
def fp8_linear_grads(dy: Tensor, h: Tensor, weight: Tensor, wgrad_fp8: bool, need_dx: bool,
                     need_dw: bool) -> list[Tensor]:
    """The dgrad and wgrad GEMMs of the recipe: ``[dx]`` and/or ``[dW]``, as asked."""
    dx, dw = grad_gemms(dy, h, weight, wgrad_fp8, need_dx, need_dw)
    return [t for t in (dx, dw) if t is not None]


@fp8_linear_grads.register_fake
def _fp8_linear_grads_fake(dy: Tensor, h: Tensor, weight: Tensor, wgrad_fp8: bool,
                           need_dx: bool, need_dw: bool) -> list[Tensor]:
    out = []
    if need_dx:
        out.append(dy.new_empty((dy.shape[0], weight.shape[1]), dtype=OUT))
    if need_dw:
        out.append(weight.new_empty(weight.shape))
    return out


def _grads(dy: Tensor, h: Tensor, weight: Tensor, wgrad_fp8: bool, need_dx: bool,
           need_dw: bool) -> tuple[Tensor | None, Tensor | None]:
    got = iter(torch.ops.gemc.fp8_linear_grads(dy.contiguous(), h, weight, wgrad_fp8,
                                               need_dx, need_dw) if need_dx or need_dw else [])
    return (next(got) if need_dx else None), (next(got) if need_dw else None)


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, bias, wgrad_fp8 = inputs
    ctx.save_for_backward(x, weight)
    ctx.wgrad_fp8, ctx.has_bias = wgrad_fp8, bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _linear_backward(ctx: Any, dy: Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx, dw = _grads(dy, x, weight, ctx.wgrad_fp8, need_x, need_w)
    db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.has_bias and need_b else None
    return (None if dx is None else dx.to(x.dtype)), dw, db, None


fp8_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


@torch.library.custom_op("gemc::norm_fp8_linear", mutates_args=())
def norm_fp8_linear(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None,
                    eps: float, kind: str, weight: Tensor, bias: Tensor | None,
                    wgrad_fp8: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(``Linear(Norm(x))`` in bf16, the norm's per-row mean, its 1/std): the norm writes
    fp8 and its scales, the forward GEMM reads them."""
    _check(x, weight, "gemc::norm_fp8_linear")
    if kind not in NORMS:
        raise ValueError(f"gemc::norm_fp8_linear: unknown norm {kind!r}, use one of {NORMS}")
    q, s, mean, rstd = norm_quant(x, norm_weight, norm_bias, eps, kind)
    return forward_gemm(q, s, weight, bias), mean, rstd


@norm_fp8_linear.register_fake
def _norm_fp8_linear_fake(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None,
                          eps: float, kind: str, weight: Tensor, bias: Tensor | None,
                          wgrad_fp8: bool) -> tuple[Tensor, Tensor, Tensor]:
    m = x.shape[0]
    stat = x.new_empty((m,), dtype=torch.float32)
    return x.new_empty((m, weight.shape[0]), dtype=OUT), stat, stat.clone()


def _norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, nw, nb, eps, kind, weight, bias, wgrad_fp8 = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, nw, nb, weight, mean, rstd)
    ctx.kind, ctx.wgrad_fp8 = kind, wgrad_fp8
    ctx.bias_dtype = None if bias is None else bias.dtype


def _norm_backward(ctx: Any, dy: Tensor, _dmean: Any, _drstd: Any) -> tuple[Any, ...]:
    x, nw, nb, weight, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_h = need[0] or need[1] or need[2]
    xhat, h = norm_rows(x, nw, nb, mean, rstd)
    dh, dw = _grads(dy, h, weight, ctx.wgrad_fp8, need_h, need[5])
    dx = dnw = dnb = None
    if dh is not None:
        dh = dh.float()
        g = dh if nw is None else dh * nw.float()
        proj = (g * xhat).mean(1, keepdim=True)
        centre = g.mean(1, keepdim=True) if ctx.kind == fp8_quant.LAYER else 0.0
        dx = ((g - centre - xhat * proj) * rstd[:, None]).to(x.dtype) if need[0] else None
        dnw = (dh * xhat).sum(0).to(nw.dtype) if nw is not None and need[1] else None
        dnb = dh.sum(0).to(nb.dtype) if nb is not None and need[2] else None
    db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.bias_dtype is not None and need[6] \
        else None
    return dx, dnw, dnb, None, None, dw, db, None


norm_fp8_linear.register_autograd(_norm_backward, setup_context=_norm_setup)


# ----------------------------------------------------------------------------- entry points


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
           wgrad_fp8: bool = True) -> Tensor:
    """``F.linear`` through ``gemc::fp8_linear`` (leading dims of x flattened into M)."""
    y = torch.ops.gemc.fp8_linear(x.reshape(-1, x.shape[-1]), weight, bias, wgrad_fp8)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def norm_linear(x: Tensor, norm_weight: Tensor | None, norm_bias: Tensor | None, eps: float,
                weight: Tensor, bias: Tensor | None = None, *, kind: str = fp8_quant.LAYER,
                wgrad_fp8: bool = True) -> Tensor:
    """``F.linear(norm(x), weight, bias)`` through ``gemc::norm_fp8_linear``."""
    y, _, _ = torch.ops.gemc.norm_fp8_linear(x.reshape(-1, x.shape[-1]), norm_weight,
                                             norm_bias, float(eps), kind, weight, bias,
                                             wgrad_fp8)
    return y.reshape(*x.shape[:-1], weight.shape[0])

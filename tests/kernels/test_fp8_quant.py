"""Row-wise fp8 quantisation kernels (alone and fused into LayerNorm / RMSNorm) against
:func:`gemc.backends.torch.fp8.quantize` on the eager norm.

On the CPU (Triton interpreter) the kernels stage their scaled values in fp32 and the host
casts them (the interpreter's own fp8 cast rounds wrongly): these tests then check the
amax, the power-of-two scales, every scaled value and the norm math bit for bit, and the
cast only as torch performs it. ``GEMC_TEST_DEVICE=cuda`` runs the same tests on the GPU,
where the kernels cast in registers: that is the test of the in-kernel cast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.torch import fp8
from gemc.backends.triton import fp8_quant as fq
from kernel_helpers import fresh_generator


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _data(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = fresh_generator()
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).mul(50)
    x[rows // 2, 3] = 1e3  # one outlier: its row's scale, not the others'
    x[1] = 0.0  # an all-zero row: the amax floor keeps the scale finite
    return x.to(dtype).to(torch.get_default_device())


def test_constants_match_the_torch_definition() -> None:
    assert fq.AMAX_FLOOR == fp8.AMAX_FLOOR and fq.E4M3_MAX == fp8.E4M3_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 200), (5, 16), (150, 40)])  # 150: 3 row tiles
def test_rowwise_and_colwise_match_torch_quantize(dtype: torch.dtype, shape: tuple) -> None:
    x = _data(*shape, dtype)
    q, s = fq.rowwise_quant(x)
    ref_q, ref_s = fp8.quantize(x, "rowwise", dim=1)
    assert q.dtype == fp8.E4M3 and q.is_contiguous() and s.shape == (shape[0], 1)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    assert torch.equal(_bits(q), _bits(ref_q))
    # a transposed (column-major) view: the kernel reads any strides
    qt, st = fq.rowwise_quant(x.t().contiguous().t())
    assert torch.equal(_bits(qt), _bits(ref_q)) and torch.equal(st, ref_s)
    # rows too wide for one program go through the column kernel on x^T: the same values
    qw, sw = fq.colwise_quant(x.t())
    assert torch.equal(_bits(qw), _bits(ref_q)) and torch.equal(sw, ref_s)

    qc, sc = fq.colwise_quant(x)
    ref_qc, ref_sc = fp8.quantize(x, "rowwise", dim=0)
    assert qc.shape == (shape[1], shape[0]) and qc.is_contiguous()
    torch.testing.assert_close(sc, ref_sc.t().contiguous(), rtol=0, atol=0)
    assert torch.equal(_bits(qc), _bits(ref_qc.t().contiguous()))


def test_scale_puts_the_row_amax_in_the_top_binade() -> None:
    x = _data(64, 48, torch.float32)
    q, s = fq.rowwise_quant(x)
    top = q.float().abs().amax(1)
    live = x.abs().amax(1) > 0
    assert bool(((top[live] >= 224) & (top[live] <= 448)).all())
    assert bool(torch.isfinite(s).all()) and bool((q.float()[1] == 0).all())


@pytest.mark.parametrize("kind,affine", [("layer", True), ("layer", False), ("rms", True)])
def test_norm_quant_matches_eager_norm_then_quantize(kind: str, affine: bool) -> None:
    g = fresh_generator()
    x = _data(29, 96, torch.bfloat16)
    w = (torch.randn(96, generator=g) if affine else None)
    b = (torch.randn(96, generator=g) if affine and kind == "layer" else None)
    if w is not None:
        w = w.to(x.device)
    if b is not None:
        b = b.to(x.device)
    q, s, mean, rstd = fq.norm_quant(x, w, b, 1e-5, kind)
    xf = x.float()
    if kind == "layer":
        ref = F.layer_norm(xf, (96,), w, b, 1e-5)
        torch.testing.assert_close(mean, xf.mean(1))
        torch.testing.assert_close(rstd, (xf.var(1, unbiased=False) + 1e-5).rsqrt())
    else:
        ref = F.rms_norm(xf, (96,), w, 1e-5)
        assert bool((mean == 0).all())
        torch.testing.assert_close(rstd, (xf.square().mean(1) + 1e-5).rsqrt())
    ref_q, ref_s = fp8.quantize(ref, "rowwise", dim=1)
    # fp32 reduction order may move a value across an fp8 rounding boundary: at most one
    # fp8 step, on a handful of elements; the scales (binades of the amax) agree
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    step = (fp8.dequantize(q, s) - fp8.dequantize(ref_q, ref_s)).abs()
    assert bool((step <= ref.abs() * 2**-3 + s * 2**-9).all())
    assert int((_bits(q) != _bits(ref_q)).sum()) <= max(1, q.numel() // 200)
    torch.testing.assert_close(fp8.dequantize(q, s), ref, rtol=2**-4, atol=float(s.max()) * 2**-9)


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="matrices"):
        fq.rowwise_quant(torch.zeros(3))
    with pytest.raises(TypeError, match="fp32/bf16"):
        fq.rowwise_quant(torch.zeros(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        fq.norm_quant(torch.zeros(2, 16), None, torch.zeros(16), 1e-5, "rms")
    with pytest.raises(ValueError, match="unknown norm"):
        fq.norm_quant(torch.zeros(2, 16), None, None, 1e-5, "batch")

"""The fp8 linear custom ops (``gemc::fp8_linear``, ``gemc::norm_fp8_linear``): forward and
backward against dequantise-then-matmul references on fresh random inputs, the SQNR of the
fp8 path against bf16's, and the op registrations (fake, autograd) through ``opcheck``.

On the CPU the ops quantise with torch ops and emulate ``_scaled_mm`` exactly; with
``GEMC_TEST_DEVICE=cuda`` the same tests run the Triton kernels and the fp8 tensor cores
(then the references differ from the op by fp32 accumulation order only).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.torch import fp8, fp8_ops

from gemc.probe_types import sqnr_db
from tests.precision.conftest import DEVICE

BF16 = torch.bfloat16
SQNR_BOUND_DB = 25.0
"""fp8 e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4, ~30 dB for one operand
of Gaussian data); two quantised operands through a K-long dot product measure ~28 dB.
25 dB is the precision pass's own per-GEMM bound (PrecisionOptions.min_sqnr_db)."""


def _gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**31)
    print(f"torch generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE)


def _deq_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t quantised row-wise along ``dim`` (the torch definition), dequantised in fp32."""
    return fp8.dequantize(*fp8.quantize(t, "rowwise", dim=dim))


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dy: torch.Tensor,
               wgrad_fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dx, dW) of the recipe by dequantise-then-matmul in fp32, rounded to bf16."""
    y = _deq_rows(x, 1) @ _deq_rows(w, 1).t()
    y = y.to(BF16) + (b.to(BF16) if b is not None else 0)
    dx = (_deq_rows(dy, 1) @ _deq_rows(w, 0)).to(BF16)
    if wgrad_fp8:
        dw = _deq_rows(dy, 0).t() @ _deq_rows(x, 0)
    else:
        dw = dy.to(BF16).float().t() @ x.to(BF16).float()
    return y, dx, dw.to(BF16).to(w.dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # both sides round the same fp32 sums to bf16; accumulation order moves a few by an ulp
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("wgrad_fp8", [True, False])
@pytest.mark.parametrize("m", [64, 40])  # 40 tokens: the wgrad GEMM pads its contraction
def test_fp8_linear_matches_dequantise_then_matmul(wgrad_fp8: bool, m: int) -> None:
    g = _gen()
    x = _randn(g, m, 48, scale=3.0).to(BF16).requires_grad_()
    w = _randn(g, 32, 48, scale=0.2).requires_grad_()
    b = _randn(g, 32).requires_grad_()
    dy = _randn(g, m, 32).to(BF16)
    y = fp8_ops.linear(x, w, b, wgrad_fp8=wgrad_fp8)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    ry, rdx, rdw = _reference(x.detach(), w.detach(), b.detach(), dy, wgrad_fp8)
    assert y.dtype == BF16 and dx.dtype == BF16 and dw.dtype == torch.float32
    _close(y, ry)
    _close(dx, rdx)
    _close(dw, rdw)
    torch.testing.assert_close(db, dy.float().sum(0))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_fp8_linear_matches_reference(kind: str) -> None:
    g = _gen()
    x = (_randn(g, 48, 64) * 4 + 1).to(BF16).requires_grad_()
    nw = (1 + 0.1 * _randn(g, 64)).requires_grad_()
    nb = (0.1 * _randn(g, 64)).requires_grad_() if kind == "layer" else None
    w = _randn(g, 32, 64, scale=0.2).requires_grad_()
    dy = _randn(g, 48, 32).to(BF16)
    y = fp8_ops.norm_linear(x, nw, nb, 1e-5, w, None, kind=kind)
    leaves = [t for t in (x, nw, nb, w) if t is not None]
    grads = torch.autograd.grad(y, leaves, dy)

    # reference: the eager norm in fp32, then the recipe's GEMMs by dequantise-then-matmul,
    # and the norm's backward by autograd from the reference dgrad
    xr = x.detach().float().requires_grad_()
    nwr = nw.detach().requires_grad_()
    nbr = nb.detach().requires_grad_() if nb is not None else None
    h = (F.layer_norm(xr, (64,), nwr, nbr, 1e-5) if kind == "layer"
         else F.rms_norm(xr, (64,), nwr, 1e-5))
    ry, rdh, rdw = _reference(h.detach(), w.detach(), None, dy, True)
    ref_grads = torch.autograd.grad(h, [t for t in (xr, nwr, nbr) if t is not None],
                                    rdh.float())
    _close(y, ry)
    _close(grads[-1], rdw)
    torch.testing.assert_close(grads[0].float(), ref_grads[0].to(BF16).float(), rtol=2**-7,
                               atol=1e-3)
    for got, want in zip(grads[1:-1], ref_grads[1:]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fp8_path_sqnr_against_bf16_holds_the_bound() -> None:
    """fp8 y, dx, dW against the fp32 truth, beside bf16's: above the bound, and below
    bf16's (it would fail if the op silently ran bf16)."""
    g = _gen()
    x = _randn(g, 256, 256).requires_grad_()
    w = _randn(g, 128, 256, scale=256**-0.5).requires_grad_()
    dy = _randn(g, 256, 128)
    y8 = fp8_ops.linear(x, w, None)
    got8 = (y8, *torch.autograd.grad(y8, (x, w), dy))
    y32 = x @ w.t()
    truth = (y32, *torch.autograd.grad(y32, (x, w), dy))
    xb, wb = x.detach().to(BF16).float(), w.detach().to(BF16).float()
    dyb = dy.to(BF16).float()
    bf16 = ((xb @ wb.t()).to(BF16), (dyb @ wb).to(BF16), dyb.t() @ xb)
    for name, a, b16, t in zip(("y", "dx", "dW"), got8, bf16, truth):
        db8, db16 = sqnr_db(t.detach(), a.detach().float()), sqnr_db(t.detach(), b16.float())
        print(f"{name}: fp8 {db8:.1f} dB, bf16 {db16:.1f} dB")
        assert db8 >= SQNR_BOUND_DB, f"{name}: fp8 SQNR {db8:.1f} dB < {SQNR_BOUND_DB} dB"
        assert db8 < db16 - 6, f"{name}: fp8 as accurate as bf16 ({db8:.1f} dB): not fp8?"


def test_ops_pass_opcheck() -> None:
    g = _gen()
    x = _randn(g, 32, 32).to(BF16).requires_grad_()
    w = _randn(g, 16, 32).requires_grad_()
    b = _randn(g, 16).requires_grad_()
    nw = _randn(g, 32).requires_grad_()
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.gemc.fp8_linear.default, (x, w, b, True),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.gemc.norm_fp8_linear.default,
                          (x, nw, None, 1e-5, "rms", w, b, False), test_utils=checks)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        fp8_ops.linear(torch.zeros(4, 24), torch.zeros(16, 24))
    with pytest.raises(ValueError, match="unknown norm"):
        fp8_ops.norm_linear(torch.zeros(4, 32), None, None, 1e-5, torch.zeros(16, 32),
                            kind="batch")


def test_ops_trace_through_aot_autograd() -> None:
    """Graph mode: Dynamo + AOTAutograd trace both ops by their fakes and their backward
    formulas, and the compiled step computes what the eager one does."""
    g = _gen()
    x = (_randn(g, 32, 32) * 2).to(BF16)
    nw, w, w2 = _randn(g, 32), _randn(g, 16, 32, scale=0.2), _randn(g, 16, 16, scale=0.2)

    def step(x: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, w2: torch.Tensor
             ) -> torch.Tensor:
        h = fp8_ops.norm_linear(x, nw, None, 1e-5, w, kind="rms")
        return fp8_ops.linear(h, w2, None).float().square().sum()

    def grads(fn: object) -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in (x, nw, w, w2)]
        return list(torch.autograd.grad(fn(*leaves), leaves))  # type: ignore[operator]

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(grads(compiled), grads(step)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_matmul_one_pass_and_eager_quantisation_agree(transposed: bool) -> None:
    """Fp8Linear's GEMMs: the one-pass layout-aware quantisers (default) and the eager
    kernels give the same fp8 values, so the same product, for either operand layout."""
    g = _gen()
    a = _randn(g, 48, 64, scale=3.0)
    b = _randn(g, 64, 32)
    if transposed:  # dy^T and x of the weight gradient: neither in _scaled_mm's layout
        a, b = a.t().contiguous().t(), b.t().contiguous().t()
    one = fp8.fp8_matmul(a, b, "rowwise")
    eager = fp8.fp8_matmul(a, b, "rowwise", one_pass=False)
    assert one.dtype == eager.dtype == BF16
    torch.testing.assert_close(one, eager, rtol=0, atol=0)

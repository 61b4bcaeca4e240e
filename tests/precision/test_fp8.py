"""The fp8 GEMM: quantization, _scaled_mm's contract, numerics, and the autograd linear."""

from __future__ import annotations

import math

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.torch.fp8 import E4M3
from torch import nn

from gemc.fp8_recipe import BF16, FP8_ROW, FP8_TENSOR, Fp8Recipe, GemmChoice
from tests.precision.conftest import DEVICE, sqnr


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(DEVICE)


# ----------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_uses_exact_power_of_two_scales(dtype: torch.dtype) -> None:
    x = (_randn(64, 32) * torch.logspace(-3, 3, 64, device=DEVICE)[:, None]).to(dtype)
    q, scale = fp8.quantize(x, fp8.ROWWISE, dim=1)
    assert q.dtype == E4M3 and scale.shape == (64, 1) and scale.dtype == torch.float32
    mant, _ = torch.frexp(scale)
    assert torch.all(mant == 0.5)  # a power of two
    qmax = q.float().abs().amax(dim=1)
    assert torch.all((qmax >= 224) & (qmax <= fp8.E4M3_MAX))  # top binade used, never over
    rel = ((fp8.dequantize(q, scale) - x.float()).abs() / x.float().abs().clamp(min=1e-30))
    normal = x.float().abs() >= scale * 2.0**-6  # e4m3 normals: relative error <= 2^-4
    assert float(rel[normal].max()) <= 2.0**-4 + 1e-7


def test_quantize_survives_zero_and_tiny_rows() -> None:
    x = _randn(4, 32)
    x[1] = 0.0
    x[2] *= 1e-40  # fp32 subnormals: the inverse scale must stay finite
    q, scale = fp8.quantize(x, fp8.ROWWISE, dim=1)
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
    assert torch.all(q[1].float() == 0)
    qt, st = fp8.quantize(x, fp8.TENSORWISE)
    assert st.numel() == 1 and torch.isfinite(qt.float()).all()


# ----------------------------------------------------------------------------- contract


def _operands(m: int, k: int, n: int) -> tuple[torch.Tensor, ...]:
    a = _randn(m, k).to(E4M3)
    b = _randn(n, k, seed=1).to(E4M3).t()  # column-major [k, n]
    return a, b, torch.ones(m, 1, device=DEVICE), torch.ones(1, n, device=DEVICE)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("k", "divisible by 16"),
        ("n", "divisible by 16"),
        ("a_col_major", "row-major"),
        ("b_row_major", "column-major"),
        ("rowwise_fp32_out", "only outputs bf16"),
        ("scale_shape", "scales must"),
        ("scale_dtype", "float32"),
        ("not_fp8", "float8_e4m3fn"),
        ("bias_fp32_out", "no bias"),
    ],
)
def test_contract_refuses_what_scaled_mm_refuses(case: str, message: str) -> None:
    m, k, n = 32, 64, 48
    a, b, sa, sb = _operands(m, 72 if case == "k" else k, 40 if case == "n" else n)
    out, bias = torch.bfloat16, None
    if case == "a_col_major":
        a = a.t().contiguous().t()
    elif case == "b_row_major":
        b = b.contiguous()
    elif case == "rowwise_fp32_out":
        out = torch.float32
    elif case == "scale_shape":
        sa = torch.ones(m, device=DEVICE)
    elif case == "scale_dtype":
        sa = sa.bfloat16()
    elif case == "not_fp8":
        a = a.float()
    elif case == "bias_fp32_out":
        sa, sb = torch.ones((), device=DEVICE), torch.ones((), device=DEVICE)
        out, bias = torch.float32, torch.zeros(n, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        fp8.scaled_mm(a, b, sa, sb, out, bias=bias, emulate=True)


def test_contract_accepts_any_m_and_both_scalings() -> None:
    a, b, sa, sb = _operands(17, 64, 48)  # M is free; K and N are not
    assert fp8.check_scaled_mm_args(a, b, sa, sb, torch.bfloat16) == fp8.ROWWISE
    one = torch.ones((), device=DEVICE)
    for out in (torch.bfloat16, torch.float16, torch.float32):
        assert fp8.check_scaled_mm_args(a, b, one, one, out) == fp8.TENSORWISE
    y = fp8.scaled_mm(a, b, sa, sb, emulate=True)
    assert y.shape == (17, 48) and y.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("scaling", fp8.SCALINGS)
def test_emulation_equals_torch_scaled_mm(scaling: str) -> None:
    """Bitwise on the CPU (both dequantize exactly and accumulate in fp32); on a GPU the
    tensor cores accumulate in another order: equal to fp32 rounding."""
    x, w = _randn(48, 64) * 3, _randn(32, 64, seed=1)
    qa, sa = fp8.quantize(x, scaling, dim=1)
    qb, sb = fp8.quantize(w.t(), scaling, dim=0)
    emulated = fp8.scaled_mm(qa, qb, sa, sb, emulate=True)
    real = torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    if DEVICE == "cpu":
        assert torch.equal(emulated, real)
    else:
        assert sqnr(real.float(), emulated.float()) > 45


@pytest.mark.skipif(DEVICE != "cuda" or not fp8.hardware_fp8(torch.device(DEVICE)),
                    reason="needs a GPU with fp8 tensor cores (GEMC_TEST_DEVICE=cuda)")
def test_native_path_runs_scaled_mm_and_matches_emulation() -> None:
    x, w = _randn(96, 128), _randn(64, 128, seed=1)
    for scaling in fp8.SCALINGS:
        native = fp8.fp8_matmul(x, w.t(), scaling)
        emulated = fp8.fp8_matmul(x, w.t(), scaling, emulate=True)
        assert sqnr(emulated.float(), native.float()) > 45


def test_fp8_gemm_is_within_the_e4m3_error_bound_of_float64() -> None:
    """Elementwise: |y - y64| <= (2u + u^2) (|a| @ |b|) + u_bf16 |y64| with u = 2^-4 (e4m3's
    half ulp), up to fp32 accumulation; and the SQNR of Gaussian data is e4m3's ~28 dB."""
    a, b = _randn(64, 256).cpu(), _randn(256, 48, seed=1).cpu()
    ref = a.double() @ b.double()
    for scaling in fp8.SCALINGS:
        y = fp8.fp8_matmul(a, b, scaling, emulate=True).double()
        u = 2.0**-4
        bound = (2 * u + u * u) * (a.abs().double() @ b.abs().double()) + 2.0**-8 * ref.abs()
        assert torch.all((y - ref).abs() <= bound * (1 + 1e-5) + 1e-6)
        assert 26.0 < sqnr(ref, y) < 32.0


def test_row_wise_scaling_protects_rows_next_to_an_outlier() -> None:
    a, b = _randn(64, 64).cpu(), _randn(64, 32, seed=1).cpu()
    a[0] *= 1e6  # one token dominates the tensor's amax
    ref = a.double() @ b.double()
    row = fp8.fp8_matmul(a, b, fp8.ROWWISE, emulate=True).double()
    ten = fp8.fp8_matmul(a, b, fp8.TENSORWISE, emulate=True).double()
    assert sqnr(ref[1:], row[1:]) > 25
    assert sqnr(ref[1:], row[1:]) > sqnr(ref[1:], ten[1:]) + 10


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize(
    "recipe",
    [
        Fp8Recipe(),
        Fp8Recipe.uniform(FP8_TENSOR),
        Fp8Recipe(FP8_ROW, GemmChoice("bf16"), GemmChoice("fp32")),
    ],
    ids=["rowwise", "tensorwise", "mixed"],
)
def test_fp8_linear_forward_and_backward_against_eager(recipe: Fp8Recipe) -> None:
    lin = nn.Linear(64, 48).to(DEVICE)
    x = _randn(5, 7, 64, seed=2).requires_grad_()  # M = 35: the wgrad K gets padded
    dy = _randn(5, 7, 48, seed=3)
    ref_y = lin(x)
    ref_dx, ref_dw, ref_db = torch.autograd.grad(ref_y, (x, lin.weight, lin.bias), dy)
    f = fp8.Fp8Linear.from_linear(lin, recipe, emulate=True)
    y = f(x)
    dx, dw, db = torch.autograd.grad(y, (x, lin.weight, lin.bias), dy)
    assert y.dtype == dx.dtype == dw.dtype == torch.float32
    floor = {"fp8": 25.0, "bf16": 40.0, "fp32": 100.0}
    assert sqnr(ref_y, y) >= floor[recipe.fwd.dtype]
    assert sqnr(ref_dx, dx) >= floor[recipe.dgrad.dtype]
    assert sqnr(ref_dw, dw) >= floor[recipe.wgrad.dtype]
    torch.testing.assert_close(db, ref_db)


def test_fp8_linear_follows_autocast_like_nn_linear() -> None:
    lin = nn.Linear(32, 16).to(DEVICE)
    f = fp8.Fp8Linear.from_linear(lin, Fp8Recipe(), emulate=True)
    x = _randn(8, 32)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert f(x).dtype == lin(x).dtype == torch.bfloat16
    assert f(x).dtype == torch.float32


def test_swap_keeps_parameters_and_refuses_what_fp8_cannot_run() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8), nn.LayerNorm(8))
    keys, params = list(model.state_dict()), list(model.parameters())
    swapped = fp8.swap_linears(model, {"0": Fp8Recipe(), "2": Fp8Recipe.uniform(BF16)})
    assert swapped == ["0"]  # a recipe without fp8 leaves the layer alone
    assert isinstance(model[0], fp8.Fp8Linear) and isinstance(model[0], nn.Linear)
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    with pytest.raises(ValueError, match="divisible by 16"):
        fp8.swap_linear(model, "2", Fp8Recipe())
    with pytest.raises(ValueError, match="not an nn.Linear"):
        fp8.swap_linear(model, "3", Fp8Recipe())


def test_recipe_round_trips_through_a_plan_dict() -> None:
    r = Fp8Recipe(FP8_TENSOR, FP8_ROW, GemmChoice("bf16"))
    assert Fp8Recipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError):
        GemmChoice("fp8")  # fp8 needs a scaling
    assert math.isclose(fp8.E4M3_MAX, float(torch.finfo(E4M3).max))

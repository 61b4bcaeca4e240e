"""The fp8 linear under torch.compile: Dynamo records the ``gemc::fp8_linear`` custom op by its
fake with the quantisation in front of it as ATen ops, AOTAutograd traces its autograd formula
(the output gradient's quantisation, ``gemc::fp8_scaled_mm``), and Inductor fuses the
quantisation into the LayerNorm that produced the activation. On the CPU the GEMMs are the exact emulation
(dequantised fp32 matmul), or the CPU's own ``_scaled_mm`` where torch has one."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.utils as inductor_utils
from gemc.backends.torch import fp8
from torch import nn

from gemc.fp8_recipe import BF16, FP8_ROW, FP32, Fp8Recipe
from tests.precision.conftest import DEVICE, sqnr

ROW = Fp8Recipe.uniform(FP8_ROW)


def _setup(m: int, k: int, n: int, seed: int) -> tuple[nn.LayerNorm, nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    norm, lin = nn.LayerNorm(k), nn.Linear(k, n)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_(0, 0.1)
    x = torch.randn(m, k) * 3 + 1
    x[:, 5] *= 30  # an outlier feature, as real activations have
    return norm, lin, x.requires_grad_()


def _step(fn, norm: nn.LayerNorm, lin: nn.Linear, x: torch.Tensor, dy: torch.Tensor
          ) -> list[torch.Tensor]:
    """y, dx, dW, db, dgamma of ``fn`` under bf16 autocast."""
    for t in (x, lin.weight, lin.bias, norm.weight):
        t.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = fn(x)
    (y.float() * dy).sum().backward()
    return [y.detach().float(), x.grad, lin.weight.grad, lin.bias.grad, norm.weight.grad]


def _fp8_fn(norm: nn.LayerNorm, lin: nn.Linear, recipe: Fp8Recipe, emulate: bool):
    return lambda x: fp8.fp8_linear(norm(x), lin.weight, lin.bias, recipe, emulate=emulate)


def test_emulated_rowwise_fp8_tracks_the_bf16_linear_forward_and_backward() -> None:
    """The row-wise recipe against eager bf16 (what the site runs without fp8), by SQNR: e4m3
    keeps 3 mantissa bits (~31 dB on Gaussian data), so < 25 dB would be a scaling bug; the
    bias and norm gradients do not pass through an fp8 GEMM's rounding alone."""
    norm, lin, x = _setup(96, 128, 64, seed=11)
    dy = torch.randn(96, 64)
    ref = _step(lambda t: lin(norm(t)), norm, lin, x, dy)
    got = _step(_fp8_fn(norm, lin, ROW, emulate=True), norm, lin, x, dy)
    for name, r, g in zip(("y", "dx", "dW", "db", "dgamma"), ref, got):
        assert sqnr(r, g) >= 25.0, name
    torch.testing.assert_close(got[3], ref[3], rtol=1e-2, atol=1e-2)  # db: no GEMM


@pytest.mark.parametrize("recipe", [ROW, Fp8Recipe(FP8_ROW, FP32, BF16)],
                         ids=["rowwise", "fp32_dgrad_bf16_wgrad"])
def test_compiled_fp8_linear_equals_eager(recipe: Fp8Recipe) -> None:
    """AOTAutograd traces the same quantisation and GEMMs as eager runs: bit-equal values,
    forward and backward, an fp32 backward GEMM included (it runs inside a custom op with
    autocast off, compiled or not)."""
    norm, lin, x = _setup(48, 64, 32, seed=12)
    dy = torch.randn(48, 32)
    fn = _fp8_fn(norm, lin, recipe, emulate=True)
    want = _step(fn, norm, lin, x, dy)
    torch._dynamo.reset()
    got = _step(torch.compile(fn, backend="aot_eager", fullgraph=True), norm, lin, x, dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _cpu_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(fp8.E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _native_fp8(device: torch.device) -> bool:
    return fp8.hardware_fp8(device) if device.type == "cuda" else _cpu_scaled_mm()


def test_inductor_fuses_the_quantisation_into_the_norm_and_matches_the_emulation() -> None:
    """Inductor (C++ on the CPU, Triton with ``GEMC_TEST_DEVICE=cuda``) compiles the real
    ``_scaled_mm`` path where the device has a row-wise one (torch 2.13's CPU, an fp8 GPU;
    torch 2.11's CPU has none: the op runs the emulation there, the graph around it the
    same): the LayerNorm and the activation's row-wise quantisation are one kernel (the
    normalised activation is not re-read from memory to be quantised), the GEMMs are gemc's
    ops, and the values are the emulation's up to the bf16 rounding of the output."""
    m, k, n = (32, 64, 48) if DEVICE == "cpu" else (256, 512, 384)
    norm, lin, x = _setup(m, k, n, seed=13)
    norm, lin = norm.to(DEVICE), lin.to(DEVICE)
    x = x.detach().to(DEVICE).requires_grad_()
    dy = torch.randn(m, n).to(DEVICE)
    want = _step(_fp8_fn(norm, lin, ROW, emulate=True), norm, lin, x, dy)
    torch._dynamo.reset()
    native = _native_fp8(torch.device(DEVICE))
    compiled = torch.compile(_fp8_fn(norm, lin, ROW, emulate=not native), backend="inductor",
                             fullgraph=True)
    got, codes = inductor_utils.run_and_get_code(_step, compiled, norm, lin, x, dy)
    forward = codes[0]
    fused = [line for line in forward.splitlines()  # a kernel's name or its ATen ops
             if "def " not in line and "layer_norm" in line and "frexp" in line]
    assert fused, "no kernel computes the norm and the fp8 scales together"
    assert "gemc.fp8_linear" in forward
    # the backward's GEMMs: the ATen op called from Inductor's code where it is native (no
    # Python custom op per call: host time), gemc's emulating op elsewhere
    gemm_op = "aten._scaled_mm" if native else "gemc.fp8_scaled_mm"
    assert codes[1].count(gemm_op) >= 2, gemm_op
    assert ("gemc.fp8_scaled_mm" in codes[1]) == (not native)
    for name, g, w in zip(("y", "dx", "dW", "db", "dgamma"), got, want):
        assert sqnr(w, g) >= 40.0, name


@pytest.mark.parametrize("m", [48, 37], ids=["aligned", "wgrad_padded"])
def test_triton_quantizer_equals_the_aten_one_eager_and_compiled(m: int) -> None:
    """gemc's quantisation kernels (quantizer "triton") produce the ATen path's fp8 bits and
    scales, so the whole step is bit-equal to it, eager and compiled in one graph; 37 tokens
    make the wgrad's contraction padded by the column kernel."""
    norm, lin, x = _setup(m, 64, 32, seed=14)
    x = x.detach().to(DEVICE).requires_grad_()
    norm, lin = norm.to(DEVICE), lin.to(DEVICE)
    dy = torch.randn(m, 32).to(DEVICE)
    want = _step(_fp8_fn(norm, lin, ROW, emulate=True), norm, lin, x, dy)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return fp8.fp8_linear(norm(t), lin.weight, lin.bias, ROW, emulate=True,
                              quantizer=fp8.TRITON_QUANT)

    for label, g, w in zip(("y", "dx", "dW", "db", "dgamma"), _step(fn, norm, lin, x, dy), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=label)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for label, g, w in zip(("y", "dx", "dW", "db", "dgamma"),
                           _step(compiled, norm, lin, x, dy), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=label)


def test_quantizer_is_chosen_outside_the_trace_and_checked(monkeypatch) -> None:
    monkeypatch.delenv(fp8.QUANTIZER_ENV, raising=False)
    assert fp8.default_quantizer() == fp8.ATEN_QUANT  # the default until the H200 says
    monkeypatch.setenv(fp8.QUANTIZER_ENV, "triton")
    lin = fp8.Fp8Linear.from_linear(nn.Linear(32, 16), ROW, emulate=True)
    assert lin.quantizer == fp8.TRITON_QUANT
    monkeypatch.setenv(fp8.QUANTIZER_ENV, "cutlass")
    with pytest.raises(ValueError, match="GEMC_FP8_QUANTIZER.*one of"):
        fp8.default_quantizer()
    with pytest.raises(ValueError, match="unknown fp8 quantizer 'cutlass'"):
        fp8.fp8_linear(torch.zeros(2, 32), lin.weight, None, ROW, quantizer="cutlass")


def test_triton_quantizer_compiles_once_for_aligned_and_unaligned_token_counts() -> None:
    """With M dynamic, the ATen quantizer's wgrad pads M to 16 behind a guard on M % 16 (a
    second compile when the token count stops being aligned); gemc's column kernel pads
    inside, so the graph holds for both."""
    torch.manual_seed(15)
    norm, lin = nn.LayerNorm(64).to(DEVICE), nn.Linear(64, 48).to(DEVICE)
    compiles = {}
    for quantizer in fp8.QUANTIZERS:
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor],  # noqa: ANN202
                    graphs: list[torch.fx.GraphModule] = graphs):
            graphs.append(gm)
            from torch._dynamo.backends.common import aot_autograd
            return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(
                gm, inputs)

        def fn(x: torch.Tensor, q: str = quantizer) -> torch.Tensor:
            return fp8.fp8_linear(norm(x), lin.weight, lin.bias, ROW, emulate=True, quantizer=q)

        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend)
        for m in (32, 48, 37):
            x = torch.randn(m, 64, device=DEVICE, requires_grad=True)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                y = compiled(x)
            y.float().sum().backward()
        compiles[quantizer] = len(graphs)
    assert compiles == {fp8.ATEN_QUANT: 2, fp8.TRITON_QUANT: 1}, compiles

"""The fp8 linear as ``torch.library`` custom ops (``gemc::fp8_linear``, its backward's
``gemc::fp8_scaled_mm`` / ``gemc::wide_mm``): fakes that match the real outputs, values equal
to the recipe's GEMMs computed one by one (the numerics of the autograd.Function the ops
replace), and a compiled LayerNorm -> fp8 linear that Dynamo captures as one graph, forward and
backward. Must pass on torch 2.13 and 2.11 alike (the H200 runs 2.11)."""

from __future__ import annotations

import pytest
import torch
from gemc.backends.torch import fp8
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gemc.fp8_recipe import BF16, FP8_ROW, FP8_TENSOR, FP32, Fp8Recipe

ROW = Fp8Recipe.uniform(FP8_ROW)
RECIPES = {"rowwise": ROW, "tensorwise": Fp8Recipe.uniform(FP8_TENSOR),
           "fp8_fwd_fp32_dgrad_bf16_wgrad": Fp8Recipe(FP8_ROW, FP32, BF16),
           "bf16_fwd_fp8_backward": Fp8Recipe(BF16, FP8_ROW, FP8_ROW)}


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor,
               recipe: Fp8Recipe, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """y, dx, dW, db as the replaced autograd.Function computed them: each GEMM by
    :func:`fp8.gemm` with its choice, autocast off, the bias gradient an fp32 sum."""
    y = fp8.gemm(x, w.t(), recipe.fwd, out_dtype, emulate=True) + b.to(out_dtype)
    dx = fp8.gemm(dy, w, recipe.dgrad, x.dtype, emulate=True)
    dw = fp8.gemm(dy.t(), x, recipe.wgrad, w.dtype, emulate=True)
    return [y, dx, dw, dy.sum(0, dtype=torch.float32)]


def _data(m: int, k: int, n: int, x_dtype: torch.dtype, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2 + 0.5
    x[:, 3] *= 40  # an outlier feature
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(x_dtype), w, b


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_op_forward_and_backward_equal_the_recipes_gemms(name: str, x_dtype: torch.dtype
                                                         ) -> None:
    """Eager, under a bf16 autocast (as the runner trains): bit-equal to the GEMMs one by one,
    so swapping the autograd.Function for the ops changed no value. Jagged M (40: the wgrad
    contraction padded to 48)."""
    recipe = RECIPES[name]
    x, w, b = _data(40, 64, 32, x_dtype, seed=1)
    dy = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = _reference(x, w, b, dy, recipe, torch.bfloat16)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8.fp8_linear(xg, wg, bg, recipe, emulate=True)
    y.backward(dy)
    for label, g, r in zip(("y", "dx", "dW", "db"), [y, xg.grad, wg.grad, bg.grad], want):
        assert g.dtype == r.dtype, label
        torch.testing.assert_close(g, r, rtol=0, atol=0, msg=label)


def test_fakes_give_the_real_shapes_dtypes_and_strides() -> None:
    """Each op's fake against its real output (which aliases no input, as the schema
    says), and ``gemc::fp8_linear`` end to end under
    FakeTensorMode (the quantisation in front of it included)."""
    x, w, b = _data(24, 32, 48, torch.bfloat16, seed=3)
    qx, qw, sx, sw = fp8._quantized_operands(x, w.t(), fp8.ROWWISE)
    cases = [
        (torch.ops.gemc.fp8_scaled_mm, (qx, qw, sx, sw, True)),
        (torch.ops.gemc.wide_mm, (x, w.t(), "fp32", "float32")),
        (torch.ops.gemc.wide_mm, (x, w.t(), "bf16", "bfloat16")),
        (torch.ops.gemc.fp8_linear,
         (x, w, b, qx, qw, sx, sw, "fp8-row", "fp8-row", "fp8-row", "bfloat16", True)),
        (torch.ops.gemc.fp8_linear,
         (x, w, None, None, None, None, None, "bf16", "fp8-row", "fp8-row", "float32", True)),
    ]
    for op, args in cases:
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                        for a in args))
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype,
                                                           real.stride()), op
        ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        assert real.untyped_storage().data_ptr() not in ptrs, f"{op} aliases an input"
    with FakeTensorMode() as mode:
        fx_, fw = mode.from_tensor(x).view(2, 12, 32), mode.from_tensor(w)
        y = fp8.fp8_linear(fx_, fw, None, ROW, out_dtype=torch.bfloat16, emulate=True)
    assert (tuple(y.shape), y.dtype) == ((2, 12, 48), torch.bfloat16)


@pytest.mark.parametrize("name", ["rowwise", "fp8_fwd_fp32_dgrad_bf16_wgrad"])
def test_opcheck(name: str) -> None:
    """torch.library.opcheck: fake, autograd registration and AOT dispatch of
    ``gemc::fp8_linear`` (the backward ops run inside its autograd formula). Not its
    ``test_schema``: that multiplies every tensor input, which ATen has no kernel for in
    fp8 (the no-aliasing the schema claims is checked by the fakes test: fresh outputs)."""
    recipe = RECIPES[name]
    x, w, b = _data(32, 32, 16, torch.float32, seed=4)
    qx, qw, sx, sw = fp8._quantized_operands(x, w.t(), fp8.ROWWISE)
    args = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), qx, qw, sx, sw,
            recipe.fwd.label, recipe.dgrad.label, recipe.wgrad.label, "bfloat16", True)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.gemc.fp8_linear.default, args, test_utils=utils)
    torch.library.opcheck(torch.ops.gemc.fp8_scaled_mm.default, (qx, qw, sx, sw, True),
                          test_utils=utils)


def test_opcheck_quantisation_kernels() -> None:
    """The Triton quantisation ops (quantizer "triton"): fakes, and AOT dispatch with a
    dynamic token count, on a strided input (the wgrad's ``dy^T``) and an unaligned M."""
    from gemc.backends.triton import fp8_quant  # noqa: F401  (registers the ops)

    x = torch.randn(37, 48).t()
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    for op in (torch.ops.gemc.fp8_quantize_rows, torch.ops.gemc.fp8_quantize_cols):
        torch.library.opcheck(op.default, (x,), test_utils=utils)


def test_compiled_norm_then_fp8_linear_is_one_graph_forward_and_backward() -> None:
    """``fullgraph=True`` (a graph break raises), with a dynamic token count as the benchmark
    marks it: Dynamo's graph holds one ``gemc::fp8_linear`` node and no autograd-function
    higher-order op, and the compiled step equals eager, forward and backward, for two token
    counts under the one compile."""
    torch.manual_seed(5)
    norm, lin = nn.LayerNorm(64), nn.Linear(64, 48)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # noqa: ANN202
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, inputs)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return fp8.fp8_linear(norm(x), lin.weight, lin.bias, ROW, emulate=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for m in (32, 80):
        x = (torch.randn(m, 64) * 3).to(torch.bfloat16)
        dy = torch.randn(m, 48).to(torch.bfloat16)
        out = []
        for f in (fn, compiled):
            for p in (*norm.parameters(), *lin.parameters()):
                p.grad = None
            xg = x.clone().requires_grad_()
            torch._dynamo.maybe_mark_dynamic(xg, 0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = f(xg)
            y.backward(dy)
            out.append([y, xg.grad, lin.weight.grad, lin.bias.grad, norm.weight.grad])
        for label, g, w in zip(("y", "dx", "dW", "db", "dgamma"), out[1], out[0]):
            torch.testing.assert_close(g, w, msg=label)
    assert len(graphs) == 1, f"{len(graphs)} graphs: a recompile or a graph break"
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("gemc.fp8_linear" in t for t in targets) == 1, targets
    assert not any("autograd_function" in t for t in targets), targets

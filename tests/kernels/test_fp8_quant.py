"""The fused fp8 quantisation kernels against gemc's ATen quantisation (bit for bit), the
e4m3 rounding bound, and the SQNR they reach.

On the CPU these run in Triton's interpreter with the cast rounded in fp32 arithmetic
(``soft_round``, the interpreter's own fp8 conversion is not round-half-even); with
``GEMC_TEST_DEVICE=cuda`` the same assertions check the hardware conversion."""

from __future__ import annotations

import math

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.triton import fp8_quant
from gemc.backends.triton.fp8_quant import quantize_cols, quantize_rows
from kernel_helpers import as_jit_kernels, forward_graph_targets


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _operand(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Columns spanning six decades (so subnormal e4m3 values occur), one zero row."""
    g = torch.Generator().manual_seed(seed)  # on the CPU, whatever the default device
    x = torch.randn(m, k, generator=g, device="cpu") * torch.logspace(-3, 3, k, device="cpu")
    x[min(3, m - 1)] = 0.0
    return x.to(dtype).to(torch.get_default_device())


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return 10 * math.log10(float((ref**2).sum()) / float(((ref - got) ** 2).sum()))


def _assert_within_rounding(x: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> None:
    """|dequant - x| <= half an e4m3 step: 2^-4 relative for normals, 2^-10 * scale below."""
    x = x.double()
    bound = torch.maximum(x.abs() * 2.0**-4, scale.double() * 2.0**-10)
    assert bool(((deq.double() - x).abs() <= bound).all())


SOFT = [None] if fp8_quant.INTERPRETED else [None, True]
"""Each kernel's default rounding, and on a GPU the soft one too (the interpreter's default)."""


@pytest.mark.parametrize("soft", SOFT)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_match_aten_quantize_bit_for_bit(dtype, soft) -> None:
    x = _operand(70, 48, dtype)
    q, s = quantize_rows(x, soft_round=soft)
    ref_q, ref_s = fp8.quantize(x, fp8.ROWWISE, dim=1)
    assert q.is_contiguous() and s.shape == (70, 1)
    assert torch.equal(s, ref_s)
    assert torch.equal(_bits(q), _bits(ref_q))
    assert int((q.float().abs() < 2.0**-6).logical_and(q.float() != 0).sum()) > 0  # subnormals
    deq = fp8.dequantize(q, s)
    _assert_within_rounding(x, deq, s)
    db = _sqnr_db(x, deq)
    print(f"row-wise e4m3 SQNR {db:.1f} dB ({dtype})")
    assert 28 < db < 40


def test_wide_rows_take_the_two_pass_path_and_strided_input(monkeypatch) -> None:
    monkeypatch.setattr(fp8_quant, "ROW_TILE", 64)  # K = 200 > 64: the looped kernel
    base = _operand(200, 40, torch.bfloat16, seed=1)
    x = base.t()  # [40, 200], column-major: read through its strides
    q, s = quantize_rows(x)
    ref_q, ref_s = fp8.quantize(x.contiguous(), fp8.ROWWISE, dim=1)
    assert torch.equal(s, ref_s) and torch.equal(_bits(q), _bits(ref_q))


@pytest.mark.parametrize("soft", SOFT)
@pytest.mark.parametrize("segment", [512, 1])  # 1: 70 partials per column, > one BLOCK_S
def test_cols_match_aten_quantize_transposed_and_padded(monkeypatch, segment, soft) -> None:
    monkeypatch.setattr(fp8_quant, "SEGMENT", segment)
    x = _operand(70, 48, torch.bfloat16, seed=2)
    qt, s = quantize_cols(x, soft_round=soft)
    ref_q, ref_s = fp8.quantize(x, fp8.ROWWISE, dim=0)  # [70, 48], scales [1, 48]
    assert qt.shape == (48, 80) and qt.is_contiguous() and s.shape == (48, 1)
    assert torch.equal(s.t(), ref_s)
    assert torch.equal(_bits(qt[:, :70].t()), _bits(ref_q))
    assert not bool(qt[:, 70:].float().any())  # the padding is zeros: exact in the GEMM
    deq = fp8.dequantize(qt[:, :70], s).t()
    _assert_within_rounding(x, deq, s.t())
    db = _sqnr_db(x, deq)
    print(f"column-wise e4m3 SQNR {db:.1f} dB")
    assert 28 < db < 40


def test_scale_exponent_at_the_binade_edges() -> None:
    """amax = 448 2^k and one fp32 ulp either side, the floor, and zero: the scales equal
    torch's ``frexp`` (:func:`fp8.pow2_scale`)."""
    assert fp8_quant.AMAX_FLOOR == fp8.AMAX_FLOOR
    amax = []
    for k in (-20, -1, 0, 1, 30):
        edge = torch.tensor(448.0 * 2.0**k)
        amax += [float(torch.nextafter(edge, torch.tensor(0.0))), float(edge),
                 float(torch.nextafter(edge, torch.tensor(math.inf)))]
    amax += [1e-12, 1e-30, 0.0, 1.0, 3.5, 1e30]
    x = torch.zeros(len(amax), 16)
    x[:, 5] = torch.tensor(amax)
    x[:, 2] = -0.5 * x[:, 5]
    x = x.to(torch.get_default_device())
    q, s = quantize_rows(x)
    ref_s, _ = fp8.pow2_scale(x.abs().amax(1, keepdim=True))
    assert torch.equal(s, ref_s)
    assert torch.equal(_bits(q), _bits(fp8.quantize(x, fp8.ROWWISE, dim=1)[0]))
    qt, st = quantize_cols(x.t())
    assert torch.equal(st, ref_s) and torch.equal(_bits(qt[:, : len(amax)]), _bits(q))


def test_empty_and_errors() -> None:
    q, s = quantize_rows(torch.zeros(0, 32))
    assert q.shape == (0, 32) and s.shape == (0, 1)
    qt, s = quantize_cols(torch.zeros(0, 32))
    assert qt.shape == (32, 0) and s.shape == (32, 1) and not bool(s.isnan().any())
    with pytest.raises(ValueError, match="flatten the leading dims"):
        quantize_rows(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        quantize_cols(torch.zeros(4, 4, dtype=torch.int32))


@pytest.mark.parametrize(("launch", "kernels"), [("_rows", 1), ("_cols", 2)])
def test_launch_code_traces_to_kernel_nodes_without_guarding_the_token_count(
        monkeypatch, launch, kernels) -> None:
    """What makes the ops ``triton_op``s on a GPU: traced with symbolic sizes (as AOTAutograd
    decomposes a ``triton_op`` under torch.compile), the launch code is ``kernels`` Triton
    kernel nodes plus allocations, with no Python op in between, and it specialises nothing
    on the token count M (the graph holds for every M; the feature count may be guarded).
    On the CPU the kernels are interpreted functions, which ``wrap_triton`` does not trace,
    so they are re-wrapped as JIT functions (traced, never launched) for this check."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, value in list(vars(fp8_quant).items()):
        if isinstance(value, InterpretedFunction):
            monkeypatch.setattr(fp8_quant, name, JITFunction(value.fn))
    x = torch.randn(48, 37, dtype=torch.bfloat16)  # [K, M]: x.t() is strided
    # M in the cols kernel's x[M, K] and the rows kernel's x[M, K] alike
    gm = make_fx(lambda t: getattr(fp8_quant, launch)(t.t(), False), tracing_mode="symbolic")(x)
    targets = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
               if n.op == "call_function"]
    assert targets.count("triton_kernel_wrapper_mutation") == kernels, targets
    assert not [t for t in targets if "gemc" in t], targets
    fake = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")
    m_symbol = fake.shape[1].node.expr
    guards = fake.fake_mode.shape_env.guards
    assert not [g for g in guards if m_symbol in g.expr.free_symbols], guards


def test_triton_ops_decompose_into_kernel_nodes_under_torch_compile(monkeypatch) -> None:
    """The ops as a GPU registers them (``triton_op``), compiled with a dynamic token count:
    AOTAutograd's forward graph launches the kernels as Triton kernel nodes (which Inductor
    compiles and launches from its own code) and holds no ``gemc`` op, so no Python custom-op
    call is left per launch. Registered here under test names, with the kernels re-wrapped
    as JIT functions (see above); the graph is captured, not run."""
    as_jit_kernels(fp8_quant, monkeypatch)
    if not hasattr(torch.ops.gemc, "test_quantize_cols_traced"):
        for name, launch in (("rows", fp8_quant._rows), ("cols", fp8_quant._cols)):
            # the shapes serve a custom_op's fake; a triton_op's is its launch code
            fp8_quant._quant_op(f"test_quantize_{name}_traced", launch, lambda m, k: None,
                                interpreted=False)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*torch.ops.gemc.test_quantize_rows_traced(x),
                *torch.ops.gemc.test_quantize_cols_traced(x))

    targets = forward_graph_targets(fn, torch.randn(37, 64, dtype=torch.bfloat16), dynamic=(0,))
    assert targets.count("triton_kernel_wrapper_functional") == 3, targets
    assert not [t for t in targets if "gemc" in t], targets

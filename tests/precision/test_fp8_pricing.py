"""The precision pass's price of an fp8 GEMM with one-pass row-wise quantisation (what the
runner launches on a GPU: gemc.backends.torch.fp8_ops) against the eager tensor-wise path,
and where fp8 starts to pay on an H200 (roofline)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gemc.cost_model.hardware import get_gpu
from gemc.passes import precision_sites
from gemc.passes.precision_sites import Prices, price

from gemc import fp8_recipe


def _site(m: int, k: int, n: int) -> SimpleNamespace:
    """Just what ``price`` reads of a site: its problems and its input (no norm)."""
    problem = {"batch": 1, "m": m, "n": n, "k": k}
    return SimpleNamespace(node=SimpleNamespace(args=()), op="linear", problem=problem,
                           problems=lambda: precision_sites.Site.problems(
                               SimpleNamespace(problem=problem)))


def test_one_pass_bytes() -> None:
    # bf16 operand already in _scaled_mm's layout: read 2, write 1; transposed: read twice
    assert fp8_recipe.one_pass_quantize_bytes(1000, 2, False) == 3000
    assert fp8_recipe.one_pass_quantize_bytes(1000, 2, True) == 5000
    assert sum(fp8_recipe.quantize_kernels(1000, 2, True)) > 3 * 5000 / 2


def test_rowwise_is_priced_cheaper_than_eager_tensorwise() -> None:
    p = price(_site(8192, 2048, 2048), get_gpu("h200"), None)
    for g in fp8_recipe.GEMMS:
        assert p[g].fp8 < p[g].fp8_tensor
        assert p[g].of("fp8", "tensorwise") == p[g].fp8_tensor
        assert p[g].of("fp8", "rowwise") == p[g].of("fp8") == p[g].fp8


@pytest.mark.parametrize("m,k,n,paying", [
    (16384, 4096, 4096, {"fwd", "dgrad", "wgrad"}),
    # wgrad quantises both operands along the tokens (two reads each): at K = N = 2048 its
    # quantisation eats the GEMM's saving -- the pass keeps it bf16 (torchao's "rowwise
    # with high-precision grad_weight" made per GEMM by the cost model)
    (8192, 2048, 2048, {"fwd", "dgrad"}),
    (8192, 256, 256, set()),
])
def test_fp8_pays_at_large_gemms_only(m: int, k: int, n: int, paying: set[str]) -> None:
    """The pass's rule (gain >= 5% of the GEMM) on the H200 roofline."""
    p = price(_site(m, k, n), get_gpu("h200"), None)
    gains = {g: (p[g].bf16 - p[g].fp8) / p[g].bf16 for g in fp8_recipe.GEMMS}
    assert {g for g, v in gains.items() if v >= 0.05} == paying, gains


def test_tensorwise_needs_to_be_no_slower() -> None:
    """Equally accurate scalings, no outliers: tensor-wise (eager quantisation) is taken
    only where its price is not above row-wise's one-pass price."""
    import torch
    from gemc.passes.precision import PrecisionOptions, decide_gemm

    from gemc.probe_types import SiteStats

    ref = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    stats = SiteStats(("m", "linear", 0), "Linear")
    for label, noise in (("bf16", 1e-3), ("fp8-row", 2e-2), ("fp8-tensor", 2e-2)):
        stats.add("fwd", label, ref, ref + noise * ref)  # 60 dB, 34 dB, 34 dB
    stats.add_outlier("fwd", 1.0)
    site = SimpleNamespace(module="m")
    slow_tensor = Prices(1.0, 1.0, 0.5, 0.01, "roofline", fp8_tensor=0.8)
    d = decide_gemm(site, "fwd", slow_tensor, None, None, stats, None, PrecisionOptions())
    assert d.label == "fp8-row" and "eager quantization costs" in (d.note or ""), d
    fast_tensor = Prices(1.0, 1.0, 0.5, 0.01, "roofline", fp8_tensor=0.45)
    d = decide_gemm(site, "fwd", fast_tensor, None, None, stats, None, PrecisionOptions())
    assert d.label == "fp8-tensor", d


def _norm_linear_site(residual: bool) -> precision_sites.Site:
    """The linear of ``Linear(LayerNorm(x))`` (its norm also read by a residual add when
    ``residual``) as the pass sees it: a real exported node, at M=8192, K=N=2048."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(2048), nn.Linear(2048, 2048)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            return self.lin(h) + h if residual else self.lin(h)

    gm = torch.export.export(Net(), (torch.randn(16, 2048),)).module()
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    return precision_sites.Site(node, "linear", "lin", "Linear", "", ("lin", "linear", 0),
                                {"batch": 1, "m": 8192, "n": 2048, "k": 2048}, None)


def test_graph_mode_prices_the_quantisation_fused_into_the_norm() -> None:
    gpu = get_gpu("h200")
    site = _norm_linear_site(residual=False)
    plain, fused = price(site, gpu, None), price(site, gpu, None, graph_mode=True)
    assert fused["fwd"].fused_into and fused["fwd"].fused_into.startswith("layer_norm")
    # forward: no pass over x and a narrower norm write (a saving beyond the GEMM's);
    # wgrad: the normalised rows recomputed first; dgrad untouched
    assert fused["fwd"].fp8 < plain["fwd"].fp8
    assert fused["fwd"].fp8_quant < plain["fwd"].fp8_quant - 0.5 * plain["fwd"].fp8_quant
    assert fused["wgrad"].fp8 > plain["wgrad"].fp8
    assert fused["dgrad"].fp8 == plain["dgrad"].fp8
    # a norm another op reads keeps its bf16 output: nothing fused, priced as before
    shared = price(_norm_linear_site(residual=True), gpu, None, graph_mode=True)
    assert shared["fwd"].fused_into is None and shared["fwd"].fp8 == plain["fwd"].fp8

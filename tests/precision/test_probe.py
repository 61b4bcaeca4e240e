"""The probe measures what a direct computation says, on the model's own tensors."""

from __future__ import annotations

import math

import pytest
import torch
from gemc.backends.torch import fp8
from torch import nn

from gemc.probe import Probe, ProbeConfig, ProbeSkipped, build_probe_model
from tests.precision.conftest import MODEL, sqnr

E4M3 = torch.float8_e4m3fn


def _quantize_by_hand(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Dequantized fp8 of ``t``, written from the definition (not gemc's code): scale
    2^(floor(log2(amax / 448)) + 1) per slice along ``dim``, round to e4m3, scale back."""
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    exp = torch.floor(torch.log2(amax.clamp(min=1e-12) / 448.0)) + 1
    scale = torch.pow(2.0, exp)
    return (t / scale).float().to(E4M3).double() * scale


@pytest.fixture(scope="module")
def probe() -> Probe:
    return Probe.open(MODEL, {}, ["block", "attn", "head"])


def _captured(steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, W, dy) of block.up on the probe's batches, from a model built the same way."""
    spec, _ = build_probe_model(MODEL, {}, ProbeConfig())
    layer = spec.model.get_submodule("block.up")
    out: list[list[torch.Tensor]] = []

    def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor) -> None:
        out.append([args[0].detach(), layer.weight.detach()])
        y.register_hook(lambda g: out[-1].append(g.detach()))

    layer.register_forward_hook(hook)
    for step in range(steps):
        spec.model(*spec.make_batch(step, "cpu")).backward()
    return [(x, w, dy) for x, w, dy in out]


def test_probe_sqnr_matches_a_direct_computation(probe: Probe) -> None:
    stats = probe.sites[("block.up", "linear", 0)]
    calls = _captured(probe.config.steps)
    assert stats.calls == len(calls) == probe.config.steps
    pooled: dict[tuple[str, str], list[float]] = {}
    for x, w, dy in calls:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        gemms = {"fwd": (x2, w.t()), "dgrad": (dy2, w), "wgrad": (dy2.t(), x2)}
        for gemm, (a, b) in gemms.items():
            ref = a.double() @ b.double()
            tests = {
                "bf16": (a.bfloat16().double() @ b.bfloat16().double()).bfloat16(),
                "fp8-row": (_quantize_by_hand(a, 1) @ _quantize_by_hand(b, 0)).bfloat16(),
                "fp8-tensor": (_quantize_by_hand(a, None) @ _quantize_by_hand(b, None)).bfloat16(),
            }
            for label, test in tests.items():
                acc = pooled.setdefault((gemm, label), [0.0, 0.0])
                acc[0] += float((ref**2).sum())
                acc[1] += float(((ref - test.double()) ** 2).sum())
    for (gemm, label), (signal, noise) in pooled.items():
        direct = 10 * math.log10(signal / noise)
        assert stats.sqnr(gemm, label) == pytest.approx(direct, abs=0.02), (gemm, label)
    # the outlier feature (x[..., 3] * 20) is one column of x: per-token amaxes stay even
    assert stats.outliers["fwd"] < 8 < stats.outliers["wgrad"]


def test_probe_measures_bf16_of_non_linear_gemms_through_autograd(probe: Probe) -> None:
    scores = probe.sites[("attn", "matmul", 0)]  # q @ k^T
    assert set(scores.energy) == {"fwd", "dgrad", "wgrad"}
    assert all(set(e) == {"bf16"} for e in scores.energy.values())  # never fp8
    assert all(40 < scores.sqnr(g, "bf16") < 70 for g in scores.energy)


def test_block_check_compares_a_region_run_alone(probe: Probe) -> None:
    exact = probe.check_block("block", {"block": "fp32"})
    assert exact is not None and exact.db > 100  # fp32 scope inside the bf16 autocast
    fp8_up = probe.check_block("block", {"block.up": fp8.Fp8Recipe()})
    assert fp8_up is not None and 20 < fp8_up.db < 40
    assert isinstance(probe.model.block.up, nn.Linear)  # the swap was undone
    assert not isinstance(probe.model.block.up, fp8.Fp8Linear)
    assert probe.check_block("", {}) is None  # the root cannot run alone


def test_probe_folds_big_tables_and_cuts_the_batch() -> None:
    cfg = ProbeConfig(fold_rows=128, min_batch=4, max_batch=4)
    spec, info = build_probe_model("examples/gem/model.py:build", {"preset": "tiny"}, cfg,
                                   fwd_flops=1e9)
    assert info["batch"] == 32 and info["probe_batch"] == 4 and info["folded_tables"] > 0
    tables = [m for m in spec.model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    assert max(t.num_embeddings for t in tables) == 128
    loss = spec.model(*spec.make_batch(0, "cpu"))  # ids beyond 128 rows fold
    assert torch.isfinite(loss)


def test_gem_xl_is_not_materialised_on_a_cpu() -> None:
    with pytest.raises(ProbeSkipped, match="dense weights .* GB"):
        build_probe_model("examples/gem/model.py:build", {"preset": "gem-xl"}, ProbeConfig())


def test_sqnr_helper_agrees_with_the_tests_own() -> None:
    from gemc.probe_types import sqnr_db

    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    b = a + 1e-3 * torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    assert sqnr_db(a, b) == pytest.approx(sqnr(a, b), abs=1e-6)
    assert sqnr_db(a, a) == math.inf

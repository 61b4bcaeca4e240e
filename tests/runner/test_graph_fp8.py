"""fp8 linear sites in graph mode (backends/torch/graph_fp8.py): the captured graph's
linears call gemc's fp8 ops -- fused with the LayerNorm that feeds them where only they
read it -- and train as module mode's Fp8Linear does, instead of the plan being refused."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.torch.graph_fp8 import apply_fp8_sites, unsupported_sites
from torch import nn

from gemc.fp8_recipe import BF16, FP8_ROW, FP8_TENSOR, Fp8Recipe
from gemc.plan import write_plan
from gemc.probe_types import sqnr_db

ROW = Fp8Recipe.uniform(FP8_ROW)
ROW_GW16 = Fp8Recipe(FP8_ROW, FP8_ROW, BF16)


def _model(residual: bool = False) -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32)
            self.up = nn.Linear(32, 48)
            self.down = nn.Linear(48, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            y = self.down(torch.relu(self.up(h)))
            return y + h if residual else y

    torch.manual_seed(random.SystemRandom().randrange(2**31))
    return Net()


def _export(model: nn.Module) -> torch.fx.GraphModule:
    return torch.export.export(model, (torch.randn(64, 32),)).module()


def _grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """Output and gradients under the plan's bf16 autocast, as the runner trains."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    params = [p for _, p in sorted(module.named_parameters())]
    return [out, *torch.autograd.grad(out, [x, *params], dy.to(out.dtype))]


def test_linears_call_the_fp8_ops_and_the_norm_is_fused() -> None:
    model = _model()
    gm = _export(copy.deepcopy(model))
    recipes = {"up": ROW, "down": ROW_GW16}
    kept, taken = apply_fp8_sites(gm, recipes, [{"name": "k", "nodes": []}])
    assert [k["name"] for k in kept] == ["k"]
    assert sorted(taken.values()) == ["fp8_linear", "fused", "norm_fp8_linear"]
    assert not any(n.target is torch.ops.aten.layer_norm.default for n in gm.graph.nodes)

    ref = copy.deepcopy(model)
    fp8.swap_linears(ref, recipes)  # module mode: the norm, then the fp8 linears
    x, dy = torch.randn(64, 32) * 3, torch.randn(64, 32)
    got, want = _grads(gm, x, dy), _grads(ref, x, dy)
    assert len(got) == len(want) == 8
    # the same recipe; the fused norm's fp32 math in another order may move the odd value
    # across an fp8 rounding boundary (one e4m3 step): agreement far above fp8's own error
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert sqnr_db(w.detach().double(), g.detach().double()) >= 40
    # and it is fp8: well below the plain bf16 model's accuracy
    plain = _grads(model, x, dy)
    assert sqnr_db(plain[0].detach().double(), got[0].detach().double()) < 40


def test_a_norm_read_elsewhere_is_not_fused() -> None:
    gm = _export(_model(residual=True))
    _, taken = apply_fp8_sites(gm, {"up": ROW}, [])
    assert list(taken.values()) == ["fp8_linear"]
    assert any(n.target is torch.ops.aten.layer_norm.default for n in gm.graph.nodes)


def test_a_kernel_over_a_rewritten_node_is_left_out_loudly() -> None:
    gm = _export(_model())
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    norm = next(n for n in names if "layer_norm" in n)
    entries = [{"name": "norm_0", "nodes": [norm]}, {"name": "other", "nodes": []}]
    with pytest.warns(UserWarning, match="norm_0"):
        kept, _ = apply_fp8_sites(gm, {"up": ROW}, entries)
    assert [e["name"] for e in kept] == ["other"]


def test_recipes_the_ops_do_not_run_are_named() -> None:
    bad = Fp8Recipe(FP8_TENSOR, FP8_ROW, FP8_ROW)
    assert unsupported_sites({"a": ROW, "b": ROW_GW16, "c": bad}) == [
        "c (fwd=fp8-tensor, dgrad=fp8-row, wgrad=fp8-row)"]


def test_a_plan_with_an_fp8_site_and_kernels_trains_in_graph_mode(tmp_path) -> None:
    """An fp8 site (its norm fused) next to generated kernels: the runner used to refuse
    it; it trains through the captured graph with module mode's losses."""
    from gemc.backends.torch.runner import RunOptions, run

    from gemc.api import compile as gemc_compile

    model = "tests/precision/models.py:build"
    plan = gemc_compile(model, {}, topology="h200:1x1")
    assert plan["kernels"]
    plan["precision"] = [{"target": "*", "dtype": "bf16"},
                         {"target": "block.down", "dtype": "fp8", "recipe": ROW.to_dict()}]
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, json.loads(json.dumps(plan)))
    opts = dict(steps=3, device="cpu", progress=False)
    with pytest.warns(UserWarning, match="fp8 site"):
        got = run(plan_path, RunOptions(**opts))
    assert got.report["execution"].startswith("graph")
    ref = run(plan_path, RunOptions(**opts, kernels=False))
    torch.testing.assert_close([v for _, v in got.losses], [v for _, v in ref.losses],
                               rtol=2e-2, atol=2e-3)


def test_a_site_without_a_linear_node_is_named() -> None:
    gm = _export(_model())
    with pytest.warns(UserWarning, match="gone have no aten.linear node"):
        _, taken = apply_fp8_sites(gm, {"up": ROW, "gone": ROW}, [])
    assert "norm_fp8_linear" in taken.values()

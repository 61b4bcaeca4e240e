"""fp8 linear sites in graph mode (backends/torch/graph_fp8.py): the captured graph's linear
nodes call the fp8 linear, instead of the plan being refused next to kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemc.backends.torch import fp8
from gemc.backends.torch.graph_fp8 import apply_fp8_sites
from gemc.backends.torch.runner import RunOptions, run
from torch import nn

from gemc.fp8_recipe import BF16, FP8_ROW, Fp8Recipe
from gemc.plan import write_plan

MODEL = str(Path(__file__).resolve().parents[1] / "precision" / "models.py") + ":build"
ROW = {g: {"dtype": "fp8", "scaling": "rowwise"} for g in ("fwd", "dgrad", "wgrad")}


def _captured() -> tuple[nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    return model, torch.export.export(model, (torch.randn(8, 32),)).module()


def test_linear_nodes_of_fp8_sites_run_the_recipe_forward_and_backward() -> None:
    model, gm = _captured()
    recipe = Fp8Recipe(FP8_ROW, FP8_ROW, BF16)
    kept, taken = apply_fp8_sites(gm, {"3": recipe}, [{"name": "k", "nodes": []}],
                                  torch.device("cpu"))
    assert list(taken.values()) == ["3"] and [k["name"] for k in kept] == ["k"]
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gm(x)
    got.float().square().sum().backward()
    params = dict(gm.named_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[2](model[1](model[0](x)))
        want = fp8.fp8_linear(h, model[3].weight, model[3].bias, recipe, emulate=True)
    want.float().square().sum().backward()
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=0, atol=0)


def test_a_kernel_over_an_fp8_linear_and_a_site_without_one_are_named() -> None:
    _, gm = _captured()
    linears = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    kernels = [{"name": "gemm_3", "nodes": [linears[1]]}, {"name": "other", "nodes": []}]
    with pytest.warns(UserWarning, match=r"gemm_3 \(3\)"):
        kept, _ = apply_fp8_sites(gm, {"3": Fp8Recipe.uniform(FP8_ROW)}, kernels,
                                  torch.device("cpu"))
    assert [k["name"] for k in kept] == ["other"]
    _, gm = _captured()
    with pytest.warns(UserWarning, match="fp8 site.*0.*no aten.linear node"):
        apply_fp8_sites(gm, {"0": Fp8Recipe.uniform(FP8_ROW)}, [], torch.device("cpu"))


def test_a_plan_with_fp8_sites_and_kernels_trains_in_graph_mode(tmp_path) -> None:
    """The runner used to refuse fp8 sites next to kernels: now graph mode trains them,
    with module mode's (the swapped Fp8Linear's) losses."""
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(MODEL, {}, topology="h200:1x1")
    assert plan["kernels"]
    plan["precision"] = [{"target": "*", "dtype": "bf16"},
                         {"target": "block.down", "dtype": "fp8", "recipe": ROW},
                         {"target": "block.up", "dtype": "fp8", "recipe": ROW}]
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, json.loads(json.dumps(plan)))
    opts = dict(steps=3, device="cpu", progress=False)
    got = run(plan_path, RunOptions(**opts))
    assert got.report["execution"].startswith("graph")
    ref = run(plan_path, RunOptions(**opts, kernels=False))
    torch.testing.assert_close([v for _, v in got.losses], [v for _, v in ref.losses],
                               rtol=2e-2, atol=2e-3)


def test_forced_fp8_entries_pick_big_aligned_linears_outside_fp32_sites() -> None:
    from gemc.backends.torch.precision import forced_fp8_entries

    from gemc.errors import GemcUserError

    model = nn.ModuleDict({
        "big": nn.Linear(64, 48), "small": nn.Linear(64, 16), "odd": nn.Linear(72, 50),
        "kept": nn.Sequential(nn.Linear(64, 64)), "planned": nn.Linear(64, 64)})
    entries = [{"target": "*", "dtype": "bf16"}, {"target": "kept", "dtype": "fp32"},
               {"target": "planned", "dtype": "fp8", "recipe": {**ROW, "wgrad": {
                   "dtype": "bf16", "scaling": None}}}]
    got = forced_fp8_entries(model, 32, entries)
    assert [e["target"] for e in got] == ["big"]
    assert Fp8Recipe.from_dict(got[0]["recipe"]) == Fp8Recipe.uniform(FP8_ROW)
    for bad in (8, 32.0, True):
        with pytest.raises(GemcUserError, match="--fp8-linears"):
            forced_fp8_entries(model, bad, entries)


def test_fp8_linears_forces_fp8_in_graph_mode_and_reports_it(tmp_path) -> None:
    """``gemc run --fp8-linears N``: the lead's switch for an A/B of fp8 on a plan that did
    not pick it; the losses stay near bf16's (row-wise e4m3: ~30 dB per GEMM)."""
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(MODEL, {}, topology="h200:1x1")
    plan["precision"] = [{"target": "*", "dtype": "bf16"}]
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, json.loads(json.dumps(plan)))
    opts = dict(steps=3, device="cpu", progress=False)
    with pytest.warns(UserWarning, match="replace the linear of an fp8 site"):
        got = run(plan_path, RunOptions(**opts, fp8_min_features=32))
    assert got.report["forced_fp8_linears"] == ["block.up", "block.down", "attn.q", "attn.k",
                                                "attn.v"]
    ref = run(plan_path, RunOptions(**opts))
    assert ref.report["forced_fp8_linears"] == []
    torch.testing.assert_close([v for _, v in got.losses], [v for _, v in ref.losses],
                               rtol=5e-2, atol=5e-3)

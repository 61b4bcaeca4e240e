"""Module-scoped precision sites in graph mode (backends/torch/graph_precision.py): the
captured graph's nodes take their module's autocast scope, as the module hooks give it in
module mode, instead of the plan being refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemc.backends.torch.graph_precision import scope_module_precision
from gemc.backends.torch.runner import RunOptions, run
from torch import nn

from gemc.plan import write_plan

TOY = str(Path(__file__).resolve().parents[1] / "models" / "toy.py") + ":build"


def _captured() -> torch.fx.GraphModule:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return torch.export.export(model, (torch.randn(2, 8),)).module()


def test_nodes_of_an_fp32_site_run_in_fp32_under_bf16_autocast() -> None:
    gm = _captured()
    x = torch.randn(2, 8)
    entries = [{"name": "k0", "nodes": []}]
    kept, taken = scope_module_precision(gm, {"2": torch.float32}, entries, "cpu")
    assert kept == entries and taken and set(taken.values()) == {"2"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gm(x)
    assert out.dtype == torch.float32  # the last linear ran in fp32 on a lifted bf16 input
    ref_model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    ref_model.load_state_dict(gm.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = ref_model[1](ref_model[0](x))
    with torch.autocast("cpu", enabled=False):
        want = ref_model[2](hidden.float())
    torch.testing.assert_close(out, want)


def test_a_kernel_over_a_scoped_node_is_left_out_loudly() -> None:
    gm = _captured()
    scoped = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    entries = [{"name": "gemm_0", "nodes": scoped[:1]}, {"name": "other", "nodes": []}]
    with pytest.warns(UserWarning, match=r"gemm_0 \(0\)"):
        kept, _ = scope_module_precision(gm, {"0": torch.float32}, entries, "cpu")
    assert [e["name"] for e in kept] == ["other"]


def test_a_plan_with_an_fp32_site_and_kernels_trains_in_graph_mode(tmp_path) -> None:
    """What gemc's precision pass emits for DLRM (fp32 layers in a bf16 model, next to
    kernels), which the runner used to refuse: it trains, through the captured graph, with
    module mode's losses."""
    from gemc.api import compile as gemc_compile

    plan = gemc_compile(TOY, {}, topology="h200:1x1")
    plan["precision"] = [{"target": "*", "dtype": "bf16"},
                         {"target": "tower.3", "dtype": "fp32"}]
    assert any(k["kind"] == "gemm_epilogue" for k in plan["kernels"])
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, json.loads(json.dumps(plan)))
    opts = dict(steps=3, device="cpu", progress=False)
    got = run(plan_path, RunOptions(**opts))
    assert got.report["execution"].startswith("graph")
    ref = run(plan_path, RunOptions(**opts, kernels=False))
    torch.testing.assert_close([v for _, v in got.losses], [v for _, v in ref.losses],
                               rtol=2e-2, atol=2e-3)

"""predict-time on a tiny exported graph whose annotations are set by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gemc.cost_model.topology import parse_topology
from gemc.passes.predict_time import PREDICTED_SOURCE, PredictTime
from torch import nn

from gemc import ir
from gemc.ir import OpKind


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(1000, 16, mode="sum")
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids, offsets)
        return self.norm(torch.relu(self.lin(x))).sum()


def _annotated() -> torch.fx.GraphModule:
    ids = torch.randint(0, 1000, (64,))
    offsets = torch.arange(0, 64, 8)
    gm = torch.export.export(Tiny(), (ids, offsets)).graph_module
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op == "placeholder":
            kind = OpKind.PARAM if node.name.startswith("p_") else OpKind.INPUT
        elif node.op == "output":
            kind = OpKind.OUTPUT
        elif "embedding_bag" in name:
            kind = OpKind.EMBEDDING
            node.meta[ir.TABLE] = {"fqn": "emb.weight", "rows": 1000, "dim": 16, "batch": 8,
                                   "nnz": 64, "mode": "sum"}
        elif "linear" in name or "addmm" in name:
            kind = OpKind.GEMM
            node.meta[ir.GEMM] = {"batch": 1, "m": 8, "n": 32, "k": 16}
        elif "layer_norm" in name:
            kind = OpKind.NORM
        elif "relu" in name:
            kind = OpKind.POINTWISE
        elif "sum" in name:
            kind = OpKind.REDUCTION
        elif name.startswith("<built-in") or "getitem" in name:
            kind = OpKind.VIEW
        else:
            kind = OpKind.OTHER
        node.meta[ir.KIND] = kind.value
        node.meta[ir.FLOPS] = 2 * 8 * 32 * 16 if kind is OpKind.GEMM else 256
        node.meta[ir.BYTES] = 0 if kind in (OpKind.VIEW, OpKind.INPUT, OpKind.PARAM,
                                            OpKind.OUTPUT) else 4096
    return gm


@pytest.mark.parametrize("calibrated", [False, True])
def test_every_compute_node_gets_a_time(calibrated: bool, calibration) -> None:
    gm = _annotated()
    ctx = SimpleNamespace(topology=parse_topology("h200:1x8"),
                          calibration=calibration if calibrated else None, warnings=[])
    ctx.warn = ctx.warnings.append
    gm, changed = PredictTime().run(gm, ctx)
    assert changed
    kinds = {}
    for node in gm.graph.nodes:
        kind = ir.kind_of(node)
        ms = node.meta[ir.PREDICTED_MS]
        kinds[kind] = ms
        if kind in (OpKind.GEMM, OpKind.EMBEDDING, OpKind.NORM, OpKind.POINTWISE):
            assert 0 < ms < 1.0, (node.name, ms)
            assert node.meta[PREDICTED_SOURCE] == ("calibrated" if calibrated else "roofline")
        if kind in (OpKind.INPUT, OpKind.PARAM, OpKind.OUTPUT, OpKind.VIEW):
            assert ms == 0.0
    assert OpKind.GEMM in kinds and OpKind.EMBEDDING in kinds
    assert bool(ctx.warnings) is not calibrated


def test_pass_needs_a_topology() -> None:
    with pytest.raises(ValueError, match="topology"):
        PredictTime().run(_annotated(), SimpleNamespace(topology=None, calibration=None))
    assert PredictTime.name == "predict-time"

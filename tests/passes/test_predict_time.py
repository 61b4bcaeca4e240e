"""predict-time, intent on a small graph: every node gets a forward+backward time and its
source (views and inputs free, compute priced by roofline without a calibration, with a
warning saying so); the time follows the work (a GEMM of 64^3 x the FLOPs costs more, a
pointwise op over 4096x the bytes costs more); ``eager`` prices an embedding's dense table
gradient; the GPU it priced on is recorded for the plan builder.

Calibrated pricing and the topology requirement: tests/cost_model/test_predict_time.py;
the cost model itself: tests/cost_model/test_op_cost.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.passes.predict_time import PredictTime
from torch import nn

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of, node

aten = torch.ops.aten


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(1_000_000, 64, mode="sum")
        self.small = nn.Linear(64, 64)
        self.big = nn.Linear(4096, 4096)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor
                ) -> torch.Tensor:
        s = F.relu(self.small(self.table(ids, offsets)))  # [64, 64]
        b = F.relu(self.big(x))  # [4096, 4096]
        return s.sum() + b.sum()


def _priced(eager: bool = False):
    with torch.device("meta"):  # shapes only: nothing of 64 MB is allocated
        model = _Two()
    inputs = (torch.zeros(640, dtype=torch.long), torch.arange(0, 640, 10),
              torch.zeros(4096, 4096, device="meta"))
    return graph_of(model, inputs, annotated(PredictTime(eager=eager)), topology="h200:1x8")


def test_every_node_is_priced_by_its_work_and_the_source_is_named():
    gm, ctx = _priced()
    check_graph(gm, """
        CHECK: %ids = input
        CHECK-SAME: predicted_ms=0 predicted_source=free
        CHECK: aten.embedding_bag
        CHECK-SAME: predicted_source=roofline
        CHECK: getitem(
        CHECK-SAME: predicted_ms=0 predicted_source=free
        CHECK: aten.linear.default
        CHECK-SAME: predicted_source=roofline
    """)
    small, big = node(gm, aten.linear.default, 0), node(gm, aten.linear.default, 1)
    assert big.meta[ir.FLOPS] == 64**3 * small.meta[ir.FLOPS]
    assert big.meta[ir.PREDICTED_MS] > 100 * small.meta[ir.PREDICTED_MS] > 0
    relu_s, relu_b = node(gm, aten.relu.default, 0), node(gm, aten.relu.default, 1)
    assert relu_b.meta[ir.PREDICTED_MS] > relu_s.meta[ir.PREDICTED_MS] > 0
    assert gm.meta[ir.PRICING]["gpu"].name.lower().startswith("h200")
    assert gm.meta[ir.PRICING]["world_size"] == 8
    assert any("no calibration" in w for w in ctx.warnings), ctx.warnings


def test_eager_prices_the_dense_table_gradient():
    """Eager PyTorch writes a dense gradient the size of the table (1M x 64 here) and
    updates every row; the batched kernel touches the looked-up rows only."""
    lookup = node(_priced()[0], aten.embedding_bag.padding_idx).meta[ir.PREDICTED_MS]
    dense = node(_priced(eager=True)[0], aten.embedding_bag.padding_idx).meta[ir.PREDICTED_MS]
    assert dense > 2 * lookup

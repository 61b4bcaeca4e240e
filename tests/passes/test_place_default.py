"""place-default, intent on a small graph: dense compute replicated (DDP), views without a
placement; tables table-wise round-robin over the ranks, largest first; a table too large
for its share of one GPU row-wise over every rank; one rank: everything on rank 0.

The plans it feeds (schema, byte stability) are tested in tests/test_plan.py."""

from __future__ import annotations

import torch
from gemc.passes.place_default import PlaceDefault
from torch import nn

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of


class _Tables(nn.Module):
    def __init__(self, huge_rows: int) -> None:
        super().__init__()
        self.tiny = nn.EmbeddingBag(5, 4, mode="sum")
        self.small = nn.EmbeddingBag(10, 4, mode="sum")
        self.large = nn.EmbeddingBag(40, 4, mode="sum")
        self.mid = nn.EmbeddingBag(20, 4, mode="sum")
        self.huge = nn.EmbeddingBag(huge_rows, 64, mode="sum")
        self.fc = nn.Linear(80, 1)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = [t(ids, offsets) for t in (self.tiny, self.small, self.large, self.mid,
                                                self.huge)]
        return self.fc(torch.cat(pooled, 1)).sum()


def _placements(topology: str, huge_rows: int) -> tuple[object, dict[str, dict]]:
    # on the meta device: the huge table (0.25 of an H200 is ~35 GB) is never allocated
    with torch.device("meta"):
        model = _Tables(huge_rows)
    gm, _ = graph_of(model, (torch.zeros(6, dtype=torch.long), torch.tensor([0, 2, 6])),
                     annotated(PlaceDefault()), topology=topology)
    return gm, {n.meta[ir.TABLE]["fqn"]: n.meta[ir.PLACEMENT] for n in gm.graph.nodes
                if ir.TABLE in n.meta}


def test_tables_round_robin_largest_first_and_a_huge_one_row_wise():
    gm, tables = _placements("h200:1x2", 200_000_000)
    assert tables == {
        "huge.weight": {"sharding": "row_wise", "ranks": [0, 1]},
        "large.weight": {"sharding": "table_wise", "ranks": [0]},
        "mid.weight": {"sharding": "table_wise", "ranks": [1]},
        "small.weight": {"sharding": "table_wise", "ranks": [0]},
        "tiny.weight": {"sharding": "table_wise", "ranks": [1]},
    }
    check_graph(gm, """
        CHECK: %cat = aten.cat.default(
        CHECK-SAME: placement={strategy:ddp}
        CHECK-NEXT: aten.linear.default
        CHECK-SAME: placement={strategy:ddp}
        CHECK: return
        CHECK-NOT: placement=
    """)
    # views carry no placement (they follow their producer)
    assert all(ir.PLACEMENT not in n.meta for n in gm.graph.nodes
               if ir.kind_of(n) is ir.OpKind.VIEW)


def test_one_rank_takes_every_table_whole():
    _, tables = _placements("h200:1x1", 200_000_000)
    assert {p["sharding"] for p in tables.values()} == {"table_wise"}
    assert {tuple(p["ranks"]) for p in tables.values()} == {(0,)}

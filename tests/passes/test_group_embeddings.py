"""group-embeddings, intent on small graphs: the bag lookups of one batch size become one
``batched_embedding_bag`` kernel (sum and mean bags alike), another batch size another
kernel; a lookup the batched kernel cannot take (a tied weight read elsewhere, per-sample
weights, max pooling) stays ATen's.

The batched lookup and fused optimizer against eager, and the padding-index case:
tests/fusion/test_group_embeddings.py; golden tests/golden/group_embeddings.txt."""

from __future__ import annotations

import pytest
import torch
from gemc.passes.group_embeddings import GroupEmbeddings
from torch import nn

from gemc import ir
from gemc.errors import PassFailure
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of

aten = torch.ops.aten


class _Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(20, 4, mode="sum")
        self.b = nn.EmbeddingBag(30, 4, mode="mean")
        self.c = nn.EmbeddingBag(10, 4, mode="sum")  # a batch of 2, not 3
        self.tied = nn.EmbeddingBag(12, 4, mode="sum")  # its weight also read as a matrix
        self.weighted = nn.EmbeddingBag(14, 4, mode="sum")
        self.maxed = nn.EmbeddingBag(16, 4, mode="max")

    def forward(self, ids: torch.Tensor, off3: torch.Tensor, off2: torch.Tensor,
                w: torch.Tensor) -> torch.Tensor:
        pooled = [self.a(ids, off3), self.b(ids, off3), self.c(ids, off2),
                  self.tied(ids, off3), self.weighted(ids, off3, per_sample_weights=w),
                  self.maxed(ids, off3)]
        return sum(p.sum() for p in pooled) + self.tied.weight.sum()


def _inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 10, (7,)), torch.tensor([0, 2, 5]), torch.tensor([0, 4]),
            torch.rand(7))


def test_lookups_of_one_batch_are_one_kernel_and_the_rest_stay_aten():
    gm, _ = graph_of(_Bags(), _inputs(), annotated(GroupEmbeddings()))
    check_graph(gm, """
        CHECK: aten.embedding_bag.padding_idx(%p_a_weight
        CHECK-SAME: group=batched_embedding_bag_1
        CHECK: aten.embedding_bag.padding_idx(%p_b_weight
        CHECK-SAME: group=batched_embedding_bag_1
        CHECK: aten.embedding_bag.padding_idx(%p_c_weight
        CHECK-SAME: group=batched_embedding_bag_0
        CHECK: kernel={id:batched_embedding_bag_0,kind:batched_embedding_bag,tables:1,batch:2,
    """)
    grouped = {n.args[0].name for n in gm.graph.nodes
               if ir.GROUP in n.meta and ir.TABLE in n.meta}
    assert grouped == {"p_a_weight", "p_b_weight", "p_c_weight"}
    kernel = next(n.meta[ir.KERNEL] for n in gm.graph.nodes
                  if (n.meta.get(ir.KERNEL) or {}).get("id") == "batched_embedding_bag_1")
    assert (kernel["tables"], kernel["batch"], kernel["optimizer"]) == (2, 3, "rowwise_adagrad")


def test_the_optimizer_option_reaches_the_kernel_and_a_bad_one_is_refused():
    gm, _ = graph_of(_Bags(), _inputs(), annotated(GroupEmbeddings(optimizer="adam", lr=0.5)))
    check_graph(gm, "CHECK: kind:batched_embedding_bag,tables:2,batch:3,optimizer:adam,lr:0.5,")
    with pytest.raises(PassFailure, match="optimizer must be one of"):
        graph_of(_Bags(), _inputs(), annotated(GroupEmbeddings(optimizer="sgd")))

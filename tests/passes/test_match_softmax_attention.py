"""match-softmax-attention, intent on softmax attention written out by hand over ``[B, H,
L, D]``: ``softmax(q @ k^T / sqrt(d) + additive_mask) @ v`` and the ``masked_fill(~keep,
-inf)`` spelling become one guarded ``key_padding_attention`` group (scores, scale, mask,
softmax and output matmul; the mask the run-time check reads named); the dead read of the
weights (``need_weights``' average nobody uses) is removed. Not matched:

- a softmax over the *queries* (dim 2 of ``[B, H, L, L]`` scores: a column softmax, which
  the kernel does not compute), with no reason: it is no attention;
- no mask (``no-key-padding-mask``), weights read by something live (``weights-read-by:``),
  attention dropout (``dropout``): left padded, the reason in the dump and a warning;
- a matmul after a dropout that reads no softmax: no attention, no warning.

Numerics (the written-out formula and ``nn.MultiheadAttention``'s need_weights form against
eager, NaN rows included): tests/fusion/test_key_padding_attention.py (forms ``formula``,
``mha_weights``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gemc.passes.match_softmax_attention import MatchSoftmaxAttention
from torch import nn

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of
from tests.passes.written_attention import B, D, L, WrittenAttention, inputs


class _Formula(WrittenAttention):
    def weights(self, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        additive = torch.zeros(B, L).masked_fill(~keep, float("-inf"))[:, None, None, :]
        if self.form == "fill":
            p = torch.softmax(scores.masked_fill(~keep[:, None, None, :], float("-inf")), -1)
        elif self.form == "queries":
            p = torch.softmax(scores + additive, 2)
        elif self.form == "nomask":
            p = torch.softmax(scores, -1)
        else:
            p = torch.softmax(scores + additive, -1)
        return F.dropout(p, 0.1) if self.form == "dropout" else p

    def extra(self, weights: torch.Tensor) -> torch.Tensor | None:
        if self.form == "dead":
            weights.mean(1)  # the average weights, computed and discarded
        return weights.sum() if self.form == "weights" else None


def _matched(form: str):
    return graph_of(_Formula(form), inputs(), annotated(MatchSoftmaxAttention()))


@pytest.mark.parametrize("form,mask,additive", [("additive", "masked_fill", True),
                                                ("fill", "keep", False)])
def test_the_written_out_formula_is_one_guarded_attention(form: str, mask: str,
                                                          additive: bool):
    gm, ctx = _matched(form)
    check_graph(gm, f"""
        CHECK-NOT: group=
        CHECK: %matmul = aten.matmul.default(%getitem, %transpose)
        CHECK-SAME: group=softmax_attention_0
        CHECK-NEXT: aten.div.Tensor(%matmul, 2.0)
        CHECK-SAME: group=softmax_attention_0
        CHECK-NOT: group=
        CHECK: = {{{{aten.add.Tensor|aten.masked_fill.Scalar}}}}(%div,
        CHECK-SAME: group=softmax_attention_0
        CHECK-NEXT: aten.softmax.int(
        CHECK-SAME: group=softmax_attention_0
        CHECK-NEXT: %matmul_1 = aten.matmul.default(%softmax, %getitem_2)
        CHECK-SAME: kind:key_padding_attention,q:getitem,k:getitem_1,v:getitem_2,output:matmul_1,
        CHECK-SAME: mask:{mask},additive:{additive},causal:False,zero_padding_queries:True,
        CHECK-SAME: heads:2,head_dim:4,scale:0.5,
        CHECK-NOT: group=
    """)
    assert not ctx.warnings


def test_the_unused_average_of_the_weights_is_removed():
    gm, _ = _matched("dead")
    check_graph(gm, "CHECK: kind:key_padding_attention\nCHECK-NOT: aten.mean.dim")


def test_a_softmax_over_the_queries_is_no_attention():
    gm, ctx = _matched("queries")
    check_graph(gm, "CHECK: aten.softmax.int(%add, 2)\nCHECK-NOT: group=\nCHECK-NOT: skipped")
    assert not ctx.warnings


@pytest.mark.parametrize("form,reason", [("nomask", "no-key-padding-mask"),
                                         ("weights", "weights-read-by:sum_2"),
                                         ("dropout", "dropout")])
def test_what_is_not_a_key_padding_attention_stays_padded_with_its_reason(form: str,
                                                                          reason: str):
    gm, ctx = _matched(form)
    check_graph(gm, f"""
        CHECK-NOT: group=
        CHECK: %matmul_1 = aten.matmul.default(
        CHECK-SAME: softmax_skipped={reason}
        CHECK-NOT: group=
    """)
    assert ctx.warnings == [f"match-softmax-attention: matmul_1 stays padded ({reason})"]


def test_a_matmul_after_a_dropout_that_reads_no_softmax_is_no_attention():
    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (F.dropout(x, 0.1) @ self.w).sum()

    gm, ctx = graph_of(Mlp(), (torch.randn(4, 8),), annotated(MatchSoftmaxAttention()))
    check_graph(gm, "CHECK: aten.matmul.default\nCHECK-NOT: skipped")
    assert not ctx.warnings
    assert not [n for n in gm.graph.nodes if ir.GROUP in n.meta]

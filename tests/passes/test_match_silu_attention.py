"""match-silu-attention, intent on HSTU's pointwise attention written out by hand over
``[B, H, L, D]``: ``(silu(q @ k^T) / n * key_mask) @ v`` with a boolean ``[B, L]`` keep-mask
and-ed on the query axis is one guarded ``jagged_silu_attention`` group (scores, silu,
normaliser, mask multiply, output matmul), its facts naming the mask, ``n``, no causal. Look-alikes
that compute something else are not matched: ``relu`` in place of ``silu`` (no attention,
no reason), a normaliser per row (``normaliser``), an addend that is no ``[B|1, H|1, L, L]``
bias (``bias-shape``), a causal mask and-ed with a mask on the query axis only (``no-key-padding-mask``).
A bare key mask (no and, broadcast as ``[B, 1, 1, L]``) is a key mask.

Every spelling (causal, query mask, ``where``, ``* 1/n``, bias, einsum, zero-padded values)
against eager, the run-time fallback counted: tests/fusion/test_match_silu_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.passes.match_silu_attention import MatchSiluAttention

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of
from tests.passes.written_attention import L, WrittenAttention, inputs


class _Pointwise(WrittenAttention):
    def weights(self, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        s = q @ k.transpose(-1, -2)
        if self.form == "bias":
            s = s + q.sum(-1, keepdim=True)  # [B, H, L, 1]: a per-query addend
        act = F.relu(s) if self.form == "relu" else F.silu(s)
        n = keep.sum(1).clamp(min=1)[:, None, None, None] if self.form == "per_row" else L
        if self.form == "queries":  # causal and the query axis only: no key mask
            visible = torch.ones(L, L, dtype=torch.bool).tril()[None] & keep[:, :, None]
        elif self.form == "keys":  # the key axis only, no and
            visible = keep[:, None, :]
        else:  # the key axis and the query axis
            visible = keep[:, None, :] & keep[:, :, None]
        return act / n * visible[:, None].to(s.dtype)


def _matched(form: str):
    return graph_of(_Pointwise(form), inputs(), annotated(MatchSiluAttention()))


def _warnings(ctx) -> list[str]:
    """This pass's warnings, not the other passes'."""
    return [w for w in ctx.warnings if w.startswith("match-silu-attention")]


def test_the_formula_is_one_guarded_jagged_silu_kernel():
    gm, ctx = _matched("silu")
    check_graph(gm, """
        CHECK-NOT: group=
        CHECK: %matmul = aten.matmul.default(%getitem, %transpose)
        CHECK-SAME: group=jagged_silu_attention_0
        CHECK-NEXT: aten.silu.default(%matmul)
        CHECK-SAME: group=jagged_silu_attention_0
        CHECK-NOT: group=
        CHECK: aten.div.Tensor(%silu, 4)
        CHECK-SAME: group=jagged_silu_attention_0
        CHECK-NOT: group=
        CHECK: aten.mul.Tensor(%div,
        CHECK-SAME: group=jagged_silu_attention_0
        CHECK-NEXT: %matmul_1 = aten.matmul.default(%mul, %getitem_2)
        CHECK-SAME: kind:jagged_silu_attention,q:getitem,k:getitem_1,v:getitem_2,output:matmul_1,
        CHECK-SAME: mask:keep,offsets:None,
        CHECK-SAME: bias:None,norm:4,scale:1,causal:False,query_mask:True,max_len:4,heads:2,
        CHECK-NOT: group=
    """)
    assert not _warnings(ctx)


def test_relu_in_place_of_silu_is_no_pointwise_attention():
    gm, ctx = _matched("relu")
    check_graph(gm, "CHECK: aten.relu.default\nCHECK-NOT: group=\nCHECK-NOT: silu_skipped")
    assert not _warnings(ctx)


@pytest.mark.parametrize("form,reason", [("per_row", "normaliser"), ("bias", "bias-shape"),
                                         ("queries", "no-key-padding-mask")])
def test_a_look_alike_stays_the_padded_formula_with_its_reason(form: str, reason: str):
    gm, ctx = _matched(form)
    check_graph(gm, f"""
        CHECK-NOT: group=
        CHECK: %matmul_1 = aten.matmul.default(
        CHECK-SAME: silu_skipped={reason}
        CHECK-NOT: group=
    """)
    assert not [n for n in gm.graph.nodes if ir.KERNEL in n.meta]
    assert _warnings(ctx) == [f"match-silu-attention: matmul_1 stays the padded formula ({reason})"]


def test_a_bare_key_mask_is_a_key_mask():
    gm, _ = _matched("keys")
    check_graph(gm, "CHECK: %matmul_1 = aten.matmul.default(\nCHECK-SAME: kind:jagged_silu_attention")

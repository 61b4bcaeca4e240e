"""match-jagged-attention, intent on one small self-attention over a jagged history with
its key-padding mask spelled several ways (tests/passes/jagged_model.py):

- ``arange(L) < lengths.clamp(min=1)`` over the offsets the history was padded with is
  proven a prefix: the jagged kernel, run over the mask's (clamped) lengths;
- a boolean ``[B, L]`` mask input is a key-padding mask the graph cannot prove a prefix: the
  guarded ``key_padding_attention`` (checked at run time, exact fallback);
- look-alikes that are not the proven mask must not become the jagged kernel: the
  complement ``arange >= lengths`` (it keeps the padding) and ``arange < lengths`` of other
  offsets than the padding's are guarded like any data mask;
- what is no key-padding mask at all (one that varies over the queries) and dropout stay
  padded SDPA, with the reason in the dump and a warning.

Numerics (the kernel and the runner against eager, empty and full rows), the reader of
padding rows, cross-attention and the golden dump: tests/fusion/test_match_jagged_attention.py;
every mask source against eager: tests/fusion/test_key_padding_attention.py."""

from __future__ import annotations

import pytest
import torch
from gemc.passes.match_jagged_attention import MatchJaggedAttention

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of, node
from tests.passes.jagged_model import Jagged, inputs

aten = torch.ops.aten
SDPA = "aten.scaled_dot_product_attention.default("


def _matched(mask: str):
    gm, ctx = graph_of(Jagged(mask), inputs(), annotated(MatchJaggedAttention()))
    return gm, ctx, node(gm, aten.scaled_dot_product_attention.default)


def test_the_proven_length_mask_is_the_jagged_kernel():
    gm, ctx, sdpa = _matched("lengths")
    check_graph(gm, f"""
        CHECK: %index_put = aten.index_put.default(
        CHECK: %lt = aten.lt.Tensor(
        CHECK: {SDPA}
        CHECK-SAME: group=jagged_attention_0
        CHECK-SAME: kind:jagged_attention,offsets:offsets,clamp_min:1,max_len:4,heads:2,head_dim:4,
        CHECK-SAME: padded_from:index_put,fill:0.583333
        CHECK-NOT: jagged_attention_1
    """)
    assert not ctx.warnings


@pytest.mark.parametrize("mask,checked", [("input", "keep"), ("complement", "ge"),
                                          ("other_offsets", "lt")])
def test_a_mask_the_graph_cannot_prove_is_guarded_never_jagged(mask: str, checked: str):
    gm, _, sdpa = _matched(mask)
    check_graph(gm, f"""
        CHECK-NOT: jagged_attention
        CHECK: {SDPA}
        CHECK-SAME: group=key_padding_attention_0
        CHECK-SAME: kind:key_padding_attention,mask:{checked},additive:False,causal:False,
        CHECK-SAME: fill:1}}
        CHECK-NOT: jagged_attention
    """)


@pytest.mark.parametrize("mask,reason", [("queries", "mask-varies-over-queries"),
                                         ("dropout", "dropout")])
def test_no_key_padding_mask_or_dropout_stays_padded_with_its_reason(mask: str, reason: str):
    gm, ctx, sdpa = _matched(mask)
    check_graph(gm, f"CHECK: {SDPA}\nCHECK-NOT: group=\nCHECK-SAME: jagged_skipped={reason} ")
    assert ir.KERNEL not in sdpa.meta
    assert ctx.warnings == [f"match-jagged-attention: {sdpa.name} stays padded SDPA ({reason})"]

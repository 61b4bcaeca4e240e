"""pack-jagged-tokens, intent on small graphs:

- around the jagged attention (tests/passes/jagged_model.py), the region starts at the
  ``index_put`` that pads the history, takes the token-wise ops (GEMMs, views, the
  attention's operands and output) with the (batch, sequence) dims of each, and ends at the
  multiply by the key-padding mask, whose padding rows are zero (``zeroed``);
- a second reader of the padded history that reads its padding rows unmasked (a mean over
  every position of a projection whose padding rows hold its bias) leaves it padded, with
  a warning naming the reader;
- around a guarded attention over a padded ``[B, L, D]`` input and a boolean keep-mask, a
  region checked at run time (``guard: prefix-check`` on that mask), where a sequence-mixing
  op (``cumsum`` over the positions) keeps the graph padded and says why.

The packed runner against eager, the layout helpers and the golden dump:
tests/fusion/test_pack_jagged_tokens.py; guarded regions against eager, compiled:
tests/fusion/test_guarded_packed_tokens.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemc.passes.match_jagged_attention import MatchJaggedAttention
from gemc.passes.pack_jagged_tokens import PackJaggedTokens
from torch import nn

from gemc import ir
from tests.passes.filecheck import check_graph
from tests.passes.helpers import annotated, graph_of
from tests.passes.jagged_model import HEADS, Jagged, inputs

PASSES = (MatchJaggedAttention(), PackJaggedTokens())
REGION = "packed={id:packed_tokens_0,dims:"


def test_the_region_runs_from_the_padding_to_the_mask_multiply():
    gm, ctx = graph_of(Jagged("lengths"), inputs(), annotated(*PASSES))
    check_graph(gm, f"""
        CHECK-NOT: packed=
        CHECK: %index_put = aten.index_put.default(
        CHECK-SAME: {REGION}[0, 1],zeroed:False}}
        CHECK-SAME: packed_region={{id:packed_tokens_0,kind:packed_tokens,padded_from:index_put,
        CHECK-SAME: offsets:offsets,clamp_min:1,max_len:4,batch:3,fill:0.583333
        CHECK: aten.linear.default(%index_put, %p_qkv_weight
        CHECK-SAME: {REGION}[0, 1],
        CHECK: %getitem_2 = getitem(
        CHECK-SAME: {REGION}[0, 2],
        CHECK-NEXT: aten.scaled_dot_product_attention.default(
        CHECK-SAME: kind:jagged_attention
        CHECK-NEXT: aten.transpose.int(
        CHECK-SAME: {REGION}[0, 1],
        CHECK: aten.linear.default(%reshape, %p_out_weight
        CHECK-SAME: {REGION}[0, 1],zeroed:False}}
        CHECK: aten.mul.Tensor(%linear_2,
        CHECK-SAME: {REGION}[0, 1],zeroed:True}}
        CHECK-NOT: packed=
    """)
    assert not ctx.warnings


def test_a_reader_of_the_padding_rows_leaves_the_history_padded():
    gm, ctx = graph_of(Jagged("lengths", tail="side"), inputs(), annotated(*PASSES))
    # the attention is still jagged (its own padding rows are masked)...
    check_graph(gm, "CHECK: aten.scaled_dot_product_attention\nCHECK-SAME: kind:jagged_attention")
    # ...but its history is read unmasked beside it: no region at all
    assert not [n for n in gm.graph.nodes if ir.PACKED in n.meta or ir.PACKED_REGION in n.meta]
    assert ctx.warnings == ["pack-jagged-tokens: index_put stays padded: its padding rows may "
                            "be read unmasked by mean: a reduction over the token axis (mean "
                            "over the L = 4 positions of each row in mean, from the model "
                            "(Jagged)) reads padded tokens; packing would change the result"]


class _PaddedHistory(nn.Module):
    """A padded ``[B, L, D]`` history input under a boolean keep-mask input."""

    def __init__(self, mix: bool, extended: bool = False, pool_additive: bool = False
                 ) -> None:
        super().__init__()
        self.mix, self.extended, self.pool_additive = mix, extended, pool_additive
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]
        if self.extended:  # Hugging Face's: the arithmetic after the unsqueezes
            mask = (1.0 - mask.to(x.dtype)) * -10000.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = self.out(a.transpose(1, 2).reshape(b, n, d))
        y = y.cumsum(1) if self.mix else y
        if self.pool_additive:  # an additive mask multiplied in: no zeroing of the padding
            return (y * ((1.0 - keep.to(y.dtype)) * -10000.0)[:, :, None]).sum()
        return (y * keep[:, :, None].to(y.dtype)).sum()


def _padded(mix: bool, **kwargs: bool):
    keep = torch.arange(4)[None, :] < torch.tensor([1, 4, 2])[:, None]
    return graph_of(_PaddedHistory(mix, **kwargs), (torch.randn(3, 4, 8), keep),
                    annotated(*PASSES))


def test_a_run_time_mask_gives_a_guarded_region():
    gm, ctx = _padded(mix=False)
    check_graph(gm, f"""
        CHECK: %x = input
        CHECK-NOT: packed=
        CHECK: aten.linear.default(%x, %p_qkv_weight
        CHECK-SAME: {REGION}[0, 1],zeroed:False}}
        CHECK-SAME: packed_region={{id:packed_tokens_0,kind:packed_tokens,guard:prefix-check,
        CHECK-SAME: mask:keep,additive:False,compact:True,
        CHECK: aten.scaled_dot_product_attention.default(
        CHECK-SAME: kind:key_padding_attention,mask:keep,
        CHECK-SAME: {REGION}[0, 2],
        CHECK: aten.mul.Tensor(
        CHECK-SAME: zeroed:True}}
    """)
    # no refusal; the fill is priced padded, loudly: this context has no sample batch
    assert [w.split(":")[0] for w in ctx.warnings] == ["guarded-region fill"], ctx.warnings


def test_a_sequence_mixing_op_reads_the_guarded_history_over_representatives():
    """A scan over the positions after the attention reads the padded tokens: the history
    packs over padding representatives laid out from its source (``pad_reps``), the scan
    outside the region reading the value scattered back (eager's padded value)."""
    gm, ctx = _padded(mix=True)
    check_graph(gm, f"""
        CHECK: aten.linear.default(%x, %p_qkv_weight
        CHECK-SAME: packed_region={{id:packed_tokens_0,kind:packed_tokens,guard:prefix-check,
        CHECK-SAME: mask:x,additive:False,compact:False,in_place:[],
        CHECK-SAME: pad_rep:True,rep_sources:['x'],
        CHECK-SAME: rep_layout:sources,rep_attentions:['scaled_dot_product_attention']
        CHECK: aten.scaled_dot_product_attention.default(
        CHECK-SAME: {REGION}[0, 2],
        CHECK: %cumsum = aten.cumsum.default(
        CHECK-NOT: packed=
    """)
    assert [w.split(":")[0] for w in ctx.warnings] == ["guarded-region fill"], ctx.warnings


def test_an_extended_mask_is_read_as_the_keep_mask_it_is_made_from():
    """Hugging Face's ``(1.0 - keep[:, None, None, :].to(dtype)) * -10000.0``: a
    ``[B, 1, 1, L]`` additive mask no ``[B, L]`` tensor holds (its region stayed padded:
    ``mask-rows-broadcast``). It is ``keep`` (the pooling's multiply by ``keep`` zeroes its
    padding rows, as under a boolean mask), but the region is checked on the additive mask
    itself, its rows: a row it drops whole (-1e4 everywhere) attends uniformly over every
    key in eager, which the additive rule keeps and ``keep`` would drop."""
    gm, ctx = _padded(False, extended=True)
    check_graph(gm, f"""
        CHECK: aten.linear.default(%x, %p_qkv_weight
        CHECK-SAME: packed_region={{id:packed_tokens_0,kind:packed_tokens,guard:prefix-check,
        CHECK-SAME: mask:mul,additive:True,
        CHECK: aten.scaled_dot_product_attention.default(
        CHECK-SAME: kind:key_padding_attention,mask:mul,additive:True,
        CHECK-SAME: {REGION}[0, 2],
        CHECK: aten.mul.Tensor(
        CHECK-SAME: zeroed:True}}
    """)
    assert [w.split(":")[0] for w in ctx.warnings] == ["guarded-region fill"], ctx.warnings


def test_a_multiply_by_an_additive_mask_does_not_zero_the_padding():
    """``y * ((1.0 - keep.float()) * -1e4)``: the same keep-mask, additive: it scales the
    padding rows by -1e4 and the kept ones by 0. No zeroing multiply: the sum over the
    positions reads the padding, so the history packs only over padding representatives,
    the additive mask (varying by position, computed from the batch) one of the sources
    the layout compares, the sum outside the region."""
    gm, ctx = _padded(False, pool_additive=True)
    (region,) = [n.meta[ir.PACKED_REGION] for n in gm.graph.nodes
                 if ir.PACKED_REGION in n.meta]
    assert (region["pad_rep"], region["rep_layout"]) == (True, "sources")
    assert region["rep_sources"][0] == "x" and len(region["rep_sources"]) == 2
    sums = [n for n in gm.graph.nodes if n.target is torch.ops.aten.sum.default]
    assert sums and not [n for n in sums if ir.PACKED in n.meta]

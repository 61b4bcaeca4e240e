"""match-silu-attention, intent on HSTU's pointwise attention written out by hand over
``[B, H, L, D]``: ``(silu(q @ k^T) / n * key_mask) @ v`` with a boolean ``[B, L]`` keep-mask
and-ed on the query axis is one guarded ``jagged_silu_attention`` group (scores, silu,
normaliser, mask multiply, output matmul), its facts naming the mask, ``n``, no causal. Look-alikes
that compute something else are not matched: ``relu`` in place of ``silu`` (no attention,
no reason), a normaliser per row (``normaliser``), an addend that is no ``[B|1, H|1, L, L]``
bias (``bias-shape``), a causal mask and-ed with a mask on the query axis only (``no-key-padding-mask``),
a scale outside the scores plus their bias (``scaled-bias``: it was matched as
``silu(scale * q k^T + bias)``, the bias unscaled).
A bare key mask (no and, broadcast as ``[B, 1, 1, L]``) is a key mask. A causal mask read
from a buffer or a lifted constant (sliced ``[:L, :L]``) is a candidate the runner checks:
the facts name it, its weight and the whole mask; the same mask given with the batch, or
times a random draw, is not (``mask-factor``).

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
        elif self.form == "scaled_bias":  # the scale outside the bias: the kernel's is inside
            s = (s + torch.ones(L, L)) * 0.5
        act = F.relu(s) if self.form == "relu" else F.silu(s)
        n = keep.sum(1).clamp(min=1)[:, None, None, None] if self.form == "per_row" else L
        if self.form == "queries":  # causal and the query axis only: no key mask
            visible = torch.ones(L, L, dtype=torch.bool).tril()[None] & keep[:, :, None]
        elif self.form == "keys":  # the key axis only, no and
            visible = keep[:, None, :]
        else:  # the key axis and the query axis
            visible = keep[:, None, :] & keep[:, :, None]
        if self.form == "dropped":  # the scores zeroed where the mask is 0
            return torch.where(visible[:, None] == 0, 0.0, act / n)
        if self.form == "not_kept":  # ... or where its negation holds
            return (act / n).masked_fill(~visible[:, None], 0.0)
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
                                         ("queries", "no-key-padding-mask"),
                                         ("scaled_bias", "scaled-bias")])
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


@pytest.mark.parametrize("form", ["dropped", "not_kept"])
def test_scores_zeroed_where_the_mask_drops_them_are_the_same_attention(form: str):
    """``where(m == 0, 0, a)`` and ``a.masked_fill(~m, 0)`` keep ``a`` where ``m`` holds:
    the same guarded kernel as ``a * m``, read by selection (``visible_where``)."""
    gm, ctx = _matched(form)
    check_graph(gm, "CHECK: %matmul_1 = aten.matmul.default(\nCHECK-SAME: kind:jagged_silu_attention")
    assert not _warnings(ctx)


def test_a_bare_key_mask_is_a_key_mask():
    gm, _ = _matched("keys")
    check_graph(gm, "CHECK: %matmul_1 = aten.matmul.default(\nCHECK-SAME: kind:jagged_silu_attention")


class _StoredCausal(_Pointwise):
    """The causal mask a bool ``tril`` buffer larger than ``L``, sliced ``[:L, :L]`` and
    and-ed with the key and query masks (``form="stored"``); or the same ``[L, L]`` mask
    received as data with the batch (``"input"``: its values change per call, so no
    check cached per change of a weight applies), or the buffer times a fresh random draw
    (``"drawn"``); ``"constant"``: a plain tensor attribute (a lifted constant)."""

    def __init__(self, form: str) -> None:
        super().__init__(form)
        causal = torch.ones(L + 2, L + 2, dtype=torch.bool).tril()
        if form == "constant":
            self.causal = causal
        else:
            self.register_buffer("causal", causal)

    def weights(self, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        causal = self.causal[:L, :L]
        if self.form == "input":
            causal = self.given
        elif self.form == "drawn":
            causal = causal & (torch.rand(L, L) < 2.0)
        visible = keep[:, None, :] & keep[:, :, None] & causal[None]
        return F.silu(q @ k.transpose(-1, -2)) / L * visible[:, None].to(q.dtype)

    def forward(self, x: torch.Tensor, keep: torch.Tensor,  # type: ignore[override]
                given: torch.Tensor | None = None) -> torch.Tensor:
        self.given = given
        return super().forward(x, keep)


def _stored(form: str):
    args = (*inputs(), torch.ones(L, L, dtype=torch.bool).tril()) if form == "input" \
        else inputs()
    return graph_of(_StoredCausal(form), args, annotated(MatchSiluAttention()))


@pytest.mark.parametrize("form,weight", [("stored", "b_causal"), ("constant", "c_causal")])
def test_a_causal_mask_in_a_buffer_is_a_candidate_checked_at_run_time(form: str, weight: str):
    """The buffer's (or the lifted constant's) values are not in the graph (captured on
    meta): the attention is the jagged kernel, causal, and its facts name what the runner
    checks (the sliced factor, ``causal_mask``), the weight the check's answer is cached
    by (``causal_mask_of``), and the whole mask with the way it is applied for the exact
    fallback (``visible``, ``visible_where``)."""
    gm, ctx = _stored(form)
    check_graph(gm, f"""
        CHECK: %slice_1 = aten.slice.Tensor(%{weight}, 0, 0, 4) :: bool[4,6]
        CHECK-NEXT: %slice_2 = aten.slice.Tensor(%slice_1, 1, 0, 4) :: bool[4,4]
        CHECK-NOT: group=
        CHECK: %unsqueeze_2 = aten.unsqueeze.default(%slice_2, 0)
        CHECK: %to = aten.to.dtype(%unsqueeze_3, f32)
        CHECK-NOT: group=
        CHECK: %mul = aten.mul.Tensor(%div, %to)
        CHECK-SAME: group=jagged_silu_attention_0
        CHECK-NEXT: %matmul_1 = aten.matmul.default(%mul, %getitem_2)
        CHECK-SAME: kind:jagged_silu_attention,
        CHECK-SAME: mask:keep,
        CHECK-SAME: causal:True,causal_mask:unsqueeze_2,causal_mask_of:['{weight}'],
        CHECK-SAME: visible:to,visible_where:False,query_mask:True,
    """)
    assert not _warnings(ctx)


@pytest.mark.parametrize("form", ["input", "drawn"])
def test_a_square_mask_of_data_or_a_draw_is_no_candidate(form: str):
    """Only a mask computed from the model's weights alone is checked once per change of
    them: the same ``[L, L]`` mask given with the batch, or a weight times a random draw,
    stays the padded formula (``mask-factor``)."""
    gm, ctx = _stored(form)
    assert not [n for n in gm.graph.nodes if ir.KERNEL in n.meta]
    assert _warnings(ctx) == ["match-silu-attention: matmul_1 stays the padded formula "
                              "(mask-factor)"]


def test_fbgemm_padding_is_a_zero_padded_source_only_with_zeros():
    """``fbgemm.jagged_to_padded_dense`` pads with ``padding_value``: only 0 makes the
    padded keys contribute nothing (``jagged_patterns.zero_padded_source``)."""
    import fbgemm_gpu  # noqa: F401
    from gemc.passes.jagged_patterns import padded_values, zero_padded_source

    class Pad(torch.nn.Module):
        def forward(self, values, offsets):
            zero = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [4], 0.0)
            one = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [4], 1.0)
            return zero.view(2, 4, 2, 3), one

    ep = torch.export.export(Pad(), (torch.randn(5, 6), torch.tensor([0, 2, 5])))
    nodes = {n.name: n for n in ep.graph.nodes}
    view = next(n for n in ep.graph.nodes if n.op == "call_function" and "view" in n.name)
    source, offsets = zero_padded_source(view)
    assert offsets is nodes["offsets"] and padded_values(source) is nodes["values"]
    pads = [n for n in ep.graph.nodes if n.op == "call_function"
            and "jagged_to_padded_dense" in str(n.target)]
    assert len(pads) == 2 and zero_padded_source(pads[1]) is None

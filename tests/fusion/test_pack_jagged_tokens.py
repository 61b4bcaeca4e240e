"""pack-jagged-tokens: golden dump, which nodes join the region and which do not, the
layout helpers, and the graph run packed against eager (forward and backward, empty and
full histories)."""

from __future__ import annotations

import functools

import pytest
import torch
from gemc.backends.triton import packed_tokens as packed
from gemc.passes.pack_jagged_tokens import PACKED
from hypothesis import HealthCheck, given, settings

from tests.conftest import check_golden
from tests.fusion import models
from tests.fusion.helpers import compiled, dump_after, entries_of, fresh_seed, run_against_eager

JAGGED = "tests/fusion/models.py:build_jagged"


def test_pack_jagged_tokens_golden_dump():
    check_golden("pack_jagged_tokens.txt", dump_after(JAGGED, "pack-jagged-tokens"))


@functools.cache
def _graph():
    gm, ctx, spec = compiled(JAGGED)
    return gm, entries_of(gm, ctx), spec


def test_region_spans_the_block_and_stops_at_masks():
    gm, entries, _ = _graph()
    region = next(e for e in entries if e["kind"] == "packed_tokens")
    by_name = {n.name: n for n in gm.graph.nodes}
    inside = {by_name[n] for n in region["nodes"]}
    targets = {n.target for n in inside}
    aten = torch.ops.aten
    # the whole pre-LN block: norms, the qkv/out/MLP GEMMs, GELU, residuals, attention
    assert {aten.index_put.default, aten.layer_norm.default, aten.linear.default,
            aten.gelu.default, aten.scaled_dot_product_attention.default} <= targets
    # the pooling multiply is in (its padding rows are zero); the sum over positions and the
    # cross-attention (dense query, padded keys) are not
    assert [by_name[n].target for n in region["zeroed"]] == [aten.mul.Tensor]
    for n in gm.graph.nodes:
        if n.target in (aten.sum.dim_IntList, aten.mean.dim) or (
                n.target is aten.scaled_dot_product_attention.default and n.args[0].op
                == "call_function" and n.args[0].target is aten.transpose.int):
            assert n not in inside, n.name
    attn = next(n for n in inside if n.target is aten.scaled_dot_product_attention.default)
    assert region["dims"][attn.name] == [0, 2]  # [B, H, L, D]
    assert region["clamp_min"] == 1 and region["max_len"] == models.L
    assert 0 < region["predicted"]["after_ms"] < region["predicted"]["before_ms"]


def test_padding_read_unmasked_leaves_the_graph_padded():
    """An unmasked mean over all positions reads padding rows: no region, and a warning that
    names the reader (jagged attention is refused for the same reason)."""
    gm, ctx, _ = compiled(JAGGED, {"leak": True})
    assert not [n for n in gm.graph.nodes if PACKED in n.meta]
    assert not [e for e in entries_of(gm, ctx) if e["kind"] == "packed_tokens"]


@pytest.mark.parametrize("bounded", [False, True])
def test_gather_and_scatter_round_trip_with_gradients(bounded: bool):
    """Exact, or with spare slots (room for 13 tokens, 10 real): spare slots never land in
    the padded tensor and take no gradient."""
    lengths = torch.tensor([3, 0, 5, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    layout = packed.TokenLayout.bounded(offsets, 1, 6, 9) if bounded else \
        packed.TokenLayout.of(offsets, 1, 6)
    assert layout.total == (9 + 4 if bounded else 3 + 1 + 5 + 1)  # empty history: slot 0
    x = torch.randn(2, 4, 6, 3, requires_grad=True)  # [H, B, L, D]: batch dim 1, seq dim 2
    p = packed.gather(x, (1, 2), 4, layout)
    assert p.shape == (2, 1, layout.total, 3)
    back = packed.scatter(p, (1, 2), layout)
    live = torch.arange(6)[None, :] < lengths.clamp(min=1)[:, None]  # [B, L]
    torch.testing.assert_close(back, torch.where(live[None, :, :, None], x, 0.0))
    back.sum().backward()
    torch.testing.assert_close(x.grad, live[None, :, :, None].expand_as(x).float())
    per_row = torch.randn(4, 1, 3)  # a [B, 1, D] operand: gathered by row
    rows = packed.gather(per_row, (0, 1), 3, layout)
    torch.testing.assert_close(rows[0], per_row[layout.index("row"), 0])
    per_pos = torch.randn(6, 3)  # an [L, D] operand, right-aligned: gathered by position
    torch.testing.assert_close(packed.gather(per_pos, (0, 1), 3, layout)[0],
                               per_pos[layout.index("pos")])
    assert packed.gather(torch.randn(3), (0, 1), 3, layout).shape == (3,)  # per column: as is


def _check(lengths: list[int]) -> None:
    gm, entries, spec = _graph()
    batch = models.jagged_batch(lengths, torch.Generator().manual_seed(fresh_seed()))
    runner = run_against_eager(gm, entries, spec.model, batch)
    tokens = sum(lengths) + len(lengths)  # room for every token without reading the data
    runs = [u["packed_runs"] for u in runner.units if "packed_runs" in u]
    assert runs and all(list(r) == [tokens] for r in runs)  # every group ran packed


def test_packed_region_matches_eager():
    _check([3, 0, 8, 1])


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(models.captured_lengths())
def test_any_lengths_with_the_captured_total_match_eager(lengths: list[int]):
    _check(lengths)


def test_segment_sum_is_the_padded_sum_of_a_masked_value():
    lengths = torch.tensor([2, 0, 4])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    layout = packed.TokenLayout.bounded(offsets, 1, 5, 6)  # 3 spare slots
    x = torch.randn(1, layout.total, 7, dtype=torch.bfloat16, requires_grad=True)
    got = packed.segment_sum(x, (0, 1), layout)
    x2 = x.detach().clone().requires_grad_()
    want = packed.scatter(x2, (0, 1), layout).sum(dim=1)
    torch.testing.assert_close(got, want)
    got.float().square().sum().backward()
    want.float().square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    y = torch.randn(3, 1, layout.total)  # batch dim after the reduced one: [D, B, L]
    torch.testing.assert_close(packed.segment_sum(y, (1, 2), layout),
                               packed.scatter(y, (1, 2), layout).sum(dim=2))


def test_region_alone_runs_unknown_ops_padded():
    """Without the attention kernel the region's SDPA has no packed rule: it runs padded
    (inputs scattered, output gathered back), every other node packed; same loss and
    gradients. (Also: the offsets stay alive for the layout with no attention reading them.)"""
    gm, entries, spec = _graph()
    region = [e for e in entries if e["kind"] == "packed_tokens"]
    batch = models.jagged_batch([2, 0, 8, 2], torch.Generator().manual_seed(fresh_seed()))
    runner = run_against_eager(gm, region, spec.model, batch)
    assert runner.packed and not runner.units


def test_per_row_gather_adds_token_gradients_in_fp32():
    """A [B, 1, d] bf16 operand gathered to 300 tokens a row: its gradient is the fp32 sum
    of the tokens' gradients, rounded once (bf16 atomics would round at every add)."""
    lengths = torch.tensor([300, 0, 299])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    layout = packed.TokenLayout.bounded(offsets, 1, 300, 599)
    x = torch.randn(3, 1, 16, dtype=torch.bfloat16, requires_grad=True)
    y = packed.gather(x, (0, 1), 3, layout)
    live = layout.index("row_out") < 3  # spare slots carry no gradient in a model
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(fresh_seed()))
    g = (g * live[None, :, None]).to(torch.bfloat16)
    y.backward(g)
    want = torch.zeros(3, 16, dtype=torch.float64).index_add_(
        0, layout.index("row"), g[0].double())[:, None, :]
    # one rounding to bf16 (half an ulp, 2^-9 relative) of a sum of ~17 in magnitude
    torch.testing.assert_close(x.grad.double(), want, rtol=2.0**-8, atol=1e-3)

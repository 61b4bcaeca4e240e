"""A packed region's node is priced at the size it runs at: on the tokens when the runners
have a packed rule for it, padded otherwise (gemc.packed_rules). Issue 18: MMoE's causal
self-attention, which no gemc kernel takes, ran padded inside its region while it was
priced packed (part of the plan's 2.2 GB under its H200 peak)."""

from __future__ import annotations

import torch
from gemc.backends.triton import packed_tokens
from gemc.cost_model.activations import packed_fill
from torch import fx

from gemc import ir, packed_rules

aten = torch.ops.aten


def _region_graph() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """x -> linear -> (sdpa, no kernel) -> view -> add, all in one region at fill 0.25."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    lin = g.call_function(aten.linear.default, (x, w))
    att = g.call_function(aten.scaled_dot_product_attention.default, (lin, lin, lin))
    view = g.call_function(aten.view.default, (att, [4, 8, 16]))
    add = g.call_function(aten.add.Tensor, (view, view))
    g.output(add)
    gm = fx.GraphModule(torch.nn.Module(), g)
    x.meta[ir.PACKED_REGION] = {"id": "packed_tokens_0", "fill": 0.25}
    for n in (x, lin, att, view, add):
        n.meta[ir.PACKED] = {"id": "packed_tokens_0", "dims": [0, 1]}
    return gm, {n.name: n for n in g.nodes}


def test_a_node_without_a_packed_rule_is_priced_padded_the_rest_at_the_fill() -> None:
    gm, n = _region_graph()
    fill = packed_fill(gm)
    sdpa = n["scaled_dot_product_attention_default"]
    assert fill[sdpa] == 1.0  # runs on the padded tensor, gathered back
    assert fill[n["linear_default"]] == fill[n["add_tensor"]] == 0.25
    assert fill[n["view_default"]] == 0.25  # per token: its input is the region's (gathered)
    assert fill[n["x"]] == 0.25  # the region's source makes the tokens
    # the same attention taken by a gemc kernel runs on the tokens
    sdpa.meta[ir.GROUP] = "jagged_attention_0"
    assert packed_fill(gm)[sdpa] == 0.25


def test_the_runners_read_the_rules_the_cost_model_reads() -> None:
    assert packed_tokens.FIRST_ONLY is packed_rules.FIRST_ONLY
    assert packed_tokens.SIZED is packed_rules.SIZED
    assert packed_tokens.is_pointwise is packed_rules.is_pointwise
    gm, n = _region_graph()
    members = set(n.values())
    outside = {n["x"], n["w"]}
    assert not packed_rules.runs_packed(n["scaled_dot_product_attention_default"], members)
    assert packed_rules.runs_packed(n["linear_default"], members)
    assert not packed_rules.runs_packed(n["linear_default"], outside - {n["x"]})


def _typed(gm: fx.GraphModule, n: dict[str, fx.Node]) -> None:
    """Shapes, dtypes and kinds: x [4, 8, 16] fp32 -> linear [4, 8, 16] -> sdpa -> add."""
    from gemc.ir import OpKind

    kinds = {"x": OpKind.INPUT, "w": OpKind.PARAM, "linear_default": OpKind.GEMM,
             "scaled_dot_product_attention_default": OpKind.ATTENTION,
             "view_default": OpKind.VIEW, "add_tensor": OpKind.POINTWISE}
    shapes = {"w": (16, 16), "view_default": (4, 8, 16)}
    for name, kind in kinds.items():
        n[name].meta[ir.KIND] = kind.value
        n[name].meta["val"] = torch.empty(shapes.get(name, (4, 8, 16)), device="meta")
    n["w"].meta[ir.PARAM] = "w"


def test_a_padded_op_in_a_region_saves_padded_copies_of_its_packed_inputs() -> None:
    """The runners scatter a padded op's packed inputs to padded tensors, which it saves:
    counted at the padded size, where its packed inputs themselves are at the fill."""
    from gemc.cost_model.activations import activation_profile

    gm, n = _region_graph()
    _typed(gm, n)
    sdpa = n["scaled_dot_product_attention_default"]
    padded_bytes = 4 * 8 * 16 * 4  # one fp32 [4, 8, 16] tensor, every row
    # padded: the scattered copy of its input (q, k and v are one tensor here) and its
    # output, both at the padded size; the linear's packed output is not what it keeps
    assert activation_profile(gm).saved_total == 2 * padded_bytes
    sdpa.meta[ir.GROUP] = "jagged_attention_0"  # a gemc kernel: runs on the tokens
    assert activation_profile(gm).saved_total < padded_bytes

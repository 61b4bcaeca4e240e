"""Cutting node sets out of the tiny GEM graph: the subgraph, fed the values that flow into
the set in a real eager run, must return the values that flow out of it there."""

from __future__ import annotations

import operator
import random

import pytest
import torch
from gemc.backends.mlir.extract import extract_subgraph
from gemc.backends.mlir.refcheck import run_eager

from tests.mlir.tiny import tiny


def _check(names: list[str] | None = None, nodes: list | None = None) -> None:
    t = tiny()
    sub = extract_subgraph(t.gm, nodes if nodes is not None else t.nodes(*names))
    got = run_eager(sub.gm, [t.values[n.name] for n in sub.inputs])
    assert len(got) == len(sub.outputs)
    for out, value in zip(sub.outputs, got):
        torch.testing.assert_close(value, t.values[out.name], rtol=0, atol=0, msg=out.name)


def test_linear_gelu_layernorm_chain():
    t = tiny()
    sub = extract_subgraph(t.gm, t.nodes("flatten", "layer_norm", "linear_3", "gelu_1", "linear_4"))
    assert [n.name for n in sub.inputs] == [
        "bmm",
        "p_wukong_0_fm_norm_weight",
        "p_wukong_0_fm_norm_bias",
        "p_wukong_0_fm_mlp_0_weight",
        "p_wukong_0_fm_mlp_0_bias",
        "p_wukong_0_fm_mlp_2_weight",
        "p_wukong_0_fm_mlp_2_bias",
    ]
    assert [n.name for n in sub.outputs] == ["linear_4"]
    _check(["flatten", "layer_norm", "linear_3", "gelu_1", "linear_4"])


def test_value_used_inside_and_outside_is_an_output():
    # linear is read by gelu (inside) only; gelu by linear_1 (outside): gelu flows out.
    t = tiny()
    sub = extract_subgraph(t.gm, t.nodes("linear", "gelu"))
    assert [n.name for n in sub.outputs] == ["gelu"]
    # layer_norm_1 feeds the next Wukong layer and a residual: one output, read twice outside.
    sub = extract_subgraph(t.gm, t.nodes("add_3", "layer_norm_1"))
    assert [n.name for n in sub.outputs] == ["layer_norm_1"]


def test_multi_result_op_returns_the_getitems_read_outside():
    t = tiny()
    sub = extract_subgraph(t.gm, t.nodes("unbind"))
    assert [n.name for n in sub.outputs] == ["getitem_32", "getitem_33", "getitem_34"]
    _check(nodes=t.nodes("unbind"))
    _check(["embedding_bag", "getitem"])


def test_getitem_of_a_tuple_made_outside_becomes_an_input():
    t = tiny()
    sub = extract_subgraph(t.gm, t.nodes("getitem", "getitem_16", "stack"))
    assert [n.name for n in sub.inputs] == ["getitem", "getitem_16"]
    assert [n.name for n in sub.nodes] == ["stack"]


def test_whole_graph_round_trips():
    t = tiny()
    _check(nodes=[n for n in t.gm.graph.nodes if n.op == "call_function"])


@pytest.mark.parametrize("seed", range(6))
def test_random_node_sets(seed):
    """Any set: windows of consecutive ops and scattered samples, multi-result ops included."""
    t = tiny()
    ops = [n for n in t.gm.graph.nodes if n.op == "call_function"]
    rng = random.Random(seed)
    if seed % 2:
        start = rng.randrange(len(ops) - 30)
        chosen = ops[start : start + rng.randrange(2, 30)]
    else:
        chosen = rng.sample(ops, rng.randrange(1, 40))
    if all(n.target is operator.getitem for n in chosen):
        chosen.append(ops[-1])
    _check(nodes=chosen)


def test_rejects_sets_without_computation_and_foreign_nodes():
    t = tiny()
    with pytest.raises(ValueError, match="no computing node"):
        extract_subgraph(t.gm, [n for n in t.gm.graph.nodes if n.op == "placeholder"][:3])
    other = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not in this graph"):
        extract_subgraph(t.gm, [n for n in other.graph.nodes if n.op != "output"])

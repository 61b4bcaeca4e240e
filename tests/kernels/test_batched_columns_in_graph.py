"""A ``cat`` or ``stack`` of a batched lookup's table outputs reads them as one view of the
lookup's output in the compiled graph (issue 16's first step: DLRM's
``cat([bottom, *pooled], 1)`` made Inductor write a copy kernel per table in the forward
and, for the split's gradient, another per table in the backward, each autotuned on the
H200's first step; 26 tables there), the lookup's tables laid out in the order the graph
joins them (GEM stacks its tables by dim, not in table order).

Checked through AOTAutograd on DLRM tiny (``cat``), Wukong tiny (``stack``) and GEM tiny
(stacks by dim): the forward joins no table at a time, the backward has no ``cat`` of
their gradients, and loss, dense gradients and the tables the fused optimizer moved equal
eager's."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from gemc.backends.triton.embedding_bag_reference import rowwise_adagrad_step_
from gemc.backends.triton.inductor_graph import (
    Column,
    build,
    in_join_order,
    merge_columns,
    runner_for,
)
from torch import fx
from torch._dynamo.backends.common import aot_autograd

from tests.fusion.helpers import compiled, eager_step, entries_of, params_of

DLRM = "examples/dlrm/model.py:build"
WUKONG = "examples/zoo/wukong.py:build"
GEM = "examples/gem/model.py:build"
GEM_ARGS = {"preset": "tiny", "batch_size": 4}  # a small batch: the kernels interpreted
# DLRM tiny's B=32 too: its fused update runs interpreted, one program per looked-up id
# (6.9 s of the test at 32); the cat of its 8 pooled tables is the same at any batch
ARGS = {DLRM: {"preset": "tiny", "batch_size": 8}, WUKONG: {"preset": "tiny"}}


def test_merge_columns_joins_adjacent_runs_of_one_output_in_order() -> None:
    g = fx.Graph()
    a, b, x = g.placeholder("a"), g.placeholder("b"), g.placeholder("x")
    cols = [g.placeholder(f"c{i}") for i in range(5)]
    columns = {c: Column(a, 4 * i, 4, 16) for i, c in enumerate(cols[:4])}
    columns[cols[4]] = Column(b, 0, 4, 8)
    # a run of a's columns 0..2, then x, then a's column 3 alone, then b's: three runs
    out = merge_columns([cols[0], cols[1], cols[2], x, cols[3], cols[4]], columns)
    assert out == [Column(a, 0, 12, 16), x, cols[3], cols[4]]
    # out of column order: nothing joins
    assert merge_columns([cols[1], cols[0]], columns) == [cols[1], cols[0]]
    # every column of a, in order: the whole output
    assert merge_columns(cols[:4], columns) == [Column(a, 0, 16, 16)]


def _ops(gm: fx.GraphModule, *targets: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _train_once(entry: str, args: dict[str, object]):  # noqa: ANN202
    """One step of ``entry``'s rewritten graph (its batched lookup's tables in join order)
    through AOTAutograd, loss, dense gradients and the fused update checked against eager;
    returns the emitted module and the forward and backward graphs."""
    gm, ctx, spec = compiled(entry, args)
    entries = [in_join_order(gm, e) for e in entries_of(gm, ctx)]
    emb = next(e for e in entries if e["kind"] == "batched_embedding_bag")
    assert len(emb["tables"]) == 8
    model = spec.model
    batch = spec.make_batch(3, "cpu")
    ref, grads = eager_step(model, batch)
    runner, _ = runner_for(gm, entries, params_of(model))
    graphs: dict[str, fx.GraphModule] = {}

    def keep(name: str):  # noqa: ANN202
        def compiler(g: fx.GraphModule, _inputs: object):  # noqa: ANN202
            graphs[name] = g
            return make_boxed_func(g)
        return compiler

    module = build(runner).module
    fn = torch.compile(module, dynamic=False,
                       backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    loss = fn(*batch)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    tables = {t["fqn"] for t in emb["tables"]}
    opt = emb["optimizer"]
    assert opt["weight_decay"] == 0  # then a row the batch did not move stays: rows from grads
    for k, p in model.named_parameters():
        if k not in tables:
            torch.testing.assert_close(p.grad, grads[k], atol=2e-5, rtol=1e-4, msg=k)
            continue
        weight = p.detach().clone()
        rows = grads[k].abs().sum(1).nonzero().flatten()
        assert rows.numel()
        rowwise_adagrad_step_(weight, grads[k], torch.zeros(weight.shape[0]), rows, opt["lr"],
                              opt["eps"], 0.0)
        torch.testing.assert_close(runner.table_weights(k), weight, atol=1e-6, rtol=1e-5,
                                   msg=k)
    return module, graphs


@pytest.mark.parametrize("entry", [DLRM, WUKONG])
def test_pooled_tables_concatenated_or_stacked_are_one_view_forward_and_backward(entry):
    """DLRM concatenates its 8 pooled tables after the bottom MLP's output, Wukong stacks its
    8 into ``[B, 8, d]``: each reads one view of the lookup's output, so neither graph
    copies a table at a time (no cat or stack of more than two operands in the forward, no
    cat at all in the backward), and training is eager's."""
    _, graphs = _train_once(entry, ARGS[entry])
    joins = _ops(graphs["fw"], torch.ops.aten.cat.default, torch.ops.aten.stack.default)
    assert joins and all(len(n.args[0]) <= 2 for n in joins), [n.args for n in joins]
    assert not _ops(graphs["bw"], torch.ops.aten.cat.default), graphs["bw"].code


def test_gem_tables_stacked_by_dim_lie_in_join_order() -> None:
    """GEM stacks its tables by dim (tiny: dims 8, 16, 16, 32 cycled over 8 tables, so each
    group's tables are not adjacent in the plan's order): in join order every group is one
    run of columns, the rewritten graph stacks no table, and training is eager's."""
    gm, ctx, _ = compiled(GEM, GEM_ARGS)
    emb = next(e for e in entries_of(gm, ctx) if e["kind"] == "batched_embedding_bag")
    ordered = [t["output"] for t in in_join_order(gm, emb)["tables"]]
    assert ordered != [t["output"] for t in emb["tables"]]
    stacks = _ops(gm, torch.ops.aten.stack.default)
    assert stacks
    for stack in stacks:
        names = [a.name for a in stack.args[0]]
        first = ordered.index(names[0])
        assert ordered[first:first + len(names)] == names
    module, _ = _train_once(GEM, GEM_ARGS)
    assert not _ops(module, torch.ops.aten.stack.default), module.code

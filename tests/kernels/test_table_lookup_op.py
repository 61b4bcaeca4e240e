"""``gemc::table_lookup``: a one-rank table's lookup (sparse gradient, sparse optimizer)
as an op the compiled graph traces, so it is no eager island. Forward and the table's
gradient (made by the table module from the op's backward, before the optimizer reads it)
equal eager's for every lookup form the sharded table answers: an embedding with a padding
row, a bag with per-sample weights that take a gradient, a 2-D bag, a bf16-stored table
(to its rounding); compiled with no graph break."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemc.backends.torch.embedding import shard_tables
from gemc.backends.triton.ops import register_lookup
from torch import nn
from torch._dynamo.utils import counters

from gemc.sharding import make_shards

ROWS, DIM = 12, 4


def _table(module: nn.Module, precision: str = "fp32"):  # noqa: ANN202
    holder = nn.Module()
    holder.t = module
    spec = {"fqn": "t.weight", "rows": ROWS, "dim": DIM, "sharding": "table_wise",
            "shards": make_shards("table_wise", [0], ROWS, DIM), "precision": precision}
    table = shard_tables(holder, [spec], rank=0, world_size=1, seed=0)["t.weight"]
    holder.to_empty(device="cpu")
    table.reset_parameters()
    register_lookup("t.weight", table)
    return table


def _table_grad(table) -> torch.Tensor:  # noqa: ANN001
    if table.precision == "fp32":
        return table.weight.grad.to_dense()
    rows, grads = table.take_row_grads()
    return torch.zeros(ROWS, DIM).index_add_(0, rows, grads)


CASES = {
    "embedding_padding_idx": (lambda: nn.Embedding(ROWS, DIM, padding_idx=0), "fp32"),
    "bag_weighted": (lambda: nn.EmbeddingBag(ROWS, DIM, mode="sum"), "fp32"),
    "bag_2d_mean": (lambda: nn.EmbeddingBag(ROWS, DIM, mode="mean"), "fp32"),
    "embedding_bf16": (lambda: nn.Embedding(ROWS, DIM), "bf16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("compiled", [False, True])
def test_table_lookup_matches_eager_forward_and_gradients(case: str, compiled: bool) -> None:
    make, precision = CASES[case]
    table = _table(make(), precision)
    g = torch.Generator().manual_seed(hash(case) % 1000)
    anchor = torch.zeros((), requires_grad=True)
    psw = None
    if case == "bag_weighted":
        ids = torch.randint(0, ROWS, (9,), generator=g)
        offsets = torch.tensor([0, 2, 2, 5])  # an empty bag
        psw = torch.rand(9, generator=g).requires_grad_()
    elif case == "bag_2d_mean":
        ids, offsets = torch.randint(0, ROWS, (3, 5), generator=g), None
    else:
        ids, offsets = torch.randint(0, ROWS, (3, 5), generator=g), None
        ids[0, :2] = 0  # the padding row, where the table has one

    def f(ids, offsets, psw):  # noqa: ANN001, ANN202
        out = torch.ops.gemc.table_lookup("t.weight", ids, offsets, psw, anchor)
        return (out * out).sum() + out.sum()

    counters.clear()
    torch._dynamo.reset()
    fn = torch.compile(f, backend="aot_eager", fullgraph=True) if compiled else f
    loss = fn(ids, offsets, psw)
    loss.backward()
    table.replay_deferred()
    assert sum(counters["graph_break"].values()) == 0

    from gemc.backends.torch.table_storage import StoredRows

    stored = table.weight.data
    dense = stored if precision == "fp32" else StoredRows(
        stored, precision, table.row_scale).read(torch.arange(ROWS))
    weight = dense.detach().float().clone().requires_grad_()
    ref_psw = None if psw is None else psw.detach().clone().requires_grad_()
    if table.is_bag:
        out = F.embedding_bag(ids, weight, offsets, mode=table.mode,
                              per_sample_weights=ref_psw)
    else:
        out = F.embedding(ids, weight, table.padding_idx)
    want = (out * out).sum() + out.sum()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(_table_grad(table), weight.grad)
    if psw is not None:
        torch.testing.assert_close(psw.grad, ref_psw.grad)
    assert anchor.grad is not None and float(anchor.grad) == 0.0


def test_a_deferred_gradient_is_dropped_by_zero_grad() -> None:
    """A step whose optimizer did not run (zero_grad first) leaves no gradient behind for
    the next one to apply twice."""
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer

    table = _table(nn.Embedding(ROWS, DIM))
    out = torch.ops.gemc.table_lookup("t.weight", torch.tensor([1, 2]), None, None,
                                      torch.zeros((), requires_grad=True))
    out.sum().backward()
    assert len(table.deferred) == 1
    opt = EmbeddingOptimizer({"t.weight": table}, EmbeddingOptimConfig(), world_size=1)
    opt.zero_grad()
    assert table.deferred == []
    before = table.weight.detach().clone()
    opt.step()
    torch.testing.assert_close(table.weight.detach(), before)

"""The owners' fused lookup on several ranks (issue 21) against the single-process reference.

Two gloo processes each train sharded tables (:class:`ShardedEmbedding`, the runner's own
exchange) for a few steps on fresh random ids, with the owners' lookup in the batched
kernel (:mod:`gemc.backends.torch.owner_lookup`, Triton interpreted); every step's pooled
outputs, then the shards' weights and optimizer state, must equal one process training the
whole table on both ranks' batches (the reference's reading: ``coalesced_rows`` and the row
update of the mean over ranks' losses). Cases: table-wise, row-wise, table-row-wise,
column-wise under Adam and under row-wise Adagrad (two phases), per-sample weights, mean pooling, a padding row, ``nn.Embedding``
(bags of one id), two tables of different bag counts in one exchange (two launches), and
bf16 storage (against the sparse route at bf16: the two round stochastically from their
own streams, so they agree to bf16's rounding). The whole runner's agreement (plans,
checkpoints, graph mode) is tests/runner/test_distributed.py's, whose plans now run these
shards fused.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.runner.harness import free_port, gloo_process, start_ranks

ROWS, DIM, PAD, B, STEPS, WORLD = 30, 8, 3, 4, 3, 2

# name: (sharding, ranks, kind, optimizer, precision, weighted)
CASES: dict[str, tuple[str, list[int], str, str, str, bool]] = {
    "table_wise": ("table_wise", [1], "sum", "rowwise_adagrad", "fp32", False),
    "row_wise_mean_padding": ("row_wise", [0, 1], "mean", "rowwise_adagrad", "fp32", False),
    "table_row_wise_weighted": ("table_row_wise", [0, 1], "sum", "adam", "fp32", True),
    "column_wise_adam": ("column_wise", [0, 1], "sum", "adam", "fp32", False),
    # the row's squares summed over both column shards before the update (two phases)
    "column_wise_adagrad": ("column_wise", [1, 0], "mean", "rowwise_adagrad", "fp32", False),
    "embedding": ("row_wise", [1, 0], "embedding", "adam", "fp32", False),
    "bf16": ("row_wise", [0, 1], "sum", "rowwise_adagrad", "bf16", False),
}


def _plan_table(fqn: str, sharding: str, ranks: list[int], precision: str) -> dict[str, Any]:
    from gemc.sharding import make_shards

    return {"fqn": fqn, "rows": ROWS, "dim": DIM, "sharding": sharding,
            "shards": make_shards(sharding, ranks, ROWS, DIM), "precision": precision}


def _source(kind: str):  # noqa: ANN202
    from torch import nn

    padding = PAD if kind == "mean" else None
    if kind == "embedding":
        return nn.Embedding(ROWS, DIM)
    return nn.EmbeddingBag(ROWS, DIM, mode=kind, padding_idx=padding)


def _batch(case: str, step: int, rank: int, kind: str, weighted: bool):  # noqa: ANN202
    """(ids, offsets or None, per-sample weights or None, output gradient) of one rank."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{step}/{rank}".encode()))
    if kind == "embedding":
        ids = torch.randint(0, ROWS, (B, 2), generator=g)
        return ids, None, None, torch.randn(B, 2, DIM, generator=g)
    n = 10
    ids = torch.randint(0, ROWS, (n,), generator=g)
    if kind == "mean":
        ids[:3] = PAD  # padding ids, a bag of padding only
    offsets = torch.tensor([0, 3, 3, 7])  # an empty bag
    weights = torch.rand(n, generator=g) if weighted else None
    return ids, offsets, weights, torch.randn(B, DIM, generator=g)


def _train(case: str, rank: int, fused: bool, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from gemc.backends.torch.embedding import ShardedEmbedding
    from gemc.backends.torch.embedding_exchange import exchange_lookups
    from gemc.backends.torch.owner_lookup import OwnerLookup, fused_owner_tables
    from gemc.backends.torch.sparse_optim import (
        EmbeddingOptimConfig,
        EmbeddingOptimizer,
        RowState,
        coalesced_rows,
    )

    sharding, ranks, kind, optimizer, precision, weighted = CASES[case]
    cfg = EmbeddingOptimConfig(kind=optimizer, lr=0.05)
    entry = _plan_table("t.weight", sharding, ranks, precision)
    table = ShardedEmbedding(_source(kind), entry, rank=rank, world_size=WORLD, seed=7)
    table.to_empty(device="cpu")
    table.reset_parameters()
    # a second table (nn.Embedding: 8 bags a rank against 4) in the same exchange
    other = ShardedEmbedding(_source("embedding"), {**_plan_table(
        "u.weight", "table_wise", [0], "fp32")}, rank=rank, world_size=WORLD, seed=7)
    other.to_empty(device="cpu")
    other.reset_parameters()
    tables = {"t.weight": table, "u.weight": other}
    groups = {"t.weight": dist.group.WORLD} if sharding == "column_wise" else {}
    opt = EmbeddingOptimizer(tables, cfg, world_size=WORLD, column_groups=groups)
    owned = fused_owner_tables(tables, [entry, {"fqn": "u.weight", "sharding": "table_wise"}],
                               world_size=WORLD, optimizer=optimizer)
    assert owned == [f for f in ("t.weight", "u.weight") if tables[f].local is not None]
    if fused and owned:
        OwnerLookup(tables, owned, opt, world_size=WORLD, seed=7)
    # the reference: the whole tables on one process, both ranks' batches
    whole = {}
    for fqn, src in (("t.weight", table), ("u.weight", other)):
        ref = ShardedEmbedding(_source(kind if fqn == "t.weight" else "embedding"),
                               _plan_table(fqn, "table_wise", [0], "fp32"), rank=0,
                               world_size=1, seed=7)
        ref.to_empty(device="cpu")
        ref.reset_parameters()
        whole[fqn] = (ref.weight.detach().clone().requires_grad_(), src)
    states = {f: RowState(w.data, optimizer) for f, (w, _) in whole.items()}
    outputs = []
    for step in range(STEPS):
        got = []
        for r in range(WORLD):
            ids, offsets, weights, grad = _batch(case, step, r, kind, weighted)
            g = torch.Generator().manual_seed(step * 10 + r)
            seq = torch.randint(0, ROWS, (B, 2), generator=g)
            seq_grad = torch.randn(B, 2, DIM, generator=g)
            if r == rank:  # this rank's exchange: both tables at once, one backward
                bags = [table.routed_bags(*table.as_bags(ids, offsets, weights)[:3]),
                        other.routed_bags(*other.as_bags(seq, None, None)[:3])]
                outs = exchange_lookups([table, other], bags, world=WORLD)
                mine = outs[0].view(table.as_bags(ids, offsets, weights)[3])
                ((mine * grad).sum() + (outs[1].view(B, 2, DIM) * seq_grad).sum()).backward()
                got.append(mine.detach())
            # the reference's lookups of rank r's batch, loss scaled by 1 / world
            w = whole["t.weight"][0]
            if kind == "embedding":
                ref_out = torch.nn.functional.embedding(ids, w, sparse=True)
            else:
                ref_out = torch.nn.functional.embedding_bag(
                    ids, w, offsets, mode=kind, sparse=True, per_sample_weights=weights,
                    padding_idx=PAD if kind == "mean" else None)
            (ref_out * grad).sum().div(WORLD).backward()
            u = torch.nn.functional.embedding(seq, whole["u.weight"][0], sparse=True)
            (u * seq_grad).sum().div(WORLD).backward()
            if r == rank:
                outputs.append((got[-1], ref_out.detach()))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for f, (w, _) in whole.items():
                rows, g = coalesced_rows(w.grad)
                states[f].apply(w.data, rows, g, cfg, step + 1, DIM)
                w.grad = None
    result = {"outputs_equal": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                   for a, b in outputs)}
    for fqn, (w, m) in whole.items():
        if m.local is None:
            continue
        s = m.local
        region = (slice(s.row_offset, s.row_offset + s.rows),
                  slice(s.col_offset, s.col_offset + s.cols))
        shard = m.stored_rows(0).read(torch.arange(s.rows))
        result[fqn] = {
            "weight_err": float((shard - w.data[region]).abs().max()),
            "weight": shard.tolist(),
            "state_err": {k: float((v - (states[fqn].tensors[k][region[0]] if k == "sum"
                                         else states[fqn].tensors[k][region])).abs().max())
                          for k, v in opt.state[fqn].tensors.items()},
            "fused": fqn in opt.fused,
        }
    out[f"{case}/{'fused' if fused else 'sparse'}/{rank}"] = result


def _worker(rank: int, port: int, path: str) -> None:
    with gloo_process(rank, WORLD, port):
        out: dict[str, Any] = {}
        try:
            for case in CASES:
                for fused in (True, False):
                    _train(case, rank, fused, out)
        finally:
            Path(f"{path}.{rank}").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = str(tmp_path_factory.mktemp("fused_owner") / "out.json")
    start_ranks(_worker, (free_port(), path), WORLD)
    out: dict[str, Any] = {}
    for r in range(WORLD):
        out.update(json.loads(Path(f"{path}.{r}").read_text()))
    return out


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4] == "fp32"])
def test_fused_owner_lookup_equals_the_reference(results, case: str) -> None:
    sharding, ranks, *_ = CASES[case]
    for rank in range(WORLD):
        got = results[f"{case}/fused/{rank}"]
        assert got["outputs_equal"], (case, rank)
        held = [f for f in ("t.weight", "u.weight") if f in got]
        assert held, (case, rank)
        for fqn in held:
            assert got[fqn]["fused"], (case, rank, fqn)  # the rule ran it fused here
            assert got[fqn]["weight_err"] < 1e-5, (case, rank, fqn, got[fqn]["weight_err"])
            assert max(got[fqn]["state_err"].values()) < 1e-5, (case, rank, fqn)
        # the sparse route (the owners' former lookup) agrees as well
        sparse = results[f"{case}/sparse/{rank}"]
        assert all(sparse[f]["weight_err"] < 1e-5 and not sparse[f]["fused"] for f in held)


def test_bf16_storage_fused_agrees_with_the_sparse_route_to_its_rounding(results) -> None:
    import torch

    for rank in range(WORLD):
        fused, sparse = results[f"bf16/fused/{rank}"], results[f"bf16/sparse/{rank}"]
        assert fused["t.weight"]["fused"] and not sparse["t.weight"]["fused"]
        a = torch.tensor(fused["t.weight"]["weight"])
        b = torch.tensor(sparse["t.weight"]["weight"])
        # stored bf16 (8 significant bits, a step of up to 2**-7 relative): each of the 3
        # updates rounds once, up or down, on either route
        torch.testing.assert_close(a, b, rtol=3 * 2**-7, atol=1e-3)
        # unbiased rounding on both: no drift between them
        assert abs(float((a - b).mean())) < 2**-9
        # and near the fp32 reference, which neither stores
        assert fused["t.weight"]["weight_err"] < 0.05


def test_a_second_lookup_in_one_step_is_refused_on_the_fused_route() -> None:
    """Looked up twice before the optimizer steps, a fused table would have its rows updated
    once per lookup where the reference updates them once a step: refused by name. (The
    owner's pool is called directly: no collective is needed.)"""
    import torch
    from gemc.backends.torch.embedding import ShardedEmbedding
    from gemc.backends.torch.owner_lookup import OwnerLookup
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer

    from gemc.errors import GemcUserError

    table = ShardedEmbedding(_source("sum"), _plan_table("t.weight", "table_wise", [0], "fp32"),
                             rank=0, world_size=WORLD, seed=7)
    table.to_empty(device="cpu")
    table.reset_parameters()
    opt = EmbeddingOptimizer({"t.weight": table}, EmbeddingOptimConfig(), world_size=WORLD)
    OwnerLookup({"t.weight": table}, ["t.weight"], opt, world_size=WORLD, seed=7)
    request = (table, torch.tensor([1, 2, 3]), torch.tensor([2, 1]), None)
    table.owner_lookup.pool([request])
    with torch.no_grad():  # a lookup without a backward does not count
        table.owner_lookup.pool([request])
    with pytest.raises(GemcUserError, match="'t.weight' is looked up twice in one step"):
        table.owner_lookup.pool([request])
    opt.step()  # the next step may look it up again
    out = table.owner_lookup.pool([request])[0]
    assert out.shape == (2, DIM)


@pytest.mark.parametrize("stage_on_host", [True, False])
def test_adopted_shards_keep_their_values_and_release_what_they_held(stage_on_host,
                                                                    monkeypatch) -> None:
    """The fused buffers take each shard's stored rows and fp8 row scales as they were
    (through the host, as on a GPU, or straight), the shards then read the buffers, and
    what they and their optimizer state held is released *before* the buffers are made:
    on a full GPU the tables' memory is needed once, not twice (owner_lookup._release)."""
    import torch
    from gemc.backends.torch.embedding import ShardedEmbedding
    from gemc.backends.torch.owner_lookup import OwnerLookup
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer
    from gemc.backends.triton import embedding_bag

    tables, before = {}, {}
    for fqn, precision in (("t.weight", "fp32"), ("u.weight", "fp8"), ("v.weight", "fp8")):
        m = ShardedEmbedding(_source("sum"), _plan_table(fqn, "table_wise", [0], precision),
                             rank=0, world_size=WORLD, seed=7)
        m.to_empty(device="cpu")
        m.reset_parameters()
        tables[fqn] = m
        before[fqn] = (m.weight.detach().clone(),
                       None if m.row_scale is None else m.row_scale.clone())
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind="adam"), world_size=WORLD)
    held_at_allocation = []  # (shard rows still on the device, state tensors) per module
    made = embedding_bag.BatchedEmbeddingBag.__init__

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        held_at_allocation.append([(m.weight.shape[0], len(opt.state[f].tensors))
                                   for f, m in tables.items() if m.owner_lookup is None])
        made(self, *args, **kwargs)

    monkeypatch.setattr(embedding_bag.BatchedEmbeddingBag, "__init__", spy)
    OwnerLookup(tables, list(tables), opt, world_size=WORLD, seed=7,
                stage_on_host=stage_on_host)
    # one module per precision; its members' state released before it was made, and
    # their rows too when staged through the host
    assert len(held_at_allocation) == 2
    fp8_module = held_at_allocation[1]  # sorted by precision: fp32, then fp8
    assert [rows for rows, _ in fp8_module[-2:]] == ([0, 0] if stage_on_host else [ROWS, ROWS])
    assert [n for _, n in fp8_module[-2:]] == [0, 0]
    for fqn, m in tables.items():
        module, t = m.owner_lookup.index[fqn]
        values, scale = before[fqn]
        assert torch.equal(m.weight.data.view(torch.uint8), values.view(torch.uint8)), fqn
        assert m.weight.data.data_ptr() == module.split_weights()[t].data_ptr()
        assert opt.state[fqn].tensors["exp_avg"].data_ptr() == \
            module.split_optimizer_state()[t]["exp_avg"].data_ptr()
        if scale is not None:
            assert torch.equal(m.row_scale, scale)
            assert m.row_scale.data_ptr() == module.split_row_scales()[t].data_ptr()

"""Unpooled row-split tables: each row shard returns only its own ids' rows
(backends/torch/owned_rows.py, issue 19).

One process: the requester's half (the real routing, :func:`place_rows`) against eager
``F.embedding`` over the whole table, forward and backward. Four gloo processes stand for
2 hosts x 2 GPUs: one launch runs every case with ``GEMC_UNPOOLED_OWNED_ROWS`` 1 and 0
(the old path: a row from every shard for every id, summed), from the same shards and
batches, two optimizer steps; the outputs, the shards' gradients and the updated rows must
be equal (a row is a copy either way); and the float bytes each table's exchange sends
off-rank must be the cost model's (``pooled_send_bytes``: each id's row travels once).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.runner.harness import free_port, gloo_process, start_ranks, step_and_record

ROWS, DIM, B, L, WORLD, GPH, STEPS = 24, 8, 3, 4, 4, 2, 2
PAD = 13
EMPTY_RANK = 1  # its batch has no ids at all

# name: (sharding, ranks, grid, padding_idx)
TABLES: dict[str, tuple[str, list[int], list[int] | None, int | None]] = {
    "rw": ("row_wise", [1, 3, 0, 2], None, None),  # ranks out of order, across hosts
    "trw": ("table_row_wise", [2, 3], None, PAD),  # one host's row shards, padding ids
    "grid": ("grid", [0, 1, 2, 3], [2, 2], None),  # two row ranges x two column blocks
}
# case: (route, {table: (storage precision, wire forward precision)})
CASES: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "sparse": ("sparse", {t: ("fp32", "fp32") for t in TABLES}),
    "fused": ("fused", {t: ("fp32", "fp32") for t in TABLES}),
    "lowp": ("sparse", {"rw": ("bf16", "bf16"), "trw": ("fp8", "fp32"),
                        "grid": ("fp32", "fp8")}),
}


def _shards(name: str) -> list[dict[str, Any]]:
    from gemc.sharding import make_shards

    sharding, ranks, grid, _ = TABLES[name]
    return make_shards(sharding, ranks, ROWS, DIM, grid)


def _table(name: str, rank: int, precision: str = "fp32", wire: str = "fp32"):  # noqa: ANN202
    from gemc.backends.torch.embedding import ShardedEmbedding
    from torch import nn

    from gemc.exchange_precision import WirePrecision

    sharding, _, _, pad = TABLES[name]
    entry = {"fqn": f"{name}.weight", "rows": ROWS, "dim": DIM, "sharding": sharding,
             "shards": _shards(name), "precision": precision}
    m = ShardedEmbedding(nn.Embedding(ROWS, DIM, padding_idx=pad), entry, rank=rank,
                         world_size=WORLD, seed=7, exchange=WirePrecision.of(wire),
                         gpus_per_host=GPH)
    m.to_empty(device="cpu")
    m.reset_parameters()
    return m


def _ids(name: str, step: int, rank: int) -> torch.Tensor:
    """A rank's ``[B, L]`` ids: every shard's first and last row (the boundaries), a
    duplicate, random ones, the padding id where the table has one; none on EMPTY_RANK."""
    if rank == EMPTY_RANK:
        return torch.empty(0, L, dtype=torch.int64)
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}/{rank}".encode()))
    edges = sorted({e for s in _shards(name) for e in (s["row_offset"],
                                                        s["row_offset"] + s["rows"] - 1)})
    ids = torch.cat([torch.tensor(edges), torch.randint(0, ROWS, (B * L,), generator=g)])
    ids = ids[torch.randperm(ids.numel(), generator=g)][:B * L]
    ids[3] = ids[7]  # a duplicate
    if TABLES[name][3] is not None:
        ids[5] = TABLES[name][3]
    return ids.view(B, L)


def _uniform_ids(rank: int) -> torch.Tensor:
    """``B*L`` even ids spread evenly over the rows (as many in every row range of every
    sharding here; none the odd padding id), different on each rank: the cost model's
    uniform traffic."""
    return ((torch.arange(B * L) * (ROWS // (B * L)) + 2 * rank) % ROWS).view(B, L)


def test_routed_rows_laid_back_equal_eager_lookup() -> None:
    """One process: the routing of an owned-rows table sends each owner only the ids of
    its row range (no counts); the owners' rows, cut from the whole table, laid back by
    place_rows equal ``F.embedding`` (padding rows zero), and the backward hands each
    owner exactly its ids' gradient rows."""
    from gemc.backends.torch.embedding_exchange import route_placed
    from gemc.backends.torch.owned_rows import OWNED_ROWS, place_rows

    full = torch.randn(ROWS, DIM)
    for name in TABLES:
        m = _table(name, 0)
        ids = _ids(name, 0, 0)
        bags = m.routed_bags(*m.as_bags(ids, None, None)[:3])
        assert bags.owned_rows
        headers, bodies, placements = route_placed([m], [bags], WORLD)
        chunks = {}
        for d, shard in m.owners.items():
            n, n_rows, kind = headers[d]
            (local_ids,) = bodies[d]  # the ids alone
            assert (n, n_rows, kind) == (local_ids.numel(), local_ids.numel(), OWNED_ROWS)
            assert bool(((local_ids >= 0) & (local_ids < shard.rows)).all())
            rows = full[shard.row_offset:shard.row_offset + shard.rows,
                        shard.col_offset:shard.col_offset + shard.cols]
            chunks[d] = rows[local_ids].clone().requires_grad_()
        kept = ids.reshape(-1) != (m.padding_idx if m.padding_idx is not None else -1)
        assert sum(headers[d][0] for d in m.owners) == int(kept.sum()) * (
            2 if name == "grid" else 1)  # a grid's ids go to both column blocks
        p = placements[0]
        out = place_rows(chunks, p.per_dest,
                         {d: s.col_offset for d, s in m.owners.items()},
                         p.order, bags.bag, bags.batch)
        want = F.embedding(ids.reshape(-1), full) * kept.unsqueeze(1)
        assert torch.equal(out, want), name
        grad = torch.randn_like(out)
        out.backward(grad)
        for d, shard in m.owners.items():
            (local_ids,) = bodies[d]
            mine = (ids.reshape(-1) - shard.row_offset).clamp(min=0)
            in_range = kept & (ids.reshape(-1) >= shard.row_offset) & (
                ids.reshape(-1) < shard.row_offset + shard.rows)
            assert torch.equal(mine[in_range], local_ids)  # id order within the range
            assert torch.equal(chunks[d].grad, grad[in_range][
                :, shard.col_offset:shard.col_offset + shard.cols])


def test_pooled_and_column_tables_keep_their_path() -> None:
    """The switch's reach: pooled row shards and unpooled column-wise / table-wise tables
    still get counts and return a row per bag; a bad switch value is refused by name."""
    from gemc.backends.torch.embedding import ShardedEmbedding
    from gemc.backends.torch.owned_rows import ENV, owned_rows_enabled
    from torch import nn

    from gemc.sharding import make_shards

    def table(source: nn.Module, sharding: str) -> ShardedEmbedding:
        entry = {"fqn": "t.weight", "rows": ROWS, "dim": DIM, "sharding": sharding,
                 "shards": make_shards(sharding, [0, 1], ROWS, DIM)}
        return ShardedEmbedding(source, entry, rank=0, world_size=WORLD, seed=7)

    assert table(nn.Embedding(ROWS, DIM), "row_wise").answers_owned_rows()
    assert not table(nn.EmbeddingBag(ROWS, DIM), "row_wise").answers_owned_rows()
    assert not table(nn.Embedding(ROWS, DIM), "column_wise").answers_owned_rows()
    os.environ[ENV] = "0"
    try:
        assert not table(nn.Embedding(ROWS, DIM), "row_wise").answers_owned_rows()
        os.environ[ENV] = "yes"
        with pytest.raises(ValueError, match=r"GEMC_UNPOOLED_OWNED_ROWS='yes': use 1 .* or 0"):
            owned_rows_enabled()
    finally:
        del os.environ[ENV]


# ---- several processes ---------------------------------------------------------------------


def _train(case: str, rank: int) -> dict[str, Any]:
    """Two steps of CASES[case], every table in one exchange: outputs, gradients and
    updated rows of this rank's shards."""
    from gemc.backends.torch.embedding_exchange import exchange_lookups
    from gemc.backends.torch.owner_lookup import OwnerLookup
    from gemc.backends.torch.sparse_optim import EmbeddingOptimConfig, EmbeddingOptimizer

    route, specs = CASES[case]
    tables = {f"{n}.weight": _table(n, rank, *specs[n]) for n in specs}
    opt = EmbeddingOptimizer(tables, EmbeddingOptimConfig(kind="adam", lr=0.05),
                             world_size=WORLD)
    if route == "fused":
        owned = [f for f, m in tables.items() if m.local is not None]
        if owned:
            OwnerLookup(tables, owned, opt, world_size=WORLD, seed=7)
    out: dict[str, Any] = {"outputs": [], "grads": {}, "weights": {}}
    for step in range(STEPS):
        bags, grads = [], []
        for fqn, m in tables.items():
            ids = _ids(fqn.split(".")[0], step, rank)
            bags.append(m.routed_bags(*m.as_bags(ids, None, None)[:3]))
            g = torch.Generator().manual_seed(zlib.crc32(f"g/{fqn}/{step}/{rank}".encode()))
            grads.append(torch.randn(ids.numel(), DIM, generator=g))
        outs = exchange_lookups(list(tables.values()), bags, world=WORLD)
        sum((o * g).sum() for o, g in zip(outs, grads)).backward()
        step_and_record(out, outs, tables, opt, with_grads=route != "fused")
    return out


def _sent(rank: int) -> dict[str, list[int]]:
    """Per table, alone in its exchange over a uniform batch: the float elements of each
    ``all_to_all_single`` this rank sends to other ranks, forward and backward."""
    import torch.distributed as dist
    from gemc.backends.torch.comm import count_calls
    from gemc.backends.torch.embedding_exchange import exchange_lookups

    out: dict[str, list[int]] = {}
    for name in TABLES:
        m = _table(name, rank)
        ids = _uniform_ids(rank)
        calls: list[int] = []

        def on_call(output, data, out_splits, in_splits, *_: Any,  # noqa: ANN001
                    calls: list[int] = calls, **__: Any) -> None:
            if data.dtype.is_floating_point:
                calls.append(sum(n for d, n in enumerate(in_splits) if d != rank))

        inner = dist.all_to_all_single
        count_calls("all_to_all_single", on_call)
        try:
            got = exchange_lookups([m], [m.routed_bags(*m.as_bags(ids, None, None)[:3])],
                                   world=WORLD)[0]
            got.sum().backward()
        finally:
            dist.all_to_all_single = inner
        out[name] = calls
    return out


def _worker(rank: int, port: int, path: str) -> None:
    from gemc.backends.torch.owned_rows import ENV

    with gloo_process(rank, WORLD, port):
        out: dict[str, Any] = {}
        try:
            for owned in ("1", "0"):
                os.environ[ENV] = owned
                out[owned] = {case: _train(case, rank) for case in CASES}
                out[owned]["sent"] = _sent(rank)
        finally:
            torch.save(out, f"{path}.{rank}")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("owned_rows") / "out.pt")
    start_ranks(_worker, (free_port(), path), WORLD)
    return {rank: torch.load(f"{path}.{rank}") for rank in range(WORLD)}


@pytest.mark.parametrize("case", list(CASES))
def test_owned_rows_equal_the_summed_path(results, case: str) -> None:
    """Outputs, gradients and updated rows equal the old path's exactly: each id's row
    is a copy on both (the old path's ``x + 0`` may only flip a zero's sign, which
    ``torch.equal`` ignores)."""
    for rank in range(WORLD):
        new, old = results[rank]["1"][case], results[rank]["0"][case]
        for step in range(STEPS):
            for t, (a, b) in enumerate(zip(new["outputs"][step], old["outputs"][step])):
                assert a.shape == (0 if rank == EMPTY_RANK else B * L, DIM)
                assert torch.equal(a, b), (case, rank, step, list(TABLES)[t])
                if rank != EMPTY_RANK:
                    assert a.abs().sum() > 0
        for key in ("grads", "weights"):
            assert new[key].keys() == old[key].keys()
            if key == "weights" or CASES[case][0] != "fused":  # fused: no gradient kept
                assert new[key], (case, rank, key)
            for fqn, steps in new[key].items():
                for step, (a, b) in enumerate(zip(steps, old[key][fqn])):
                    assert torch.equal(a, b), (case, rank, key, fqn, step)
        if case == "sparse" and "rw.weight" in new["grads"]:
            assert new["grads"]["rw.weight"][0].abs().sum() > 0  # the shard got its rows'


def test_each_ids_row_travels_once_as_the_cost_model_prices_it(results) -> None:
    """The float bytes an unpooled row-split table's exchange sends off-rank, forward and
    backward, are the cost model's ``pooled_send_bytes`` summed over its holders (twice:
    the price is one direction's mean), with no in-host stage; the old path sent a row per
    id from every row shard."""
    from gemc.cost_model.step_model import pooled_send_bytes
    from gemc.cost_model.types import TableCost

    from gemc.exchange_precision import FP32_WIRE

    for name, (sharding, ranks, _, _) in TABLES.items():
        t = TableCost(name, ROWS, DIM, nnz=B * L, batch=B * L, sharding=sharding,
                      ranks=tuple(ranks), pooled=False)
        priced = 2 * sum(pooled_send_bytes(t, s["rows"], s["cols"], WORLD, FP32_WIRE, GPH)
                         for s in _shards(name))
        new = [results[rank]["1"]["sent"][name] for rank in range(WORLD)]
        assert all(len(calls) == 2 for calls in new), (name, new)  # forward, backward
        assert 4 * sum(sum(c) for c in new) == pytest.approx(priced, rel=1e-12), name
        old = sum(sum(results[rank]["0"]["sent"][name]) for rank in range(WORLD))
        row_ranges = len({(s["row_offset"], s["rows"]) for s in _shards(name)})
        assert old > sum(sum(c) for c in new) * (row_ranges - 1), name

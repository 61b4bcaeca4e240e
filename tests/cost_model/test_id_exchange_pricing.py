"""The id all-to-all (input dist) is priced as the runner's exchange sends it (issue 19):
every id to each owner of its row range -- so a column-wise table over k distinct ranks
sends every id k times, each piece looking up the same rows for its own columns -- and the
per-bag id counts (int64) to every holder. Before, every sharding was priced as one copy of
the ids plus 4-byte lengths, whatever its column pieces."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from gemc.backends.torch.embedding_exchange import Bags, route
from gemc.cost_model.kernels import INDEX_BYTES
from gemc.cost_model.step_model import a2a_sends, id_send_bytes, predict_step
from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, TableCost

from gemc.sharding import SHARDINGS

WORLD = 8
ROWS, DIM, NNZ, BATCH = 4096, 64, 96, 16
TABLE = TableCost("t", ROWS, DIM, NNZ, BATCH)
# (sharding, ranks, grid): every kind of cut the runner routes
LAYOUTS = [
    ("table_wise", (3,), None),
    ("row_wise", tuple(range(WORLD)), None),
    ("column_wise", (1, 4), None),
    ("column_wise", (0, 2, 5, 7), None),
    ("column_wise", tuple(range(WORLD)), None),
    ("table_row_wise", (4, 5, 6, 7), None),
    ("grid", (0, 1, 2, 3), (2, 2)),
]


def _runner_bytes_off_rank(sharding: str, ranks: tuple[int, ...],
                           grid: tuple[int, int] | None, unpooled: bool = False) -> int:
    """Bytes all ranks' id payloads send to other ranks, from the runner's own routing
    (embedding_exchange.route), every rank routing the same batch (ids over all the row
    ranges); ``unpooled``: an nn.Embedding's bags of one id, routed as the table's
    ShardedEmbedding.routed_bags says (owned rows where its sharding splits rows)."""
    shards = SHARDINGS[sharding].shards(list(ranks), ROWS, DIM, grid)
    owners = {s["rank"]: SimpleNamespace(row_offset=s["row_offset"], rows=s["rows"])
              for s in shards}
    m = SimpleNamespace(owners=owners, route_cache={})
    ids = torch.arange(NNZ, dtype=torch.int64) * (ROWS // NNZ)  # spread over the rows
    bags = Bags(ids=ids, bag=torch.arange(NNZ) % BATCH, batch=BATCH, weights=None,
                lengths=torch.full((BATCH,), NNZ // BATCH))
    if unpooled:
        bags = Bags(ids=ids, bag=torch.arange(NNZ), batch=NNZ, weights=None,
                    lengths=torch.ones(NNZ, dtype=torch.int64),
                    owned_rows=SHARDINGS[sharding].row_split)
    total = 0
    for rank in range(WORLD):
        _, bodies = route([m], [bags], WORLD)
        total += sum(int(t.numel()) * t.element_size()
                     for dest, body in enumerate(bodies) if dest != rank for t in body)
    return total


@pytest.mark.parametrize(("sharding", "ranks", "grid"), LAYOUTS)
def test_id_price_is_what_the_runner_routes(sharding, ranks, grid):
    """Every sharding type's price, times the world, is the bytes the runner's routing
    sends off-rank for the same batch: the priced ``1 - 1/world`` is exact, as what the
    ranks keep (each holder its own range's ids and its own counts) adds up to one rank's
    sends."""
    t = replace(TABLE, sharding=sharding, ranks=ranks)
    assert WORLD * id_send_bytes(t, WORLD) == _runner_bytes_off_rank(sharding, ranks, grid)


@pytest.mark.parametrize(("sharding", "ranks", "grid"), LAYOUTS)
def test_unpooled_id_price_is_what_the_runner_routes(sharding, ranks, grid):
    """The same for an unpooled table (one id a bag): a row-split one sends its owners
    the ids alone (each returns one row per id it owns: backends/torch/owned_rows.py),
    the others the ids and the counts, and the price follows."""
    t = replace(TABLE, sharding=sharding, ranks=ranks, batch=NNZ, pooled=False)
    got = _runner_bytes_off_rank(sharding, ranks, grid, unpooled=True)
    assert WORLD * id_send_bytes(t, WORLD) == got
    if SHARDINGS[sharding].row_split:  # no counts: each id once per column block
        blocks = SHARDINGS[sharding].column_blocks(len(ranks))
        assert got == WORLD * blocks * NNZ * INDEX_BYTES * (1 - 1 / WORLD)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_column_pieces_pay_the_ids_once_each(k):
    """A column-wise table over k distinct ranks sends k times the id bytes of the same
    table whole on one rank (ids and counts both go to every piece); row-wise sends its
    ids once and only its counts per holder."""
    whole = id_send_bytes(TABLE, WORLD)
    columns = replace(TABLE, sharding="column_wise", ranks=tuple(range(k)))
    assert id_send_bytes(columns, WORLD) == pytest.approx(k * whole, rel=1e-12)
    rows = replace(TABLE, sharding="row_wise", ranks=tuple(range(WORLD)))
    assert id_send_bytes(rows, WORLD) == pytest.approx(
        (NNZ + WORLD * BATCH) * INDEX_BYTES * (1 - 1 / WORLD))
    # a rank listed twice is one destination: the runner keys its sends by rank
    twice = replace(TABLE, sharding="column_wise", ranks=(0, 0, 1, 2))
    assert id_send_bytes(twice, WORLD) == pytest.approx(3 * whole, rel=1e-12)


def test_predict_step_charges_the_copies_in_its_input_dist():
    """The step's exposed input dist grows with the column pieces (the runner exchanges
    the ids inside the step), while the pooled all-to-all is split by their columns."""
    topo = parse_topology("h200:1x8")
    big = replace(TABLE, rows=10**6, dim=128, nnz=512 * 100, batch=512)
    mlp = [RegionCost("mlp", 10**6, 1e12, 5e-3)]
    whole = predict_step(mlp, [big], topo)
    pieces = predict_step(mlp, [replace(big, sharding="column_wise", ranks=tuple(range(8)))],
                          topo)
    assert pieces.breakdown["input_dist"] > whole.breakdown["input_dist"]
    ids_whole = a2a_sends([big], 8)[1]
    ids_pieces = a2a_sends([replace(big, sharding="column_wise", ranks=tuple(range(8)))], 8)[1]
    assert list(ids_pieces) == pytest.approx(list(8 * ids_whole))
    assert pieces.breakdown["all_to_all"] < whole.breakdown["all_to_all"]

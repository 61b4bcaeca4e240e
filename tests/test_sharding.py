"""One object per table sharding type (gemc.sharding): the shards it cuts, the shape the cost
model prices for each holder, its communication (replicated or exchanged), the solver's
candidate placements and their placement shape agree with each other for every declared
type."""

from __future__ import annotations

import pytest
from gemc.cost_model.memory import shard_shape
from gemc.cost_model.types import TableCost

from gemc.sharding import (
    DECLARED,
    SHARDINGS,
    TABLE_SHARDINGS,
    Candidate,
    Sharding,
    make_shards,
    register,
    sharding,
    unregister,
)

ROWS, DIM = 48, 24


def _layout(s: Sharding) -> tuple[list[int], tuple[int, int] | None]:
    """Ranks (and a grid) a solver candidate of this type may take on 2 hosts x 2 GPUs."""
    if s.placement == "one_rank":
        return [3], None
    if s.placement == "one_host":
        return [2, 3], None
    if s.placement == "host_grid":
        return [0, 1, 2, 3], (2, 2)
    return [0, 1, 2, 3], None


@pytest.mark.parametrize("s", DECLARED, ids=lambda s: s.name)
def test_each_holders_shard_is_the_shape_the_cost_model_prices(s: Sharding) -> None:
    ranks, grid = _layout(s)
    shards = s.shards(ranks, ROWS, DIM, grid)
    assert sorted(x["rank"] for x in shards) == sorted(ranks if s.split != "none"
                                                       or s.replicated else ranks[:1])
    copies = len(ranks) if s.replicated else 1
    assert sum(x["rows"] * x["cols"] for x in shards) == ROWS * DIM * copies
    # the cost model's shape of a holder's part is every shard's actual shape
    table = TableCost("t", ROWS, DIM, 64, 8, sharding=s.name,
                      ranks=tuple(x["rank"] for x in shards))
    for x in shards:
        assert (x["rows"], x["cols"]) == shard_shape(table)
    # a row split is what makes an unpooled shard return only its rows' share
    offsets = {x["row_offset"] for x in shards}
    assert s.row_split == (len(offsets) > 1)
    unpooled = TableCost("u", ROWS, DIM, 64, 8, sharding=s.name, ranks=table.ranks,
                         pooled=False)
    share = unpooled.output_share(shards[0]["rows"])
    assert share == (shards[0]["rows"] / ROWS if s.row_split else 1.0)
    assert table.replicated == s.replicated


def test_the_solvers_placement_shape_covers_the_candidates_ranks() -> None:
    world, local = 8, 4
    for s in DECLARED:
        ranks = {"one_rank": 1, "one_host": local, "host_grid": world,
                 "distinct_ranks": 4}.get(s.placement, world)
        grid = (2, local) if s.placement == "host_grid" else None
        pieces, width = s.pieces_and_width(ranks, world, local, grid)
        assert pieces * width == ranks, s.name
    assert sharding("column_wise").label(4) == "column_wise/4"
    assert sharding("grid").label(8, (2, 4)) == "grid/2x4"
    assert sharding("row_wise").label(8) == "row_wise"


def test_names_are_declared_once() -> None:
    assert TABLE_SHARDINGS == tuple(SHARDINGS) == tuple(s.name for s in DECLARED)
    assert [s.name for s in DECLARED if s.replicated] == ["data_parallel"]
    with pytest.raises(ValueError, match="unknown sharding 'diagonal'.*known: table_wise"):
        make_shards("diagonal", [0], 4, 4)


def _offered(hosts: int, local: int, dim: int = 64) -> list[tuple[str, int, object]]:
    return [(s.name, c.ranks, c.grid) for s in DECLARED
            for c in s.candidates(dim, hosts, local)]


def test_each_type_offers_its_candidates_for_the_table_and_topology() -> None:
    # one GPU: only the table on it
    assert _offered(1, 1) == [("table_wise", 1, None)]
    # one host of 8: every rank, and column splits that keep >= 8 whole columns
    assert _offered(1, 8, dim=32) == [
        ("table_wise", 1, None), ("row_wise", 8, None), ("data_parallel", 8, None),
        ("column_wise", 2, None), ("column_wise", 4, None)]
    assert [r for n, r, _ in _offered(1, 8, dim=128) if n == "column_wise"] == [2, 4, 8]
    assert [r for n, r, _ in _offered(1, 8, dim=48) if n == "column_wise"] == [2, 4]  # 48/8 = 6
    # two hosts: a 16-way split of a dim-128 table (8 columns = one fp32 32-byte sector)
    assert [r for n, r, _ in _offered(2, 8, dim=128) if n == "column_wise"] == [2, 4, 8, 16]
    assert [r for n, r, _ in _offered(2, 8, dim=64) if n == "column_wise"] == [2, 4, 8]
    # several hosts: one host's GPUs, and a grid whose shape the memory model prices
    assert _offered(8, 8)[-2:] == [("table_row_wise", 8, None), ("grid", 64, (8, 8))]
    assert ("grid", 16, (2, 8)) not in _offered(2, 8)  # round(sqrt(16)) = 4 column blocks
    assert [(n, g) for n, _, g in _offered(4, 4) if n == "grid"] == [("grid", (4, 4))]
    # from 32 hosts of 8, one square grid of two hosts a column block (16 x 16), where
    # its blocks keep >= 8 whole columns; not on 31 hosts, nor for a 64-wide table
    assert [(r, g) for n, r, g in _offered(32, 8, dim=128) if n == "grid"] == [
        (64, (8, 8)), (256, (16, 16))]
    assert [g for n, _, g in _offered(512, 8, dim=128) if n == "grid"] == [(8, 8), (16, 16)]
    assert [g for n, _, g in _offered(31, 8, dim=128) if n == "grid"] == [(8, 8)]
    assert [g for n, _, g in _offered(32, 8, dim=64) if n == "grid"] == [(8, 8)]
    for hosts, local, dim in ((1, 1, 64), (1, 8, 64), (2, 4, 64), (8, 8, 64), (3, 2, 64),
                              (32, 8, 128)):
        for s in DECLARED:
            for c in s.candidates(dim, hosts, local):
                # the candidate's placement shape covers its ranks, and its shards tile
                # the table as the cost model prices them
                pieces, width = s.pieces_and_width(c.ranks, hosts * local, local, c.grid)
                assert pieces * width == c.ranks, (s.name, c)
                shards = s.shards(list(range(c.ranks)), 3072, dim, c.grid)
                expected = s.shard_shape(3072, dim, c.ranks)
                assert all((x["rows"], x["cols"]) == expected for x in shards), (s.name, c)
    assert Candidate(4) == Candidate(4, None)


def test_a_type_is_registered_once_and_built_in_ones_stay() -> None:
    with pytest.raises(ValueError, match="sharding row_wise is already registered"):
        register(Sharding("row_wise", "rows", "every_rank"))
    with pytest.raises(ValueError, match="sharding grid is built in"):
        unregister("grid")
    toy = register(Sharding("toy_host_columns", "columns", "one_host"))
    try:
        assert SHARDINGS["toy_host_columns"] is toy and sharding("toy_host_columns") is toy
        assert tuple(SHARDINGS)[-1] == "toy_host_columns"  # offered after the built-in ones
    finally:
        unregister("toy_host_columns")
    assert tuple(SHARDINGS) == TABLE_SHARDINGS


def test_a_declaration_that_contradicts_itself_is_refused() -> None:
    with pytest.raises(ValueError, match="split 'diagonal'"):
        Sharding("x", "diagonal", "one_rank")
    with pytest.raises(ValueError, match="placement 'anywhere'"):
        Sharding("x", "rows", "anywhere")
    with pytest.raises(ValueError, match="a replicated table is whole on every rank"):
        Sharding("x", "rows", "every_rank", replicated=True)
    with pytest.raises(ValueError, match="a candidate needs its grid"):
        Sharding("x", "grid", "host_grid").pieces_and_width(4, 4, 2)


def test_a_new_type_is_one_declaration() -> None:
    """What a new type gets from its one line: column shards inside one host."""
    host_columns = Sharding("host_column_wise", "columns", "one_host")
    shards = host_columns.shards([4, 5, 6, 7], ROWS, DIM)
    assert [(x["rank"], x["col_offset"], x["cols"]) for x in shards] == [
        (4, 0, 6), (5, 6, 6), (6, 12, 6), (7, 18, 6)]
    assert host_columns.shard_shape(ROWS, DIM, 4) == (ROWS, DIM / 4)
    assert host_columns.pieces_and_width(4, 16, 4) == (1, 4)
    assert not host_columns.replicated and not host_columns.row_split
    # the solver's candidates: one host's GPUs, on several hosts, where the columns split
    assert host_columns.candidates(DIM * 4, 4, 4) == (Candidate(4),)
    assert host_columns.candidates(DIM, 4, 4) == ()  # 24 / 4 < 16 columns a shard
    assert host_columns.candidates(DIM * 4, 1, 4) == ()  # one host: row_wise's place

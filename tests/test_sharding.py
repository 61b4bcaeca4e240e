"""One object per table sharding type (gemc.sharding): the shards it cuts, the shape the cost
model prices for each holder, its communication (replicated or exchanged) and the solver's
placement shape agree with each other for every declared type."""

from __future__ import annotations

import pytest
from gemc.cost_model.memory import shard_shape
from gemc.cost_model.types import TableCost

from gemc.sharding import DECLARED, SHARDINGS, TABLE_SHARDINGS, Sharding, make_shards, sharding

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
    with pytest.raises(ValueError, match="unknown sharding 'diagonal'.*known: data_parallel"):
        make_shards("diagonal", [0], 4, 4)


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

"""How a table's sharding and ranks turn into concrete shards (row and column ranges).

One function, used by the plan builder, the solver and the runner, so the three never
disagree on which rows a rank holds.
"""

from __future__ import annotations

from typing import Any

# The names a plan, the cost model and the solver use (defined once, here in the core).
DENSE_STRATEGIES = ("ddp", "fsdp", "hsdp", "tp")
TABLE_SHARDINGS = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "grid",
)


def split_even(total: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of ``parts`` contiguous pieces, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    out, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def make_shards(
    sharding: str, ranks: list[int], rows: int, dim: int, grid: list[int] | None = None
) -> list[dict[str, Any]]:
    """Concrete shards: [{"rank", "row_offset", "rows", "col_offset", "cols"}, ...]."""

    def shard(rank: int, r0: int, nr: int, c0: int, nc: int) -> dict[str, Any]:
        return {"rank": rank, "row_offset": r0, "rows": nr, "col_offset": c0, "cols": nc}

    if sharding == "table_wise":
        return [shard(ranks[0], 0, rows, 0, dim)]
    if sharding == "data_parallel":
        return [shard(r, 0, rows, 0, dim) for r in ranks]
    if sharding in ("row_wise", "table_row_wise"):
        return [
            shard(r, r0, nr, 0, dim) for r, (r0, nr) in zip(ranks, split_even(rows, len(ranks)))
        ]
    if sharding == "column_wise":
        return [
            shard(r, 0, rows, c0, nc) for r, (c0, nc) in zip(ranks, split_even(dim, len(ranks)))
        ]
    if sharding == "grid":
        n_col, n_row = grid if grid else (len(ranks), 1)
        if n_col * n_row != len(ranks):
            raise ValueError(f"grid {grid} does not match {len(ranks)} ranks")
        out = []
        for ci, (c0, nc) in enumerate(split_even(dim, n_col)):
            group = ranks[ci * n_row : (ci + 1) * n_row]
            out += [shard(r, r0, nr, c0, nc) for r, (r0, nr) in zip(group, split_even(rows, n_row))]
        return out
    raise ValueError(f"unknown sharding {sharding!r}")

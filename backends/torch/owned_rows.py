"""Unpooled row-split tables: each row shard answers only the ids in its row range.

Why: an ``nn.Embedding`` lookup (one row per id, no bag sum) routed as bags of one id made
every row shard return a row for *each* of the requester's ids, zeros for the ids outside
its range, and the requester summed them: a table in ``k`` row shards sent ``k`` times the
rows it needs (and the in-host sum of :mod:`.host_reduce` added those zeros too). The cost
model prices each shard's own rows (``TableCost.output_share``: each id's row travels once).

Here, for an unpooled table whose sharding splits rows (``row_wise``, ``table_row_wise``,
``grid``: ``gemc.sharding.Sharding.row_split``; the fact
``Bags.owned_rows`` carries, set by ``ShardedEmbedding.routed_bags``):

* route: the requester sends each owner the ids of its row range and no per-bag counts
  (the header's weight kind says so: :data:`OWNED_ROWS`, so the owner follows the
  requester, not a setting of its own);
* owner: one row per received id (a bag of one: the same lookup and sparse gradient as
  before, minus the empty bags), ``[ids received, cols]`` per requester;
* requester: :func:`place_rows` lays every owner's rows back into id order (the routing's
  own sort by row range, undone), the column pieces of a grid side by side. An id's row
  is a copy, never a sum: the forward equals the old path exactly (fp32 bit for bit, up
  to the sign of a zero the old ``x + 0`` made positive), and the backward sends each id's
  gradient row to its owner alone.

Nothing to sum inside a host any more: these tables skip :mod:`.host_reduce`. Pooled
tables and unpooled tables cut only by columns (or whole) keep the old path byte for
byte. The switch for A/B measurement: :data:`ENV` (``1`` default, ``0`` the old path);
every rank must see the same value (the collectives pair up).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

ENV = "GEMC_UNPOOLED_OWNED_ROWS"
_VALUES = {"1": True, "0": False}
OWNED_ROWS = 3  # header weight kind: ids only, one returned row per id (no counts)


def owned_rows_enabled() -> bool:
    """Whether unpooled row-split tables return only their owned rows (:data:`ENV`: ``1``,
    the default, or ``0``). Read at every call, so a benchmark can flip it between runs."""
    value = os.environ.get(ENV, "1").strip()
    if value not in _VALUES:
        raise ValueError(f"{ENV}={value!r}: use 1 (each row shard of an unpooled table "
                         "returns only the rows it owns, the default) or 0 (every row "
                         "shard returns a row for each id, zeros outside its range, and "
                         "the requester sums them)")
    return _VALUES[value]


def place_rows(chunks: Mapping[int, torch.Tensor], placed: Mapping[int, tuple[int, int, int]],
               col_offsets: Mapping[int, int], order: torch.Tensor | None, bag: torch.Tensor,
               batch: int) -> torch.Tensor:
    """The ``[batch, dim]`` output of one unpooled table from its owners' rows.

    ``chunks[d]``: owner ``d``'s rows ``[n_d, cols_d]`` (its ids in routed order);
    ``placed[d]``: ``(first, n_d, row offset)`` of its ids in the routing's sort by row
    range (:func:`~.embedding_exchange.route`); ``col_offsets[d]``: its first column;
    ``order``: that sort's permutation of the ids (None: one range, ids unsorted); ``bag``:
    each id's output row. Rows of bags without an id (padding ids dropped) stay zero, as
    the old path left them. Differentiable: ``cat`` and ``index_copy`` hand each owner the
    gradient rows of its own ids, unchanged."""
    by_range: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for d, chunk in chunks.items():
        by_range.setdefault(placed[d][2], []).append((col_offsets[d], chunk))
    ranges = []
    for _, pieces in sorted(by_range.items()):  # by row offset: the routing's sort
        pieces.sort(key=lambda p: p[0])
        ranges.append(pieces[0][1] if len(pieces) == 1
                      else torch.cat([c for _, c in pieces], dim=1))
    rows = ranges[0] if len(ranges) == 1 else torch.cat(ranges)
    at = bag if order is None else bag[order]
    if order is None and rows.shape[0] == batch:
        return rows  # one range, no id dropped: the ids' rows in bag order already
    return rows.new_zeros(batch, rows.shape[1]).index_copy(0, at, rows)

"""Row-shard partial sums reduced inside each host before they cross hosts.

Why: a table split by rows (``row_wise``, ``table_row_wise``, ``grid``) has several owners
per column range, and each owner pools a requester's bags over its rows only. Sent as
they are, a requester on another host receives one partial ``[bags, cols]`` block per
owner: a table in 8 row shards on one host costs 8 times the cross-host bytes of a
table-wise one. TorchRec's table-row-wise sharding reduce-scatters the partials inside
the host (NVLink) first and sends each requester one block across hosts; so does gemc's
exchange (:func:`gemc.backends.torch.embedding_exchange.exchange_lookups`):

* host groups: per column range of a table, its owners grouped by host (rank ``r`` on
  host ``r // gpus_per_host``, the plan topology's); a group of ``k > 1`` owners reduces,
  a lone owner sends as before;
* aggregator: the partial for requester ``r`` is summed on ``group[(r % gpus_per_host) %
  k]`` (owners sorted by rank). Rail-aligned: with ``k == gpus_per_host`` the cross-host
  hop joins GPUs of the same local index, and a requester of the group's own host is its
  own aggregator. A pure function of the shards and rank ids: every rank agrees;
* stage A (:func:`reduce_in_hosts`): every owner sends, for every requester, its partial
  to that requester's aggregator, all tables of a dtype in one differentiable
  ``all_to_all_single`` over the world group, in the table's dtype (no wire rounding
  before the sum: it is exact to the direct path up to the order of fp32 additions); the
  aggregator adds the group's pieces (rows line up: every owner of a table receives all
  of a requester's bags, :func:`~gemc.backends.torch.embedding_exchange.route`);
* stage B: the exchange's pooled all-to-all sends the sums, one block per host group
  (its wire precision applies there, as before).

Backward is autograd's: the sum hands its gradient to each piece and stage A's
all-to-all carries it back to every owner. Unpooled row-split tables (``nn.Embedding``)
never come here: each owner returns only the rows of its own ids (:mod:`.owned_rows`), one
owner per id, nothing to sum (with ``GEMC_UNPOOLED_OWNED_ROWS=0`` they take the old
path, reduce included). One world (``gpus_per_host >= world``) and
tables without a multi-owner host group keep the direct path, byte for byte. The switch
for A/B measurement: :data:`ENV` (``1`` default, ``0`` the direct path).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from gemc.backends.torch.comm import autograd_all_to_all

if TYPE_CHECKING:  # the module imports the exchange, which imports this one
    from gemc.backends.torch.embedding import Shard, ShardedEmbedding

ENV = "GEMC_ROW_SHARD_HOST_REDUCE"
_VALUES = {"1": True, "0": False}


def host_reduce_enabled() -> bool:
    """Whether the exchange reduces row shards inside hosts (:data:`ENV`: ``1``, the
    default, or ``0``). Read at every exchange, so a benchmark can flip it between runs;
    every rank must see the same value (the collectives pair up)."""
    value = os.environ.get(ENV, "1").strip()
    if value not in _VALUES:
        raise ValueError(f"{ENV}={value!r}: use 1 (reduce row-shard partial sums inside "
                         "each host before they cross hosts, the default) or 0 (every "
                         "owner sends its partial straight to the requester)")
    return _VALUES[value]


@dataclass(frozen=True)
class HostGroups:
    """One table's owners that reduce inside their host: ``group_of[owner]`` is its group
    (ranks sorted, two or more on one host, one column range); owners absent send
    directly."""

    gpus_per_host: int
    group_of: dict[int, tuple[int, ...]]

    def aggregator(self, group: tuple[int, ...], requester: int) -> int:
        """The owner of ``group`` that sums the partials for ``requester`` (rail-aligned)."""
        return group[(requester % self.gpus_per_host) % len(group)]

    def sends(self, owner: int, requester: int) -> bool:
        """Whether ``owner`` sends ``requester`` a block in stage B (the pooled exchange):
        a lone owner its own partial, a group's aggregator the group's sum."""
        group = self.group_of.get(owner)
        return group is None or self.aggregator(group, requester) == owner


@functools.lru_cache(maxsize=4096)
def aggregated_by(group: tuple[int, ...], gpus_per_host: int, world: int, owner: int
                  ) -> tuple[int, ...]:
    """The requesters whose partials ``owner`` sums for ``group`` (by rank). Cached: the
    exchange asks per table and step, and a scan of the world each time adds up."""
    at = group.index(owner)
    return tuple(r for r in range(world) if (r % gpus_per_host) % len(group) == at)


def host_groups(shards: Sequence[Shard], gpus_per_host: int | None, world_size: int
                ) -> HostGroups | None:
    """The table's reducing host groups (see :class:`HostGroups`), None where nothing
    reduces: one host (``gpus_per_host`` None or the whole world: no hop to save, and the
    direct path stays as it was), or no column range with two owners on one host."""
    if gpus_per_host is None or gpus_per_host >= world_size:
        return None
    if gpus_per_host < 1:
        raise ValueError(f"gpus_per_host must be at least 1, got {gpus_per_host}")
    groups: dict[tuple[int, int, int], list[int]] = {}
    for s in shards:
        groups.setdefault((s.col_offset, s.cols, s.rank // gpus_per_host), []).append(s.rank)
    group_of = {r: tuple(sorted(ranks)) for ranks in groups.values() if len(ranks) > 1
                for r in ranks}
    return HostGroups(gpus_per_host, group_of) if group_of else None


def reducing_tables(tables: Sequence[ShardedEmbedding], skip: Container[int] = ()
                    ) -> dict[int, HostGroups]:
    """Index -> host groups of the listed tables that reduce in this exchange (none when
    :func:`host_reduce_enabled` is off), but for the indices in ``skip``: the unpooled
    tables whose owners return only their own ids' rows (:mod:`.owned_rows`), where each
    id's row comes from one owner and there is nothing to sum. The same on every rank:
    plan, rank ids and the tables' kinds."""
    if not any(m.host_groups is not None for m in tables) or not host_reduce_enabled():
        return {}
    return {i: m.host_groups for i, m in enumerate(tables)
            if m.host_groups is not None and i not in skip}


def reduce_in_hosts(tables: Sequence[ShardedEmbedding], reducing: dict[int, HostGroups],
                    partials: dict[int, torch.Tensor], rows_from: dict[int, list[int]], *,
                    rank: int, world: int, group: dist.ProcessGroup | None,
                    device: torch.device
                    ) -> tuple[dict[int, dict[int, torch.Tensor]], dict[torch.dtype, torch.Tensor]]:
    """Stage A: per table this rank aggregates for, ``{requester: the host group's summed
    [bags, cols] partial}``, differentiable into every owner's partial; and per dtype an
    empty slice of what stage A received (an *anchor*).

    Why anchors: a rank in no host group of a dtype receives nothing in stage A, and an
    output nothing reads never gets its backward, so that rank would skip the backward
    all-to-all the group members run (a collective mismatch). The caller concatenates
    the dtype's anchor into every stage-B exchange holding a reducing table of that dtype,
    on every rank: stage A's backward then runs on all ranks, and at the same point (after
    those exchanges' backward), adding no element to the wire.

    ``partials[i]``: this rank's pooled rows of table ``i``, every requester's bags in
    rank order (``rows_from[i][r]`` of requester ``r``). One ``all_to_all_single`` per
    dtype of the reducing tables, every rank in the same order (tables in list order,
    then requesters by rank, on both sides); ranks outside a host group exchange empty
    splits."""
    out: dict[int, dict[int, torch.Tensor]] = {}
    anchors: dict[torch.dtype, torch.Tensor] = {}
    dtypes: list[torch.dtype] = []
    for i in sorted(reducing):
        if tables[i].dtype not in dtypes:
            dtypes.append(tables[i].dtype)
    for dtype in dtypes:
        idx = [i for i in sorted(reducing) if tables[i].dtype == dtype]
        # the tables where this rank is in a reducing group (so it owns a shard)
        mine = [(i, reducing[i].group_of[rank]) for i in idx if rank in reducing[i].group_of]
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        send_len, recv_len = [0] * world, [0] * world
        own: dict[tuple[int, int], torch.Tensor] = {}  # (table, requester) -> own piece
        for i, g in mine:
            cols = tables[i].local.cols
            parts = partials[i].split(rows_from[i])
            for r in range(world):
                a = reducing[i].aggregator(g, r)
                if a == rank:
                    own[i, r] = parts[r]
                else:
                    send[a].append(parts[r].reshape(-1))
                    send_len[a] += rows_from[i][r] * cols
        # what arrives, in the senders' order: per source, tables, then requesters
        arriving: list[tuple[int, int, int, int]] = []  # (source, table, requester, rows)
        from_src: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for i, g in mine:
            for src in g:
                if src != rank:
                    from_src.setdefault(src, []).append((i, g))
        for src in sorted(from_src):
            for i, g in from_src[src]:
                for r in aggregated_by(g, reducing[i].gpus_per_host, world, rank):
                    arriving.append((src, i, r, rows_from[i][r]))
                    recv_len[src] += rows_from[i][r] * tables[i].local.cols
        flat = torch.cat([p for to in send for p in to]) if any(send) else torch.empty(
            0, dtype=dtype, device=device)
        got = autograd_all_to_all(flat, recv_len, send_len, group)
        anchors[dtype] = got.narrow(0, 0, 0)
        pieces = got.split([n * tables[i].local.cols for _, i, _, n in arriving])
        by_owner: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {
            key: [(rank, piece)] for key, piece in own.items()}
        for (src, i, r, n), piece in zip(arriving, pieces):
            by_owner[i, r].append((src, piece.view(n, tables[i].local.cols)))
        for (i, r), held in by_owner.items():
            held.sort(key=lambda t: t[0])  # the group's rank order, on every aggregator
            total = held[0][1]
            for _, piece in held[1:]:
                total = total + piece
            out.setdefault(i, {})[r] = total
    return out, anchors

"""One id/pooled-row exchange for any number of sharded tables.

Why batched: a routed lookup of one table needs a sizes exchange (a host sync), an id
all-to-all and a pooled-row all-to-all forward plus one backward. Done per table, a model
with hundreds of tables pays hundreds of collectives and host syncs a step, each a
latency-bound message. :func:`exchange_lookups` routes every table of a list in one go, as
TorchRec's input/output distribution does for a KeyedJaggedTensor:

1. routing on the device: each table's ids sorted by the row range holding them; every
   table's range sizes come to the host in one copy;
2. headers: one ``all_to_all_single`` carrying, per destination, the payload length and for
   every listed table that destination owns a shard of its ids, bags and per-sample-weight
   kind (read on the host: the second and last sync);
3. payload: one int64 ``all_to_all_single`` carrying per table the per-bag id counts, the
   shard-local ids and the per-sample weights (their bits: fp32 as int32, fp64 as int64, so
   they travel exactly);
4. each owner pools, per table it owns, every requester's bags: the tables on the owners'
   fused route (gemc.table_lookup.sharded_route) all at once in the rank's batched kernel
   (:mod:`.owner_lookup`: the optimizer applied in its backward, no gradient tensor), any
   other in one ``F.embedding_bag(mode="sum", sparse=True)`` on its shard;
5. pooled partials: one differentiable ``all_to_all_single`` per table dtype and wire
   precision (requester major, tables in list order); its backward carries every table's
   gradient back at once. The plan's exchange precision (``ShardedEmbedding.exchange``,
   gemc.exchange_precision) sends them bf16, or fp8 with a scale per pooled row (a row:
   one bag's columns of one table's shard), cast back on arrival: the partials and their
   gradients keep their shapes and dtype. On several hosts, a table's row shards first
   sum their partials inside each host (:mod:`.host_reduce`: one more differentiable
   ``all_to_all_single`` per table dtype, exact, before any wire rounding), and only each
   host group's aggregator sends the requester a block: one per host group, not one per
   owner, crosses hosts.

The requester adds each owner's partial into its columns (row-wise shards add, column-wise
fill disjoint columns) and divides ``mean`` bags by their length. An unpooled table split
by rows (``Bags.owned_rows``) is the exception (:mod:`.owned_rows`): its owners get the ids
alone and return one row per id they own, no partial for the others, and the requester
lays the rows back in id order; such a table skips the in-host sum. Every rank must pass the
same tables in the same order (the collectives pair up by order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gemc.backends.torch.comm import RowLayout, all_to_all, autograd_all_to_all
from gemc.backends.torch.host_reduce import reduce_in_hosts, reducing_tables
from gemc.backends.torch.owned_rows import OWNED_ROWS, place_rows

from gemc.exchange_precision import WirePrecision

if TYPE_CHECKING:  # the module imports this one
    from gemc.backends.torch.embedding import ShardedEmbedding

HEADER = 3  # per (destination, table): ids, bags, per-sample-weight kind
_NO_WEIGHTS, _FP32_BITS, _FP64_BITS = 0, 1, 2


@dataclass
class Bags:
    """One table's lookups of this rank's batch, routable: padding ids removed."""

    ids: torch.Tensor  # int64 global row ids
    bag: torch.Tensor  # the bag of each id
    batch: int  # bags
    weights: torch.Tensor | None  # per-sample weights, or None
    lengths: torch.Tensor  # ids per bag (the divisor of mean pooling)
    # an unpooled row-split table: each owner returns only its ids' rows (.owned_rows)
    owned_rows: bool = False


def _weight_bits(w: torch.Tensor) -> tuple[int, torch.Tensor]:
    if w.dtype == torch.float64:
        return _FP64_BITS, w.view(torch.int64)
    return _FP32_BITS, w.to(torch.float32).view(torch.int32).to(torch.int64)


def _weights_from_bits(kind: int, bits: torch.Tensor) -> torch.Tensor:
    if kind == _FP64_BITS:
        return bits.view(torch.float64)
    return bits.to(torch.int32).view(torch.float32)


def weights_or_ones(parts: Sequence[tuple[torch.Tensor | None, int]], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor | None:
    """One per-sample weight per id over ``parts`` (each its weights or None, and its id
    count) in ``dtype``, ones where a part has none; None when no part has any. Why ones:
    a lookup pools several requesters' (or tables') bags at once, and ``embedding_bag``
    takes weights for all its ids or none."""
    if all(w is None for w, _ in parts):
        return None
    return torch.cat([w.to(dtype) if w is not None else torch.ones(n, dtype=dtype, device=device)
                      for w, n in parts])


def _row_groups(m: ShardedEmbedding, device: torch.device
                ) -> tuple[list[tuple[int, int, list[int]]], torch.Tensor | None]:
    """The table's row ranges (row offset, rows, owners), by offset, and the ranges' first
    rows after the first on ``device`` (None for one range). The ranges partition the rows;
    column-wise and grid shards give one range several owners. Kept on the module: the
    shards never change, and a host-to-device copy per table and step would add up."""
    cached = m.route_cache.get(device)
    if cached is None:
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, shard in sorted(m.owners.items()):
            groups.setdefault((shard.row_offset, shard.rows), []).append(rank)
        ranges = [(r0, n, owners) for (r0, n), owners in sorted(groups.items())]
        starts = (torch.tensor([r0 for r0, _, _ in ranges[1:]], dtype=torch.int64,
                               device=device) if len(ranges) > 1 else None)
        cached = m.route_cache[device] = (ranges, starts)
    return cached


@dataclass
class Placement:
    """Where an owned-rows table's ids went (:mod:`.owned_rows`): the sort by row range
    (None: one range) and per owner ``(first, ids, row offset)`` in that sort."""

    order: torch.Tensor | None
    per_dest: dict[int, tuple[int, int, int]]


def route(tables: Sequence[ShardedEmbedding], bags: Sequence[Bags], world: int
          ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Per destination: the header (ids, bags, weight kind of each listed table it owns)
    and the body (per table: per-bag id counts, shard-local ids, weight bits; an
    owned-rows table, :mod:`.owned_rows`: the ids alone, its header ``(ids, ids,
    OWNED_ROWS)``). Public: the cost model's id-traffic price is tested against what it
    sends (``tests/cost_model/test_id_exchange_pricing.py``).

    Ids are sorted by row range on the device and every table's range sizes come to the
    host in one copy: one device sync for all tables (a boolean mask per table and owner
    would sync once each)."""
    headers, bodies, _ = route_placed(tables, bags, world)
    return headers, bodies


def route_placed(tables: Sequence[ShardedEmbedding], bags: Sequence[Bags], world: int
           ) -> tuple[list[list[int]], list[list[torch.Tensor]], dict[int, Placement]]:
    """:func:`route`, and the placements of the owned-rows tables (by table index): what the
    requester needs to lay their rows back in id order (:func:`.owned_rows.place_rows`).
    Public: the owned-rows test checks the routing and the laying back together."""
    sorted_by_range, range_counts = [], []
    for m, b in zip(tables, bags):
        groups, starts = _row_groups(m, b.ids.device)
        if starts is None:
            which = torch.zeros_like(b.ids)
            order = None
        else:
            which = torch.bucketize(b.ids, starts, right=True)
            order = torch.argsort(which, stable=True)
        range_counts.append(torch.zeros(len(groups), dtype=torch.int64, device=b.ids.device)
                            .index_add_(0, which, torch.ones_like(which)))
        sorted_by_range.append((groups, order))
    sizes = torch.cat(range_counts).cpu().tolist() if range_counts else []
    headers: list[list[int]] = [[] for _ in range(world)]
    bodies: list[list[torch.Tensor]] = [[] for _ in range(world)]
    placements: dict[int, Placement] = {}
    at_size = 0
    for i, (b, (groups, order)) in enumerate(zip(bags, sorted_by_range)):
        ids, bag, w = b.ids, b.bag, b.weights
        if order is not None:
            ids, bag = ids[order], bag[order]
            w = None if w is None else w[order]
        start = 0
        per_dest: dict[int, tuple[int, int, int]] = {}
        for r0, _, owners in groups:
            n = int(sizes[at_size])
            at_size += 1
            for dest in owners:
                per_dest[dest] = (start, n, r0)
            start += n
        if b.owned_rows:
            placements[i] = Placement(order, per_dest)
        for dest in sorted(per_dest):  # the owners' order every rank agrees on
            first, n, r0 = per_dest[dest]
            if b.owned_rows:  # one row back per id: no counts (no weights: unpooled)
                bodies[dest].append(ids[first:first + n] - r0)
                headers[dest] += [n, n, OWNED_ROWS]
                continue
            piece_bag = bag[first:first + n]
            counts = torch.zeros(b.batch, dtype=torch.int64, device=ids.device).index_add_(
                0, piece_bag, torch.ones_like(piece_bag))
            bodies[dest] += [counts, ids[first:first + n] - r0]
            kind = _NO_WEIGHTS
            if w is not None:
                kind, bits = _weight_bits(w[first:first + n])
                bodies[dest].append(bits)
            headers[dest] += [n, b.batch, kind]
    return headers, bodies, placements


def _exchange_groups(tables: Sequence[ShardedEmbedding]
                     ) -> list[tuple[torch.dtype, WirePrecision]]:
    """The (dtype, wire precision) pairs of the tables, in first-seen order: one pooled
    exchange each (every rank lists the same tables, so the same groups)."""
    seen: list[tuple[torch.dtype, WirePrecision]] = []
    for m in tables:
        if (m.dtype, m.exchange) not in seen:
            seen.append((m.dtype, m.exchange))
    return seen


def _widths(blocks: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Row widths of ``(rows, cols)`` blocks laid one after the other (the row count
    given: no device sync)."""
    if not blocks:
        return torch.empty(0, dtype=torch.int64, device=device)
    sizes = torch.tensor(blocks, dtype=torch.int64, device=device)
    return torch.repeat_interleave(sizes[:, 1], sizes[:, 0],
                                   output_size=sum(n for n, _ in blocks))


def exchange_lookups(tables: Sequence[ShardedEmbedding], bags: Sequence[Bags], *,
                     world: int, group: dist.ProcessGroup | None = None
                     ) -> list[torch.Tensor]:
    """The pooled ``[batch, dim]`` output of each table for this rank's bags (sum-pooled,
    or mean where the table pools by mean), differentiable into the owners' shards."""
    rank = tables[0].rank
    device = bags[0].ids.device
    # 1-3. ids to their owners: the headers with the payload sizes, then the payloads
    headers, bodies, placements = route_placed(tables, bags, world)
    owned = [i for i, m in enumerate(tables) if rank in m.owners]
    head_in = [1 + len(h) for h in headers]  # body length + header, per destination
    bodies_cat = [torch.cat(b) if b else torch.empty(0, dtype=torch.int64, device=device)
                  for b in bodies]
    heads_sent = torch.tensor([v for d in range(world) for v in (bodies_cat[d].numel(),
                                                                   *headers[d])],
                              dtype=torch.int64, device=device)
    head_out = [1 + HEADER * len(owned)] * world
    heads_got = all_to_all(heads_sent, head_out, head_in, group).view(world, -1).cpu().tolist()
    recv_lens = [row[0] for row in heads_got]
    heads = [[row[1 + HEADER * k:1 + HEADER * (k + 1)] for k in range(len(owned))]
             for row in heads_got]
    send_lens = [int(b.numel()) for b in bodies_cat]
    recv = all_to_all(torch.cat(bodies_cat), recv_lens, send_lens, group)

    # 4. pool this rank's shards of every requester's bags
    partials: dict[int, torch.Tensor] = {}  # table index -> [sum of requesters' bags, cols]
    rows_from: dict[int, list[int]] = {i: [] for i in owned}  # bags per requester
    per_table: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], list]] = {
        i: ([], [], []) for i in owned}
    for src, piece in enumerate(recv.split(recv_lens)):
        at = 0  # each requester's body: its tables in list order
        for slot, i in enumerate(owned):
            n_ids, n_bags, kind = heads[src][slot]
            weights = None
            if kind == OWNED_ROWS:  # a bag of one per id (.owned_rows)
                counts = torch.ones(n_ids, dtype=torch.int64, device=device)
                ids = piece[at:at + n_ids]
                at += n_ids
            else:
                counts, ids = piece[at:at + n_bags], piece[at + n_bags:at + n_bags + n_ids]
                at += n_bags + n_ids
            if kind not in (_NO_WEIGHTS, OWNED_ROWS):
                weights = _weights_from_bits(kind, piece[at:at + n_ids])
                at += n_ids
            per_table[i][0].append(counts)
            per_table[i][1].append(ids)
            per_table[i][2].append((weights, n_ids))
            rows_from[i].append(n_bags)
    fused: list[tuple[int, tuple]] = []  # the owners' fused lookups (.owner_lookup)
    for i in owned:
        m = tables[i]
        counts_l, ids_l, weights_l = per_table[i]
        counts = torch.cat(counts_l)
        psw = weights_or_ones(weights_l, m.dtype, device)
        if m.owner_lookup is not None:  # fp32 tables only (gemc.table_lookup.sharded_route)
            fused.append((i, (m, torch.cat(ids_l), counts, psw)))
            continue
        weight, ids = m.rows_for_lookup(torch.cat(ids_l))  # bf16 / fp8: dequantised rows
        partials[i] = F.embedding_bag(
            ids, weight,
            torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]),
            mode="sum", sparse=True, per_sample_weights=psw, include_last_offset=True)
    if fused:  # one launch per fused module and bag count, every such table at once
        pooled = fused[0][1][0].owner_lookup.pool([request for _, request in fused])
        for (i, _), part in zip(fused, pooled):
            partials[i] = part.to(tables[i].dtype)

    # 5a. row shards' partials summed inside each host (.host_reduce), all tables at once
    reducing = reducing_tables(tables, skip=placements)  # owned rows: nothing to sum
    summed, anchors = (reduce_in_hosts(tables, reducing, partials, rows_from, rank=rank,
                                       world=world, group=group, device=device)
                       if reducing else ({}, {}))

    def sends(i: int, owner: int, requester: int) -> bool:  # a block of table i in step 5
        return i not in reducing or reducing[i].sends(owner, requester)

    # 5. partials back to the requesters, one exchange per table dtype and wire precision
    outs: list[torch.Tensor | None] = [None] * len(tables)
    for dtype, wire in _exchange_groups(tables):
        in_group = [i for i, m in enumerate(tables) if (m.dtype, m.exchange) == (dtype, wire)]
        mine = [i for i in in_group if i in partials]
        split_rows = {i: partials[i].split(rows_from[i]) for i in mine}
        blocks = [(src, i) for src in range(world) for i in mine if sends(i, rank, src)]
        flat_parts = [(summed[i][src] if i in summed and src in summed[i]
                       else split_rows[i][src]).reshape(-1) for src, i in blocks]
        back_in, sent_rows = [0] * world, [0] * world  # elements and rows to each rank
        for src, i in blocks:
            back_in[src] += rows_from[i][src] * tables[i].local.cols
            sent_rows[src] += rows_from[i][src]
        if dtype in anchors and any(i in reducing for i in in_group):
            flat_parts.append(anchors[dtype])  # no element: see reduce_in_hosts
        flat = (torch.cat(flat_parts) if flat_parts
                else torch.empty(0, dtype=dtype, device=device))
        pairs = [(d, i) for d in range(world) for i in in_group
                 if d in tables[i].owners and sends(i, d, rank)]
        # rows each (owner, table) returns: a row per bag, or per id it owns (.owned_rows)
        n_rows = [placements[i].per_dest[d][1] if i in placements else bags[i].batch
                  for d, i in pairs]
        back_out, got_rows = [0] * world, [0] * world  # elements and rows from each rank
        for (d, i), n in zip(pairs, n_rows):
            back_out[d] += n * tables[i].owners[d].cols
            got_rows[d] += n
        rows = None
        if "fp8" in (wire.forward, wire.backward):  # a scale per pooled row: their widths
            sent = [(rows_from[i][src], tables[i].local.cols) for src, i in blocks]
            got = [(n, tables[i].owners[d].cols) for (d, i), n in zip(pairs, n_rows)]
            rows = RowLayout(_widths(sent, device), sent_rows, _widths(got, device), got_rows)
        returned = autograd_all_to_all(flat, back_out, back_in, group, precision=wire,
                                       rows=rows)
        # one split into every (owner, table) chunk: its backward concatenates the chunks'
        # gradients once (a slice per chunk would build a full-size gradient per slice)
        chunks = returned.split([n * tables[i].owners[d].cols
                                 for (d, i), n in zip(pairs, n_rows)])
        owned_chunks: dict[int, dict[int, torch.Tensor]] = {}
        for (d, i), n, chunk in zip(pairs, n_rows, chunks):
            shard, m, b = tables[i].owners[d], tables[i], bags[i]
            chunk = chunk.view(n, shard.cols)
            if i in placements:  # laid out in id order below, once every owner's is in
                owned_chunks.setdefault(i, {})[d] = chunk
                continue
            if shard.cols != m.embedding_dim:
                chunk = F.pad(chunk, (shard.col_offset,
                                      m.embedding_dim - shard.col_offset - shard.cols))
            outs[i] = chunk if outs[i] is None else outs[i] + chunk
        for i, got_chunks in owned_chunks.items():
            p = placements[i]
            outs[i] = place_rows(got_chunks, p.per_dest,
                                 {d: tables[i].owners[d].col_offset for d in got_chunks},
                                 p.order, bags[i].bag, bags[i].batch)
    result = []
    for m, b, out in zip(tables, bags, outs):
        assert out is not None  # every routed table has an owner
        if m.mode == "mean":
            out = out / b.lengths.clamp(min=1).unsqueeze(1).to(out.dtype)
        result.append(out)
    return result

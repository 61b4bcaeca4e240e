"""Predicted time of one training step of a sharded plan, per rank and overall.

    step = max_r sparse_compute_r + all-to-all (forward output dist + backward grad dist)
         + dense forward + exposed forward comm + dense backward + exposed backward comm
         + TP comm (on the critical path) + the replicas' one all-reduce + max_r optimizer_r

All-to-all is a barrier, so the slowest rank's embedding work sets when it can start.
Exposed comm is what overlap cannot hide: gradient all-reduce / reduce-scatter runs beside
the backward and hides up to ``overlap`` x backward compute, but never its last bucket;
FSDP's parameter all-gathers are prefetched behind the forward the same way, never the
first. Sparse input dist (ids) is hidden by a pipelined loader (TorchRec's
TrainPipelineSparseDist) when ``pipeline_sparse``.

The pooled all-to-all moves its rows at the plan's exchange precision
(``StepOptions.exchange``, gemc.exchange_precision): fewer bytes, plus the casts to and
from the wire (their HBM bytes in the shard holders' sparse compute, their launches as
``exchange_cast``).

MFU = 3 x sum of regions' forward FLOPs (per rank) / (peak BF16 x step) — model FLOPs,
recomputation not counted (PaLM's definition, Chowdhery et al. 2022).

Pure and fast (no fx): the solver calls it in its inner loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, replace
from functools import lru_cache

import numpy as np

from gemc.exchange_precision import (
    CAST_BYTES_PER_ELEMENT,
    CAST_KERNELS,
    FP32_WIRE,
    WirePrecision,
    casts,
    wire_row_bytes,
)
from gemc.sharding import SHARDINGS, dense_strategy
from gemc.table_lookup import BATCHED, DENSE_GRAD, SPARSE, routed_as_sharded

from .calibration import Calibration
from .collectives import collective_time
from .hardware import GPUSpec
from .kernels import (
    INDEX_BYTES,
    REPLICA_BUCKET_KERNELS,
    SHARD_STEP_FLOOR_S,
    replica_bucket_bytes,
)
from .memory import (
    MemoryBreakdown,
    lookup_gradient_extra,
    rank_memory,
    shard_degree,
    shard_memory,
    shard_shape,
    table_grad_bytes,
    table_memory,
)
from .op_cost import (
    DEFAULT_KERNEL_LAUNCH_S,
    ROOFLINE_EFFICIENCY,
    ROUTED_LOOKUP_S,
    batched_embedding_time,
    eager_table_time,
    embedding_time,
    optimizer_time,
)
from .topology import Topology
from .types import RankStats, RegionCost, StepOptions, StepPrediction, TableCost


def late_gradient_peak(landing: list[tuple[float, float]]) -> float:
    """Largest saved activations + table-sized gradients live at once in the backward:
    ``landing`` holds, per dense_grad lookup, the saved bytes still live when its
    backward runs and the gradient it allocates, which lives on to the end of the
    backward (a table's lookups are summed there). The backward meets them in order of
    falling live activations. Why: HSTU's target and negative lookups are read at the
    loss, so their 2 GB gradients come while every activation is still saved; priced
    in the room the activations leave at the end, its peak came to 8.2 GB against
    17.3 GB measured."""
    peak = grads = 0.0
    for alive, nbytes in sorted(landing, reverse=True):
        grads += nbytes
        peak = max(peak, alive + grads)
    return peak


@lru_cache(maxsize=1 << 16)
def _batched_cost(rows: int, dim: int, lookups: int, bags: int, dtype: str, gpu: GPUSpec,
                  calibration: Calibration | None, optimizer: str | None,
                  storage_bytes: float | None = None, split_squares: bool = False) -> float:
    return batched_embedding_time(rows, dim, lookups, bags, dtype, gpu, calibration, optimizer,
                                  storage_bytes, split_squares)


@lru_cache(maxsize=1 << 16)
def _embedding_cost(rows: int, dim: int, lookups: int, bags: int, dtype: str, gpu: GPUSpec,
                    calibration: Calibration | None, optimizer: str | None,
                    dense_grad: bool) -> float:
    fwd, bwd, _ = embedding_time(rows, dim, lookups, bags, dtype, gpu, calibration,
                                 dense_grad=dense_grad, optimizer=optimizer)
    return fwd + bwd


@lru_cache(maxsize=1 << 16)
def _eager_cost(path: str, rows: int, dim: int, lookups: int, bags: int, calls: int,
                dtype: str, gpu: GPUSpec, calibration: Calibration | None,
                optimizer: str | None, storage_bytes: float | None = None,
                replicas: int = 1, hot_ids: float = 0.0) -> float:
    return sum(eager_table_time(path, rows, dim, lookups, bags, calls, dtype, gpu,
                                calibration, optimizer, storage_bytes, replicas, hot_ids))


def _dtype(elt: int) -> str:
    return {1: "fp8", 2: "bf16"}.get(elt, "fp32")


def shard_work(t: TableCost, rows: float, dim: float,
               world: int) -> tuple[float, float, float, float]:
    """(rows, dim, lookups, bags) of the lookup a shard of ``rows`` x ``dim`` computes.

    A data-parallel table looks up its rank's local batch. A sharded one serves the
    world's batch: a row shard sees only the ids in its row range (``rows / t.rows`` of
    them). Pooled, it still writes a partial sum for every bag of the world; unpooled, each
    id is its own output row, so it writes (and gets gradients for) only the rows of the
    ids it owns -- the same ``output_share`` that sizes its all-to-all and activations."""
    if rows == 0:
        return 0.0, 0.0, 0.0, 0.0
    if t.replicated:
        return rows, dim, float(t.nnz), float(t.batch)
    share = rows / t.rows  # row-sharded shards see their share of the ids
    return rows, dim, world * t.nnz * share, world * t.batch * t.output_share(rows)


def shard_compute_s(t: TableCost, rows: float, dim: float, world: int, gpu: GPUSpec,
                    calibration: Calibration | None, optimizer: str | None) -> float:
    """Forward + backward seconds of the lookup of a shard of ``rows`` x ``dim`` (0 for
    none), by the path the runner runs it on (``t.lookup``, gemc.table_lookup): its share
    of the rank's batched lookup kernel with the fused backward applying ``optimizer`` to
    the touched rows (op_cost.batched_embedding_time); or eager lookups with a sparse or
    table-sized gradient and the sparse optimizer's step of the touched rows
    (op_cost.eager_table_time, optimizer included: ``optimizer``, for a data-parallel
    replica the step's ``table_optimizer``). A data-parallel table priced ``batched`` on
    several ranks (no plan's rule gives that; a TableCost made by hand) keeps eager's dense
    gradient, its optimizer priced with the dense parameters'. The one embedding price of
    predict_step and of the solver.

    On the batched path this is the shard's bytes only: the fixed cost of the rank's
    batched kernel (``kernels.SHARD_STEP_FLOOR_S``) is paid once per rank, not per shard
    (:func:`batched_floor_s`)."""
    rows, dim, lookups, bags = shard_work(t, rows, dim, world)
    if rows == 0:
        return 0.0
    dtype = _dtype(t.dtype_bytes)
    storage = None if t.precision == "fp32" else t.storage_bytes
    if t.lookup != BATCHED:
        replicas = world if t.replicated else 1
        # every rank's padding ids reach a sharded table (priced on each holder: the pad
        # row's holder is not known)
        hot = t.hot_ids * (1 if t.replicated else world)
        if t.lookup != SPARSE and t.pooled:  # ATen's bag backward sorts: no atomic chain
            hot = 0.0
        routed = 0.0
        if t.lookup == SPARSE:  # host time the sparse lookups add: graph splits, syncs
            # (a replica's fp32 lookup is local: padded_lookup keeps the ids, no mask)
            masked = t.padding_row and ((world > 1 and not t.replicated)
                                        or t.precision != "fp32")
            routed = max(1, t.lookups) * (ROUTED_LOOKUP_S * t.routed
                                          + StepOptions.host_sync_s * masked)
        return routed + _eager_cost(t.lookup, max(1, int(rows)), max(1, int(dim)),
                                    int(lookups), int(bags), max(1, t.lookups), dtype, gpu,
                                    calibration, optimizer or StepOptions.table_optimizer,
                                    storage, replicas, hot)
    if t.replicated and world > 1:
        return _embedding_cost(t.rows, t.dim, t.nnz, t.batch, dtype, gpu, calibration, None,
                               True)
    split_squares = (optimizer == "rowwise_adagrad" and world > 1
                     and SHARDINGS[t.sharding].split in ("columns", "grid"))
    return _batched_cost(max(1, int(rows)), max(1, int(dim)), int(lookups), int(bags), dtype,
                         gpu, calibration, optimizer, storage, split_squares)


def column_squares_s(t: TableCost, world: int, topology: Topology,
                     calibration: Calibration | None, optimizer: str | None) -> float:
    """Seconds each holder of a column shard under row-wise Adagrad waits a step for its
    column group's all-reduce of the touched rows' squares (one fp32 a looked-up id: the
    fused kernel's two-phase update, ``BatchedEmbeddingBag.split_rows``; 0 for any other
    table). The group is priced as ranks ``0..group-1`` (inside a host when it fits one),
    in the solver's options and here alike: an option is priced before it is placed, and
    both must agree. Exposed: the runner sums the squares in the optimizer's step, after
    the backward."""
    kind = SHARDINGS[t.sharding]
    if world <= 1 or optimizer != "rowwise_adagrad" or t.lookup != BATCHED \
            or kind.split not in ("columns", "grid"):
        return 0.0
    # a rank holding two pieces of a row is one member of its group (the runner's groups
    # are sets of ranks): never more members than ranks
    ranks = t.ranks or tuple(range(world))
    group = min(kind.column_blocks(len(ranks)), len(set(ranks)), world)
    if group < 2:
        return 0.0
    _, _, lookups, _ = shard_work(t, *shard_shape(t), world)
    if lookups <= 0:
        return 0.0
    return _squares_all_reduce_s(4.0 * lookups, group, topology, calibration)


@lru_cache(maxsize=1 << 12)
def _squares_all_reduce_s(nbytes: float, group: int, topology: Topology,
                          calibration: Calibration | None) -> float:
    return collective_time("all_reduce", nbytes, range(group), topology,
                           calibration=calibration)


def replica_compute_s(t: TableCost, world: int, gpu: GPUSpec,
                      calibration: Calibration | None, table_optimizer: str) -> float:
    """:func:`shard_compute_s` of a data-parallel replica on ``world`` ranks: the step's
    ``table_optimizer`` on the sparse optimizer's paths (on several ranks its bucketed
    step); priced ``batched`` on several ranks, its optimizer is the dense one's."""
    optimizer = None if t.lookup == BATCHED and world > 1 else table_optimizer
    return shard_compute_s(t, *shard_shape(t), world, gpu, calibration, optimizer)


def replica_dense_numel(t: TableCost) -> float:
    """Elements a data-parallel table on several ranks puts in the dense optimizer: none
    when the sparse optimizer steps it (every lookup path but ``batched``: its bucketed
    step, in :func:`shard_compute_s`), the table when priced ``batched`` (a TableCost made
    by hand: no plan's rule gives that)."""
    return 0.0 if t.lookup != BATCHED else float(t.rows) * t.dim


def replica_all_reduce_s(nbytes: float, topology: Topology,
                         calibration: Calibration | None) -> float:
    """Seconds of a step's ONE all-reduce of every data-parallel replica's gradient and
    used-row flags (``nbytes``: the sum of their ``kernels.replica_bucket_bytes``) and of
    the bucket's once-a-step kernels (zero-fill, division: ``REPLICA_BUCKET_KERNELS``):
    one collective latency a step however many replicas, each replica adding its bytes.
    Exposed whole: the runner reduces the bucket in the embedding optimizer's step, after
    the backward (the replicas' gradients are complete only when the lookups' backward,
    the graph's last, has run). Why bucketed: per table, two all-reduces and a host sync
    cost >= 0.23 ms a replica a rank at 16 ranks; TorchRec and DDP bucket them."""
    if nbytes <= 0 or topology.world_size == 1:
        return 0.0
    launch = calibration.kernel_s if calibration is not None else DEFAULT_KERNEL_LAUNCH_S
    return collective_time("all_reduce", nbytes, range(topology.world_size), topology,
                           calibration=calibration) + REPLICA_BUCKET_KERNELS * launch


def routed_tables(tables: Sequence[TableCost], world: int,
                  optimizer: str) -> list[TableCost]:
    """``tables`` each on the route the runner runs it on as sharded
    (gemc.table_lookup.routed_as_sharded: on several ranks the owners' fused lookup, or the
    sparse route for a replica, a table looked up more than once or held in a dtype other
    than fp32; on one rank the path given). What :func:`predict_step` prices, and
    the solver's options (``gemc.solver.candidates``) by the same rule."""
    return [replace(t, lookup=routed_as_sharded(t.lookup, t.sharding, world_size=world,
                                                optimizer=optimizer, lookups=t.lookups,
                                                fp32=t.dtype_bytes == 4))
            for t in tables]


def in_batched_kernel(t: TableCost, world: int) -> bool:
    """Whether ``t``'s shards run in their rank's batched lookup kernel (priced by
    ``_batched_cost``), the kernel whose fixed cost :func:`batched_floor_s` adds: the
    batched path, and not a data-parallel replica on several ranks (priced with eager's
    dense gradient, :func:`shard_compute_s`)."""
    return t.lookup == BATCHED and not (t.replicated and world > 1)


def batched_floor_s(kernel_s: np.ndarray, shards: np.ndarray, world: int) -> np.ndarray:
    """Seconds each rank's batched lookup kernel adds above its shards' bytes
    (``kernel_s``: the sum of their :func:`shard_compute_s`; ``shards``: how many it runs):
    the kernel costs at least ``kernels.SHARD_STEP_FLOOR_S``, so a rank whose shards' bytes
    are priced below it pays the difference.

    Why per rank and not per shard: every shard a rank holds on the batched path runs in
    the same kernel (one forward launch, one sort of every table's ids, one fused
    backward+update launch: ``backends.triton.embedding_bag.BatchedEmbeddingBag``, as
    TorchRec's TBE), so what a step costs whatever its bytes is paid once per launch group,
    and the shards' bytes add inside it. Measured on the H200 (fifteenth session,
    ``benchmarks/kernels.py --cases narrow_group``, 16-wide shards, pooling 100, lookup +
    backward + row-wise Adagrad): one launch of 1, 2, 4 and 8 shards took 1.20, 1.33, 1.32
    and 2.54 ms, against 1.21, 2.44, 5.07 and 10.59 ms for a launch per shard. So one floor
    per rank holds to 4 shards; at 8 the launch costs two, which this still prices as one.
    Charged per shard, a rank
    holding ten pieces paid ten floors (8.6 ms) for one launch group, and the balance
    search's splits of big tables looked 5% dearer than they are.

    Only on several ranks (:func:`batched_kernel_floor_s`)."""
    floor = batched_kernel_floor_s(world)
    return np.where(shards > 0, np.maximum(0.0, floor - kernel_s), 0.0)


def batched_kernel_floor_s(world: int) -> float:
    """The least seconds a rank's batched lookup kernel costs a step (see
    :func:`batched_floor_s`): ``kernels.SHARD_STEP_FLOOR_S`` on several ranks, 0 on one.
    Why not on one: the one-GPU plans were checked against their runs priced by bytes
    alone (BENCHMARKS.md: 7 of 8 within 11.5%), so the unmeasured per-kernel term is kept
    out of them; whether a compiled one-GPU step hides the kernel's fixed cost (its host
    running ahead, with no exchange to wait for) is not measured either."""
    return SHARD_STEP_FLOOR_S if world > 1 else 0.0


def exchange_row_bytes(t: TableCost, cols: float, wire: WirePrecision) -> float:
    """Bytes one pooled row of ``cols`` columns takes on the wire, the forward's and the
    backward's mean: the all-to-all is priced as twice one exchange of these bytes (exact
    when both directions shrink rows alike, as fp32 and bf16 do; fp8's row scale makes the
    two directions' ratio depend on the width, a few bytes a row)."""
    return 0.5 * (wire_row_bytes(wire.forward, cols, t.dtype_bytes)
                  + wire_row_bytes(wire.backward, cols, t.dtype_bytes))


def exchange_cast_s(t: TableCost, rows: float, dim: float, world: int, gpu: GPUSpec,
                    calibration: Calibration | None, wire: WirePrecision,
                    summed_by: int = 1) -> float:
    """HBM seconds of casting to the wire and back what a shard of ``rows`` x ``dim``
    sends a step (its pooled rows forward, their gradients backward; both ends). The
    requesters' half runs on them, spread over every rank; it is charged to the shard's
    holder, which keeps each plan's total and lets the planners price it per table. The
    kernels' launches are one set a step (:func:`exchange_cast_launch_s`). ``summed_by``:
    the owners whose partials are summed in their host before the wire
    (:func:`host_reduce_owners`): only the sums are cast, each holder 1/``summed_by``."""
    if rows == 0 or t.replicated:
        return 0.0
    per_element = sum(CAST_BYTES_PER_ELEMENT[p] for p in (wire.forward, wire.backward)
                      if casts(p, t.dtype_bytes)) * t.dtype_bytes / 4
    if per_element == 0:
        return 0.0
    elements = world * t.batch * dim * t.output_share(rows) / max(1, summed_by)
    factor = calibration.factor("memory") if calibration is not None else 1.0
    return elements * per_element / (gpu.hbm_bandwidth * ROOFLINE_EFFICIENCY["memory"]) * factor


def host_reduce_owners(t: TableCost, gpus_per_host: int, world: int) -> int:
    """How many owners of one column range on one host sum a pooled row-split table's
    partials before they leave the host (1: none; the runner's in-host reduction,
    ``backends/torch/embedding_exchange``): the fewest a column block has on any host.

    Why: a row shard writes a partial sum for every bag of the world. Sent straight to the
    requesters, a table in 8 row shards on a host crosses hosts 8 times over; summed first
    over NVLink (each owner sums the requesters of its local index and sends them the sum,
    as TorchRec's table-row-wise sharding reduce-scatters), it crosses once. Unpooled
    shards return only their own rows, and column and whole-table shards one block each:
    nothing to sum; on one host (``world <= gpus_per_host``) nothing crosses, and the
    runner sends directly. A block's ranks are its consecutive entries of ``t.ranks`` (the
    order ``Sharding.shards`` cuts them in)."""
    if t.replicated or not t.pooled or gpus_per_host <= 1 or world <= gpus_per_host \
            or not SHARDINGS[t.sharding].row_split:
        return 1
    n = len(t.ranks)
    per_block = max(1, n // SHARDINGS[t.sharding].column_blocks(n))
    if per_block <= 1:
        return 1
    fewest = per_block
    for b in range(0, n, per_block):
        on_host: dict[int, int] = {}
        for r in t.ranks[b:b + per_block]:
            on_host[r // gpus_per_host] = on_host.get(r // gpus_per_host, 0) + 1
        fewest = min(fewest, *on_host.values())
    return fewest


def host_reduce_s(t: TableCost, rows: float, dim: float, world: int, topology: Topology,
                  calibration: Calibration | None) -> float:
    """Seconds a holder spends in the in-host sum of its partials (forward, and the
    gradients' fan-out back in the backward): an all-to-all among the ``k`` owners of its
    host (:func:`host_reduce_owners`), each sending its partial rows of the requesters
    the ``k - 1`` others sum, in the table's dtype (summed before any wire rounding)."""
    k = host_reduce_owners(t, topology.gpus_per_host, world)
    if k <= 1 or rows == 0:
        return 0.0
    send = (k - 1) / k * world * t.batch * dim * t.dtype_bytes
    return 2 * collective_time("all_to_all", 0, range(k), topology, send_bytes=[send] * k,
                               calibration=calibration)


def holder_exchange_s(t: TableCost, rows: float, dim: float, world: int, topology: Topology,
                      calibration: Calibration | None, wire: WirePrecision) -> float:
    """A holder's seconds around the pooled exchange besides the all-to-all itself: the
    casts to and from the wire and the in-host sum of row shards' partials."""
    k = host_reduce_owners(t, topology.gpus_per_host, world)
    return (exchange_cast_s(t, rows, dim, world, topology.gpu, calibration, wire, summed_by=k)
            + host_reduce_s(t, rows, dim, world, topology, calibration))


def pooled_send_bytes(t: TableCost, rows: float, dim: float, world: int,
                      wire: WirePrecision, gpus_per_host: int) -> float:
    """Bytes one holder of a shard of ``rows`` x ``dim`` sends in the pooled all-to-all
    (the mean of the forward's rows and the backward's gradients, :func:`exchange_row_bytes`):
    its rows of every other rank's bags, or, where its host sums the partials first
    (:func:`host_reduce_owners`), the sums of 1/k of them. The all-to-all's host term
    takes 1 - L/world of a rank's bytes across hosts; a summing owner sends nearly all of
    its own across (to the ranks of its local index), and ``(world - 1) / k`` rows a bag
    is what that share makes exact for the host links."""
    k = host_reduce_owners(t, gpus_per_host, world)
    return (world - 1) * t.batch * exchange_row_bytes(t, dim, wire) * t.output_share(rows) / k


def exchange_cast_launch_s(wire: WirePrecision, calibration: Calibration | None) -> float:
    """Launch gaps of the cast kernels of a step's exchange, forward and backward (0 at
    fp32): the runner casts each exchange's rows in one set of kernels, however many
    tables it carries."""
    launch = calibration.kernel_s if calibration is not None else DEFAULT_KERNEL_LAUNCH_S
    return (CAST_KERNELS[wire.forward] + CAST_KERNELS[wire.backward]) * launch


def _holders(t: TableCost, world: int) -> np.ndarray:
    """The ranks (inside the world) holding a shard of a sharded table, once per shard: a
    rank listed twice computes two shards (add with ``np.add.at``)."""
    return np.array(sorted(r for r in t.ranks if r < world), dtype=np.int64)


def id_send_bytes(t: TableCost, world: int) -> float:
    """Bytes each rank sends, on the mean, in the id all-to-all (input dist) for the
    sharded table ``t``: what the runner's exchange sends
    (backends/torch/embedding_exchange.py, ``_route``): each id, int64, to every owner of
    its row range -- one per column range (``Sharding.column_blocks``: a column-wise table
    over k distinct ranks gets every id k times, as each piece looks up the same rows for
    its own columns) -- and, to every holder, the per-bag id counts (int64, one per bag of
    the batch), but for an unpooled row-split table (:func:`owned_rows`), whose owners
    return one row per id they own and need no counts (backends/torch/owned_rows.py). Of
    the holders' copies, a holder keeps its own: ``1 - 1/world`` of the bytes leave a rank
    on the mean.

    A rank listed twice is one destination (the runner keys its sends by rank). Not
    counted: the headers' separate all-to-all (3 int64 per holder and table), and the
    per-sample weights of weighted bags (one int64 more per id copy; ``TableCost`` does
    not say which tables have them)."""
    holders = len({r for r in t.ranks if r < world})
    if t.replicated or holders == 0:
        return 0.0
    copies = min(SHARDINGS[t.sharding].column_blocks(len(t.ranks)), holders)
    counts = 0 if owned_rows(t) else holders * t.batch
    return (copies * t.nnz + counts) * INDEX_BYTES * (1 - 1 / max(world, 1))


def owned_rows(t: TableCost) -> bool:
    """Whether the runner's owners of ``t`` return only the rows of the ids they own (an
    unpooled table split by rows: backends/torch/owned_rows.py), the case where
    ``TableCost.output_share`` is a shard's share of the rows and no per-bag counts are
    sent."""
    return not t.pooled and SHARDINGS[t.sharding].row_split


def a2a_sends(tables: Sequence[TableCost], world: int,
               wire: WirePrecision = FP32_WIRE, gpus_per_host: int = 1
               ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank sends in the pooled-embedding all-to-all (the mean of the forward
    and the backward exchange at ``wire``, :func:`pooled_send_bytes`; ``gpus_per_host``
    places the in-host sums of row shards, 1 for none) and in the id all-to-all (input
    dist, :func:`id_send_bytes`).

    Linear in the ranks: every shard of a table is the same size (``shard_shape``), so a
    table's send is priced once and added to each holder."""
    out = np.zeros(world)
    ids = np.zeros(world)
    for t in tables:
        if t.replicated:
            continue
        holders = [r for r in t.ranks if r < world]  # a rank listed twice sends twice
        if holders:
            rows, dim = shard_shape(t)
            # a shard sends its pooled (partial, for row shards) rows to every other rank
            np.add.at(out, holders, pooled_send_bytes(t, rows, dim, world, wire,
                                                      gpus_per_host))
        ids += id_send_bytes(t, world)
    return out, ids


def dense_comm(region: RegionCost, topo: Topology, calibration: Calibration | None,
               options: StepOptions) -> dict[str, float]:
    """Seconds of the region's collectives on rank 0's groups: fwd (overlappable with
    forward), bwd (with backward), tp (critical path), and the minimal exposed tails."""
    world = topo.world_size
    out = {"fwd": 0.0, "bwd": 0.0, "tp": 0.0, "fwd_tail": 0.0, "bwd_tail": 0.0}
    if world == 1 or region.params == 0:
        return out
    grad_bytes = region.params * region.grad_bytes
    param_bytes = region.params * region.param_bytes

    def t(op: str, nbytes: float, ranks: Sequence[int] | range) -> float:
        return collective_time(op, nbytes, tuple(ranks), topo, calibration=calibration)

    comm = dense_strategy(region.strategy).comm
    if comm == "all_reduce":
        buckets = max(1, int(np.ceil(grad_bytes / options.ddp_bucket_bytes)))
        one = t("all_reduce", grad_bytes / buckets, range(world))
        out["bwd"] = buckets * one
        out["bwd_tail"] = one
    elif comm == "gather_scatter":
        g = min(shard_degree(region, world), world)
        group = range(g)
        ag = t("all_gather", param_bytes, group)
        rs = t("reduce_scatter", grad_bytes, group)
        out["fwd"], out["fwd_tail"] = ag, ag
        out["bwd"], out["bwd_tail"] = ag + rs, rs
        if g < world:  # a group smaller than the world: replicas all-reduce their shard
            ar = t("all_reduce", grad_bytes / g, range(0, world, g))
            out["bwd"] += ar
            out["bwd_tail"] += ar
    else:  # sequence parallel: all-gather + reduce-scatter of the activation, fwd & bwd
        tp = max(1, min(region.shard_group or 1, world))
        if tp > 1:
            act = region.boundary_bytes * tp
            out["tp"] = 2 * (t("all_gather", act, range(tp)) + t("reduce_scatter", act,
                                                                  range(tp)))
        replicas = world // tp
        if replicas > 1:
            ar = t("all_reduce", grad_bytes / tp, range(0, world, tp))
            out["bwd"], out["bwd_tail"] = ar, ar
    return out


def predict_step(
    regions: Sequence[RegionCost],
    tables: Sequence[TableCost],
    topology: Topology,
    *,
    calibration: Calibration | None = None,
    options: StepOptions | None = None,
) -> StepPrediction:
    """Step time, MFU, per-rank memory and time of a plan (see the module docstring)."""
    opts = options or StepOptions()
    world = topology.world_size
    gpu = topology.gpu
    source = "calibrated" if calibration is not None else "roofline"
    # each table on the route its sharding runs (as the solver's options price it)
    tables = routed_tables(tables, world, opts.table_optimizer)

    # ---- sparse: per-rank embedding compute, all-to-all -------------------------------
    sparse = np.zeros(world)
    kernel_s = np.zeros(world)  # the rank's batched kernel: its shards' bytes, their count
    kernel_shards = np.zeros(world, dtype=np.int64)
    dp_table_numel = 0.0
    dp_table_grad_bytes = 0.0
    for t in tables:
        if t.replicated and world > 1:
            sparse += replica_compute_s(t, world, gpu, calibration, opts.table_optimizer)
            dp_table_numel += replica_dense_numel(t)
            dp_table_grad_bytes += replica_bucket_bytes(t.rows, t.dim)
            continue
        holders = _holders(t, world)
        if holders.size:  # every holder's shard is the same: price it once
            lookup = shard_compute_s(t, *shard_shape(t), world, gpu, calibration,
                                     opts.table_optimizer)
            np.add.at(sparse, holders,
                      lookup + holder_exchange_s(t, *shard_shape(t), world, topology,
                                                 calibration, opts.exchange)
                      + column_squares_s(t, world, topology, calibration,
                                         opts.table_optimizer))
            if in_batched_kernel(t, world):
                np.add.at(kernel_s, holders, lookup)
                np.add.at(kernel_shards, holders, 1)
    sparse += batched_floor_s(kernel_s, kernel_shards, world)
    out_sends, id_sends = a2a_sends(tables, world, opts.exchange, topology.gpus_per_host)
    a2a = 0.0
    input_dist = 0.0
    cast_launch = 0.0
    if world > 1 and out_sends.any():
        a2a = 2 * collective_time("all_to_all", 0, range(world), topology,
                                  send_bytes=out_sends, calibration=calibration)
        input_dist = collective_time("all_to_all", 0, range(world), topology,
                                     send_bytes=id_sends, calibration=calibration)
        cast_launch = exchange_cast_launch_s(opts.exchange, calibration)
    exposed_input_dist = 0.0 if opts.pipeline_sparse else input_dist

    # ---- dense: compute and communication ---------------------------------------------
    fwd_compute = sum(r.compute_s * r.fwd_fraction for r in regions)
    bwd_compute = sum(r.compute_s * (1 - r.fwd_fraction) for r in regions)
    fwd_compute += sum(r.compute_s * r.fwd_fraction for r in regions if r.checkpoint)
    comm = {"fwd": 0.0, "bwd": 0.0, "tp": 0.0, "fwd_tail": 0.0, "bwd_tail": 0.0}
    for region in regions:
        for k, v in dense_comm(region, topology, calibration, opts).items():
            comm[k] = max(comm[k], v) if k.endswith("tail") else comm[k] + v
    replica_ar = replica_all_reduce_s(dp_table_grad_bytes, topology, calibration)
    exposed_fwd = max(comm["fwd_tail"] if comm["fwd"] else 0.0,
                      comm["fwd"] - opts.overlap * fwd_compute)
    exposed_bwd = max(comm["bwd_tail"] if comm["bwd"] else 0.0,
                      comm["bwd"] - opts.overlap * (bwd_compute + float(sparse.max(initial=0))))
    exposed = exposed_fwd + exposed_bwd + comm["tp"] + exposed_input_dist

    # ---- optimizer and memory per rank -----------------------------------------------
    dense_numel = sum(r.params / shard_degree(r, world) for r in regions) + dp_table_numel
    opt_s, _ = optimizer_time(opts.optimizer, dense_numel, opts.dense_dtype, gpu, calibration,
                              fused=opts.fused_optimizer, tensors=max(1, 2 * len(regions)))
    base = rank_memory(regions, (), 0, world, opts)  # the same on every rank
    # per rank: params, grads, optimizer, activations, workspace of its table shards
    table_mem = np.zeros((world, len(astuple(MemoryBreakdown()))))
    holds = np.zeros(world, dtype=bool)
    dp_mem = MemoryBreakdown()
    # the eager lookups' gradients (memory.table_grad_bytes): held at the end of the
    # backward and through the sparse optimizer's step, plus that step's largest buffer
    grad_held = np.zeros(world)
    grad_peak = np.zeros(world)
    # (saved bytes live, gradient bytes) when each dense_grad lookup's backward runs
    landing: list[list[tuple[float, float]]] = [[] for _ in range(world)]
    for t in tables:
        held, moment = table_grad_bytes(t, *shard_shape(t), world, opts.table_optimizer)
        if t.lookup == DENSE_GRAD and held:
            for r in _holders(t, world):
                landing[r] += [(float(a), held) for a in t.lookup_alive]
        if t.replicated:
            dp_mem = dp_mem + table_memory(t, 0, world, opts)
            grad_held += held
            grad_peak = np.maximum(grad_peak, moment)
            continue
        holders = _holders(t, world)
        if holders.size:
            shard = shard_memory(t, *shard_shape(t), world, opts)
            np.add.at(table_mem, holders, np.asarray(astuple(shard)))
            np.add.at(grad_held, holders, held)
            grad_peak[holders] = np.maximum(grad_peak[holders], moment)
            holds[holders] = True
    base = base + dp_mem
    per_rank = []
    for r in range(world):
        mem = base + MemoryBreakdown(*map(float, table_mem[r])) if holds[r] else base
        if grad_held[r]:  # in the room the saved activations leave (memory's doc)
            extra = float(lookup_gradient_extra(grad_held[r], grad_peak[r],
                                                late_gradient_peak(landing[r]),
                                                mem.activations))
            mem = mem + MemoryBreakdown(grads=extra)
        per_rank.append(RankStats(
            rank=r,
            memory_bytes=mem.total,
            compute_s=float(sparse[r]) + fwd_compute + bwd_compute + opt_s,
            comm_s=a2a + input_dist + comm["fwd"] + comm["bwd"] + comm["tp"] + replica_ar,
            exposed_comm_s=a2a + exposed + replica_ar,
            sparse_compute_s=float(sparse[r]),
            dense_compute_s=fwd_compute + bwd_compute,
            optimizer_s=opt_s,
            memory=mem.to_dict(),
        ))
    breakdown = {
        "sparse_compute": float(sparse.max(initial=0.0)),
        "all_to_all": a2a,
        "exchange_cast": cast_launch,
        "input_dist": exposed_input_dist,
        "dense_forward": fwd_compute,
        "dense_backward": bwd_compute,
        "exposed_forward_comm": exposed_fwd,
        "exposed_backward_comm": exposed_bwd,
        "tp_comm": comm["tp"],
        "replica_all_reduce": replica_ar,
        "optimizer": opt_s,
    }
    step = sum(breakdown.values())
    model_flops = 3.0 * sum(r.fwd_flops for r in regions) * world
    mfu = model_flops / (world * gpu.bf16_flops * step) if step > 0 else 0.0
    return StepPrediction(step_s=step, mfu=mfu, model_flops=model_flops,
                          per_rank=tuple(per_rank), cost_model=source, breakdown=breakdown,
                          world_size=world)

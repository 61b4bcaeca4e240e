"""Bytes one rank holds: parameters, gradients, optimizer state, activations, workspace.

Per dense strategy (ZeRO paper's accounting, Rajbhandari et al. 2020):
- DDP: full params and grads, plus DDP's gradient buckets (a second copy of the grads
  unless ``gradient_as_bucket_view``; none on one rank, where nothing is wrapped), full
  optimizer state.
- FSDP over g ranks: params, grads and state divided by g; the all-gathered params of the
  unit being computed and of the prefetched next one are transient (counted as workspace).
- HSDP: as FSDP with g = the shard group inside a host.
- TP of degree t: params, grads, state and activations inside the region divided by t.
Embedding shards with a fused optimizer (TorchRec TBE, gemc's batched kernel) store no
gradient; a table looked up eagerly (gemc.table_lookup) holds a sparse or table-sized one
at the end of the backward (``table_grad_bytes``); data-parallel replicas on several
ranks hold their segment of the step's replica bucket. Optimizer states per element: adam/adamw 2, adagrad 1,
momentum 1, sgd 0; rowwise_adagrad 1 per *row*.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import ArrayLike

from gemc.sharding import SHARDINGS, dense_strategy
from gemc.table_lookup import BATCHED, DENSE_GRAD

from .kernels import INDEX_BYTES, OPTIMIZER_STATES, replica_bucket_bytes
from .types import RegionCost, StepOptions, TableCost


@dataclass
class MemoryBreakdown:
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    workspace: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.workspace

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(*(getattr(self, f.name) + getattr(other, f.name)
                                 for f in fields(self)))

    def scaled(self, k: float) -> MemoryBreakdown:
        return MemoryBreakdown(*(k * getattr(self, f.name) for f in fields(self)))

    def to_dict(self) -> dict[str, float]:
        d = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        d["total"] = self.total
        return d


def optimizer_state_bytes(optimizer: str, numel: float, *, rows: float = 0.0,
                          state_bytes: int = 4) -> float:
    """State an optimizer keeps for numel parameters (rows: for row-wise optimizers)."""
    name = optimizer.lower()
    if name == "rowwise_adagrad":
        return rows * state_bytes
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZER_STATES)}")
    return OPTIMIZER_STATES[name] * numel * state_bytes


def shard_degree(region: RegionCost, world: int) -> int:
    """How many ranks split the region's parameters."""
    return dense_strategy(region.strategy).degree(region.shard_group, world)


def region_memory(region: RegionCost, world: int, options: StepOptions) -> MemoryBreakdown:
    strategy = dense_strategy(region.strategy)
    g = strategy.degree(region.shard_group, world)
    numel = region.params / g
    params = numel * region.param_bytes
    grads = numel * region.grad_bytes
    if strategy.replicated and region.params > 0 and world > 1:
        # the runner's GradientAverager: each bucket's flat copy of its gradients lives
        # until finish() (DDP's gradient_as_bucket_view=False); one rank wraps nothing
        # (backends/torch/dense.py), so there is no copy to hold
        grads *= 2
    opt = optimizer_state_bytes(options.optimizer, numel, state_bytes=options.state_bytes)
    if options.master_weights and region.param_bytes < 4:
        opt += numel * 4
    act = region.activation_bytes / (region.shard_group if strategy.splits_activations
                                     and region.shard_group else 1)
    if region.checkpoint:
        act = region.boundary_bytes
    return MemoryBreakdown(params, grads, opt, act, 0.0)


def shard_shape(table: TableCost) -> tuple[float, float]:
    """(rows, dim) of the part of a table each of its holders has: every shard of a
    table is the same size, whichever rank holds it (the whole table if data parallel)."""
    return SHARDINGS[table.sharding].shard_shape(table.rows, table.dim, len(table.ranks))


def table_shard(table: TableCost, rank: int) -> tuple[float, float]:
    """(rows, dim) of the part of a table one rank holds (0, 0 if none)."""
    if not table.replicated and rank not in table.ranks:
        return 0.0, 0.0
    return shard_shape(table)


def shards_on(table: TableCost, rank: int) -> int:
    """How many of the table's shards ``rank`` holds: a rank listed twice holds (and pays
    for) two shards, which the plan validator and the runner refuse but a planner's
    candidate may still propose; pricing it as one let such a plan look cheaper."""
    if table.replicated:
        return 1
    return table.ranks.count(rank)


def table_memory(table: TableCost, rank: int, world: int, options: StepOptions) -> MemoryBreakdown:
    one = shard_memory(table, *table_shard(table, rank), world, options)
    k = shards_on(table, rank)
    return one if k <= 1 else one.scaled(k)


def shard_memory(table: TableCost, rows: float, dim: float, world: int,
                 options: StepOptions) -> MemoryBreakdown:
    """Bytes a shard of ``rows`` x ``dim`` of the table costs the rank holding it."""
    if rows == 0:
        return MemoryBreakdown()
    numel = rows * dim
    params = numel * table.storage_bytes  # its storage precision (fp8: with row scales)
    # the optimizer state stays fp32 at any storage precision (gemc.table_precision)
    opt = optimizer_state_bytes(options.table_optimizer, numel, rows=rows,
                                state_bytes=options.state_bytes)
    # fused TBE: no grads; a replica on several ranks: its segment of the step's bucket
    # (fp32 gradient rows and used-row flags, kept between steps)
    grads = replica_bucket_bytes(rows, dim) if table.replicated and world > 1 else 0.0
    # pooled outputs this rank produces and their gradients
    bags = table.batch * (world if not table.replicated else 1)
    bags *= table.output_share(rows)
    act = 2.0 * bags * dim * table.dtype_bytes
    return MemoryBreakdown(params, grads, opt, act, 0.0)


# The owners' fused update (backends/triton/embedding_bag.py ``_fused_update``) holds per
# received id, while it runs: its bag (int64), row key (int32 below 2**31 rows), the sorted
# keys (int32) and their order (int64), each run's end (int64), the sorted bags (int64) and
# the per-id coefficient (fp32): 44 bytes, rounded up for the transient int64 keys it
# narrows. Counted on the runner by benchmarks/lookup_gradient_memory.py (BENCHMARKS.md,
# issue 21, "The owners' fused lookup").
FUSED_UPDATE_BYTES_PER_ID = 48.0

# fp32 buffers of one row per slot (a used row) that the sparse optimizer's row update
# holds at once after ``summed_rows`` (backends/torch/sparse_optim.py), counted per ATen
# op's output on the CPU (benchmarks/lookup_gradient_memory.py, BENCHMARKS.md issue 19):
# row-wise Adagrad 5 (the summed rows, their share of the world, the rows read, the
# step's product and quotient), lazy Adam 10; other optimizers priced as Adam
ROW_UPDATE_BUFFERS = {"rowwise_adagrad": 5}
ROW_UPDATE_BUFFERS_DEFAULT = 10


def table_grad_bytes(table: TableCost, rows: float, dim: float, world: int,
                     optimizer: str = "rowwise_adagrad") -> tuple[float, float]:
    """(bytes of the gradient a shard of ``rows`` x ``dim`` holds at the end of the
    backward, bytes the sparse optimizer's step of it adds for a moment) by its lookup path
    (gemc.table_lookup): the batched kernel holds none; ``dense_grad`` a table-sized
    gradient (each lookup scatters into its own before they are added: one more while
    adding; the optimizer's masked pass reads it in place, adding nothing); ``sparse`` one gradient row and
    index per looked-up id, and the larger of the two moments of ``optimizer``'s step:
    ``summed_rows`` (its per-id sums, the rows gathered into its slots, at most one a
    row, and eight int64 buffers an id: sort, runs, keys) and the row update after it
    (``ROW_UPDATE_BUFFERS`` rows a slot, and two int64-sized vectors a slot). Counted on
    the runner (4 ranks, gloo): the held gradient to 0.5%, the step's moment to 2.5%;
    before the update was counted it was priced at 23 MB where the runner held 53 MB
    (row-wise Adagrad, a table-wise shard looking up 41k ids of 64 columns; lazy Adam
    105 MB). A data-parallel replica on several ranks holds its local batch's sparse
    gradient (its bucket segment is ``shard_memory``'s, steady); its fp32 update is one
    masked pass in place (no moment), a narrower-stored one runs the row update over
    every row (``ROW_UPDATE_BUFFERS`` rows of the table).

    ``batched`` holds no gradient. On several ranks (the owners' fused lookup, issue 21)
    its backward's update sorts the ids the shard received from every rank:
    ``FUSED_UPDATE_BYTES_PER_ID`` a received id, alive while the update runs (the lookup
    is the backward's last op) and for every shard of the rank's launch at once, so they
    are returned as held (summed over the rank's shards). One rank's batched kernel is
    priced without them (its ids are one batch's; its plans were checked against runs
    without this term)."""
    if rows == 0:
        return 0.0, 0.0
    if table.lookup == BATCHED:
        if world == 1 or table.replicated:  # replicas run the sparse route on several ranks
            return 0.0, 0.0
        return world * table.nnz * rows / table.rows * FUSED_UPDATE_BYTES_PER_ID, 0.0
    if table.lookup == DENSE_GRAD:
        return rows * dim * table.dtype_bytes, 0.0
    nnz = float(table.nnz) if table.replicated \
        else world * table.nnz * rows / table.rows
    held = nnz * (dim * table.dtype_bytes + INDEX_BYTES)
    if table.replicated and world > 1:
        buffers = ROW_UPDATE_BUFFERS.get(optimizer, ROW_UPDATE_BUFFERS_DEFAULT)
        return held, 0.0 if table.precision == "fp32" else rows * buffers * dim * 4.0
    slots = min(nnz, float(rows))
    summing = (nnz + slots) * dim * 4.0 + 8.0 * INDEX_BYTES * nnz
    buffers = ROW_UPDATE_BUFFERS.get(optimizer, ROW_UPDATE_BUFFERS_DEFAULT)
    update = slots * (buffers * dim * 4.0 + 2.0 * INDEX_BYTES)
    return held, max(summing, update)


def lookup_gradient_extra(held: ArrayLike, moment: ArrayLike, late: ArrayLike,
                          activations: ArrayLike) -> np.ndarray:
    """Bytes the eager lookups' gradients add to a rank's steady state (per rank, any
    shape): ``held`` their gradients at the end of the backward (``table_grad_bytes``,
    summed over the rank's shards), ``moment`` the largest buffer one table's sparse
    optimizer step adds (the step goes table by table), ``late`` the largest saved
    activations + table-sized gradients live together (``step_model.late_gradient_peak``),
    ``activations`` the rank's activations. The lookups are the graph's first ops, so their
    backward is its last: the gradients come when the saved activations are gone, and
    live in that room; only what exceeds it adds to the peak (DIN h200: 5.2 GB of
    table-sized gradients over 3.8 GB of activations; measured 14.9 GB, 12.8 GB predicted
    without them, 18 GB if simply added). One formula for the step model's per-rank
    memory and the planners' (``gemc.solver.evaluate``), so a plan the planner fits is
    one its prediction fits."""
    held, acts = np.asarray(held, dtype=float), np.asarray(activations, dtype=float)
    over = np.maximum(np.asarray(held + np.asarray(moment, dtype=float)) - acts,
                      np.asarray(late, dtype=float) - acts)
    return np.where(held > 0, np.maximum(over, 0.0), 0.0)


def rank_memory(regions: Sequence[RegionCost], tables: Iterable[TableCost], rank: int,
                world: int, options: StepOptions | None = None) -> MemoryBreakdown:
    """Peak bytes on one rank: steady state plus the largest transient buffer."""
    options = options or StepOptions()
    total = MemoryBreakdown(workspace=float(options.workspace_bytes))
    transient = 0.0
    ckpt_peak = 0.0
    for region in regions:
        total = total + region_memory(region, world, options)
        if dense_strategy(region.strategy).sharded and shard_degree(region, world) > 1:
            # the gathered unit being computed + the prefetched one
            transient = max(transient, 2.0 * region.params * region.param_bytes)
        if region.checkpoint:
            ckpt_peak = max(ckpt_peak, region.activation_bytes)
    for table in tables:
        total = total + table_memory(table, rank, world, options)
    total.workspace += transient
    total.activations += ckpt_peak  # one checkpointed region recomputed at a time
    return total


def eager_peak_bytes(param_bytes: float, activation_bytes: float, *, optimizer: str = "adamw",
                     state_bytes_per_param_byte: float = 1.0, foreach: bool = True,
                     input_bytes: float = 0.0) -> dict[str, float]:
    """Peak of one eager single-GPU step (``zero_grad(set_to_none=True)`` first).

    Two candidates: the end of backward (params + state + saved activations still alive
    + the gradients, all written by then) and the optimizer step (params + grads + state +
    foreach's temporary: one tensor list the size of the parameters, e.g. sqrt(v) in
    AdamW). Activations are freed as backward goes; we take them whole as the upper bound
    of the overlap with the gradients.
    """
    states = OPTIMIZER_STATES.get(optimizer.lower(), 2) * param_bytes * state_bytes_per_param_byte
    grads = param_bytes
    temp = param_bytes if foreach and states else 0.0
    backward = param_bytes + states + max(activation_bytes, grads) + input_bytes
    step = param_bytes + grads + states + temp + input_bytes
    peak = max(backward, step)
    return {"params": param_bytes, "grads": grads, "optimizer": states,
            "activations": activation_bytes, "temporary": temp, "inputs": input_bytes,
            "peak": peak}

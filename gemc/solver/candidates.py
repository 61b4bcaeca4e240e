"""Every option of every region and table, priced once by the cost model.

The step model is additive per rank in everything but a few maxima, so an option is
described by what it adds to each rank it touches (compute seconds, memory bytes, bytes
sent in the pooled all-to-all) plus a few global quantities (dense collectives and their
last buckets, data-parallel gradient bytes, optimizer elements). The planners combine
these numbers; ``evaluate`` adds them up exactly as ``predict_step`` does.

Tables with equal shape and traffic form a *class*, and so do identical dense regions
(``blocks.0`` .. ``blocks.3``): a planner decides how many members of a class take each
option, never which one, which removes the symmetry between them.

A table's options are its sharding types' candidates (``gemc.sharding.Sharding.candidates``:
which rank counts, and grids, a type offers for a table of this width on this topology),
each type in registration order; this module only prices them. A candidate's placement
shape is ``pieces`` x ``width`` consecutive, aligned ranks per piece
(``Sharding.pieces_and_width``):

    table_wise       1 x 1                column_wise k   k x 1 on distinct ranks
    table_row_wise   1 x gpus_per_host    grid c x L      c hosts, L row shards each
    row_wise, data_parallel, and a grid over every host: the same on every rank (uniform)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from gemc.cost_model.collectives import DEFAULT_EFFICIENCY
from gemc.cost_model.kernels import replica_bucket_bytes
from gemc.cost_model.memory import (
    region_memory,
    shard_degree,
    shard_shape,
    table_grad_bytes,
    table_memory,
    table_shard,
)

# The step model's per-shard embedding price and per-region collectives, used here so the
# solver prices exactly what predict_step will.
from gemc.cost_model.step_model import (
    column_squares_s,
    dense_comm,
    holder_exchange_s,
    host_reduce_owners,
    id_send_bytes,
    in_batched_kernel,
    pooled_send_bytes,
    replica_compute_s,
    replica_dense_numel,
    routed_tables,
    shard_compute_s,
)
from gemc.cost_model.types import RegionCost, TableCost
from gemc.errors import PlanError
from gemc.sharding import DENSE_DECLARED, SHARDINGS, dense_strategy
from gemc.table_lookup import DENSE_GRAD

from .problem import DenseChoice, Problem, TableChoice


# ---- dense regions ------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseOption:
    choice: DenseChoice
    memory: float          # bytes on every rank (params, grads, state, saved activations)
    transient: float       # gathered FSDP unit + prefetch (the largest one counts)
    ckpt_peak: float       # one checkpointed region recomputed at a time (the largest)
    fwd_s: float
    bwd_s: float
    comm_fwd: float
    comm_bwd: float
    comm_tp: float
    fwd_tail: float
    bwd_tail: float
    numel: float           # optimizer elements on each rank
    activations: float = 0.0  # of ``memory``: the saved activations (the gradients' room)


@dataclass(frozen=True)
class RegionClass:
    members: tuple[str, ...]
    region: RegionCost
    options: tuple[DenseOption, ...]


def dense_choices(problem: Problem, region: RegionCost) -> list[DenseChoice]:
    topo, s = problem.topology, problem.settings
    world, local, hosts = topo.world_size, topo.gpus_per_host, topo.hosts
    shardable = world > 1 and region.params > 0 and problem.can_place(region.name)
    strategies = [DenseChoice(d.name, g) for d in DENSE_DECLARED
                  if problem.offers(d) and (d.replicated or shardable)
                  for g in d.shard_groups(world, hosts, local)]
    out = list(strategies)
    if (s.allow_checkpoint and region.name and problem.can_place(region.name)
            and region.activation_bytes > region.boundary_bytes):
        out += [replace(c, checkpoint=True) for c in strategies]
    return out


def dense_option(problem: Problem, region: RegionCost, choice: DenseChoice) -> DenseOption:
    world = problem.world
    rc = replace(region, strategy=choice.strategy, shard_group=choice.shard_group,
                 checkpoint=choice.checkpoint)
    mem = region_memory(rc, world, problem.options)
    degree = shard_degree(rc, world)
    gathered = dense_strategy(rc.strategy).sharded and degree > 1
    comm = dense_comm(rc, problem.topology, problem.calibration, problem.options)
    fwd = rc.compute_s * rc.fwd_fraction
    return DenseOption(
        choice=choice,
        memory=mem.total,
        transient=2.0 * rc.params * rc.param_bytes if gathered else 0.0,
        ckpt_peak=float(rc.activation_bytes) if rc.checkpoint else 0.0,
        fwd_s=fwd * (2 if rc.checkpoint else 1),
        bwd_s=rc.compute_s * (1 - rc.fwd_fraction),
        comm_fwd=comm["fwd"], comm_bwd=comm["bwd"], comm_tp=comm["tp"],
        fwd_tail=comm["fwd_tail"], bwd_tail=comm["bwd_tail"],
        numel=rc.params / degree,
        activations=mem.activations,
    )


def region_classes(problem: Problem) -> list[RegionClass]:
    groups: dict[tuple, list[RegionCost]] = defaultdict(list)
    for r in problem.regions:
        key = (r.params, r.fwd_flops, r.compute_s, r.param_bytes, r.grad_bytes,
               r.activation_bytes, r.boundary_bytes, r.fwd_fraction, problem.can_place(r.name),
               bool(r.name))
        groups[key].append(r)
    out = []
    for members in groups.values():
        members.sort(key=lambda r: r.name)
        rep = members[0]
        options = tuple(dense_option(problem, rep, c) for c in dense_choices(problem, rep))
        out.append(RegionClass(tuple(m.name for m in members), rep, options))
    out.sort(key=lambda c: c.members[0])
    return out


# ---- tables ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TableOption:
    sharding: str
    ranks: int                 # ranks holding a shard
    pieces: int                # placement units (see the module docstring)
    width: int                 # consecutive ranks per piece
    uniform: bool              # the same on every rank: nothing to place
    grid: tuple[int, int] | None
    compute_s: float           # per rank holding a shard
    memory: float              # bytes per rank holding a shard
    out_bytes: float           # pooled all-to-all bytes sent per rank holding a shard
    ids_bytes: float           # id all-to-all bytes each rank sends (input dist)
    dp_grad_bytes: float = 0.0  # data parallel: bytes in the step's one replica all-reduce
    dp_numel: float = 0.0       # data parallel: elements in the dense optimizer (batched)
    # in the rank's batched lookup kernel (step_model.in_batched_kernel): the shard's
    # lookup seconds in compute_s, which the kernel's floor compares against
    # (step_model.batched_floor_s: paid once per rank, not per shard)
    in_kernel: bool = False
    kernel_s: float = 0.0
    # what a shard adds to its rank's lookup-gradient term (memory.lookup_gradient_extra):
    # its pooled outputs' activations (the room), its gradient held at the end of the
    # backward and its optimizer step's buffer (memory.table_grad_bytes), and for a
    # table-sized gradient (dense_grad) each lookup's (saved bytes alive, gradient bytes)
    activations: float = 0.0
    grad_held: float = 0.0
    grad_moment: float = 0.0
    landing: tuple[tuple[float, float], ...] = ()

    @property
    def replicated(self) -> bool:
        """A whole table on every rank (gemc.sharding): priced with the dense gradients."""
        return SHARDINGS[self.sharding].replicated

    @property
    def label(self) -> str:
        return SHARDINGS[self.sharding].label(self.ranks, self.grid)


@dataclass(frozen=True)
class TableClass:
    members: tuple[str, ...]
    table: TableCost
    options: tuple[TableOption, ...]


def table_option(problem: Problem, t: TableCost, sharding: str, ranks: int,
                 grid: tuple[int, int] | None = None,
                 placed: tuple[int, ...] | None = None) -> TableOption:
    """What one table sharded this way adds to each rank holding a shard.

    ``placed``: the ranks its shards are on, where known (a plan's choice); else the
    candidate's own shape, ranks ``0..ranks-1``, as the planners place it (a block of
    row shards on one host). The shard's lookup and bytes follow from its shape alone;
    what it sends and its in-host sum also from where the shards are
    (:func:`summing_owners`): a block of row shards spread over two hosts is summed by
    half the owners in each, and each sends twice the rows."""
    world, topo, opts = problem.world, problem.topology, problem.options
    local = topo.gpus_per_host
    # priced on the route this sharding runs (on several ranks the owners' fused lookup
    # or the sparse route, gemc.table_lookup.sharded_route)
    rep = routed_tables([replace(t, sharding=sharding, ranks=tuple(range(ranks)))], world,
                        opts.table_optimizer)[0]
    at = rep if placed is None else replace(rep, ranks=tuple(placed))
    breakdown = table_memory(rep, 0, world, opts)
    mem = breakdown.total
    held, moment = table_grad_bytes(rep, *shard_shape(rep), world, opts.table_optimizer)
    grads = {"activations": breakdown.activations, "grad_held": held, "grad_moment": moment,
             "landing": tuple((float(a), held) for a in t.lookup_alive)
             if rep.lookup == DENSE_GRAD and held else ()}
    gpu = topo.gpu
    shard_rows, shard_dim = table_shard(rep, 0)
    if SHARDINGS[sharding].replicated and world > 1:  # predict_step's replica terms
        compute = replica_compute_s(rep, world, gpu, problem.calibration,
                                    opts.table_optimizer)
        return TableOption(sharding, world, 1, world, True, None, compute, mem, 0.0, 0.0,
                           dp_grad_bytes=replica_bucket_bytes(t.rows, t.dim),
                           dp_numel=replica_dense_numel(rep), **grads)
    lookup = shard_compute_s(rep, shard_rows, shard_dim, world, gpu, problem.calibration,
                             opts.table_optimizer)
    compute = lookup + holder_exchange_s(at, shard_rows, shard_dim, world, topo,
                                         problem.calibration, opts.exchange) \
        + column_squares_s(rep, world, topo, problem.calibration, opts.table_optimizer)
    in_kernel = in_batched_kernel(rep, world)
    out = pooled_send_bytes(at, shard_rows, shard_dim, world, opts.exchange, local)
    ids = id_send_bytes(rep, world)
    pieces, width = SHARDINGS[sharding].pieces_and_width(ranks, world, local, grid)
    uniform = pieces * width == world
    return TableOption(sharding, ranks, pieces, width, uniform, grid, compute, mem, out, ids,
                       in_kernel=in_kernel, kernel_s=lookup if in_kernel else 0.0, **grads)


def table_options(problem: Problem, t: TableCost) -> list[TableOption]:
    """Every sharding type's candidates for ``t`` on the problem's topology, priced; those
    that fit in memory (if none does, the smallest one: the plan is infeasible and
    ``infeasible`` says why). A table only a whole replica runs right (``replicated_only``: the model
    reads it outside its lookups, or max-pools it) is offered its replicated types only."""
    topo = problem.topology
    # on one rank a whole table is a full replica (data_parallel has no candidate there)
    whole_is_replica = problem.world == 1
    out = [table_option(problem, t, s.name, c.ranks, c.grid)
           for s in SHARDINGS.values()
           if s.replicated or not t.replicated_only or whole_is_replica
           for c in s.candidates(t.dim, topo.hosts, topo.gpus_per_host)]
    if not out:
        raise PlanError(f"table '{t.fqn}' has no sharding on {topo.hosts}x{topo.gpus_per_host} GPUs (dim "
                        f"{t.dim}, {'replicas only' if t.replicated_only else 'any sharding'})"
                        "; fix: give it a dimension the shardings divide, or a topology "
                        "with more ranks")
    fits = [o for o in out if o.memory <= problem.cap_bytes]
    return fits or [min(out, key=lambda o: o.memory)]


def least_bytes(options: list[TableOption] | tuple[TableOption, ...]) -> float:
    """A table's fewest bytes over all ranks among its options (each shard's bytes x the
    ranks holding one): what it adds to the mean rank at the least."""
    return min(o.memory * o.ranks for o in options)


def table_key(t: TableCost) -> tuple:
    """What a table's options are priced from besides the problem (tables with equal keys
    form a class and share priced options): its shape, traffic and precision, and its
    lookup path with what its gradient's memory depends on."""
    return (t.rows, t.dim, t.nnz, t.batch, t.dtype_bytes, t.pooled, t.precision,
            t.lookup, t.lookups, t.lookup_alive, t.replicated_only)


def table_classes(problem: Problem) -> list[TableClass]:
    groups: dict[tuple, list[TableCost]] = defaultdict(list)
    for t in problem.tables:
        groups[table_key(t)].append(t)
    out = []
    for members in groups.values():
        members.sort(key=lambda t: t.fqn)
        rep = members[0]
        out.append(TableClass(tuple(m.fqn for m in members), rep,
                              tuple(table_options(problem, rep))))
    out.sort(key=lambda c: c.members[0])
    return out


def option_of(problem: Problem, t: TableCost, choice: TableChoice) -> TableOption:
    """The priced option of a concrete choice (any planner's, the default one's too), on
    its ranks as placed (``table_option``'s ``placed``)."""
    return table_option(problem, t, choice.sharding, len(choice.ranks), choice.grid,
                        placed=choice.ranks)


def summing_owners(problem: Problem, t: TableCost, choice: TableChoice) -> int:
    """The owners of a row block of ``choice`` that sum its partials in each host
    (``step_model.host_reduce_owners``, 1 where nothing is summed): what a choice's price
    takes from where its shards are, beyond their count (what each holder sends, its
    in-host exchange). Choices of one table equal in these owners, sharding, count and
    grid are priced alike (``evaluate.Pricer`` remembers one option for them). Why: the
    planners place a block of row shards on one host, but a plan may put them anywhere
    (the validator and the runner take any distinct ranks); priced as if on one host,
    DLRMv2's 16-rank placement bound spreading three such blocks over both hosts came to
    4.83 ms where ``predict_step`` says 5.40 (BENCHMARKS.md, issue 19, twenty-fourth
    session)."""
    local, world = problem.topology.gpus_per_host, problem.world
    if local <= 1 or world <= local or not t.pooled \
            or not SHARDINGS[choice.sharding].row_split:
        return 1
    return host_reduce_owners(replace(t, sharding=choice.sharding, ranks=choice.ranks),
                              local, world)


# ---- the pooled all-to-all, as predict_step prices it ------------------------------------
@dataclass(frozen=True)
class AllToAll:
    """``collective_time("all_to_all", send_bytes=out)`` over the whole world, written as
    a constant plus the largest of a few linear forms of the per-rank bytes ``out``, so
    the CP-SAT model can state it exactly: per rank (NVLink out and in) and per host
    (NIC out and in)."""

    world: int
    local: int
    hosts: int
    const_s: float
    nvlink_bw: float
    host_bw: float

    @classmethod
    def of(cls, problem: Problem) -> AllToAll:
        topo, eff = problem.topology, DEFAULT_EFFICIENCY
        world = topo.world_size
        p = topo.placement(tuple(range(world)))
        tb = topo.link_bandwidth(p.ranks)
        nvl = tb.nvlink * eff.all_to_all_nvlink  # collectives._all_to_all's efficiencies
        hop = tb.network_latency if p.hosts > 1 else tb.nvlink_latency
        host_bw = min(tb.host_network * eff.all_to_all_network, p.min_local * nvl) \
            if p.hosts > 1 else 0.0
        return cls(world, topo.gpus_per_host, topo.hosts,
                   eff.launch_s + hop + (world - 1) * eff.per_peer_s, nvl, host_bw)

    # coefficients: seconds per byte a rank sends, for each linear form. NVLink carries
    # a rank's sends inside its host and, through PXN, (local-1)/local of those to other
    # hosts (to the local GPU on the destination's rail; collectives._all_to_all)
    @cached_property
    def intra_out(self) -> float:
        if self.world <= 1:
            return 0.0
        pxn = (self.world - self.local) * (self.local - 1) / self.local
        return (self.local - 1 + pxn) / (self.world - 1) / self.nvlink_bw

    @cached_property
    def intra_in(self) -> float:
        """Per byte a host peer sends: its share to this rank, and its PXN hop through
        this rank to other hosts (1/local of its cross-host bytes)."""
        if self.world <= 1:
            return 0.0
        return (1 + (self.world - self.local) / self.local) / (self.world - 1) / self.nvlink_bw

    @cached_property
    def host_out(self) -> float:
        if self.hosts <= 1:
            return 0.0
        return (self.world - self.local) / (self.world - 1) / self.host_bw

    @cached_property
    def host_in(self) -> float:
        return self.local / (self.world - 1) / self.host_bw if self.hosts > 1 else 0.0

    def time(self, out: np.ndarray) -> float:
        """Seconds of one pooled all-to-all (0 when nothing is sent)."""
        if self.world <= 1 or not out.any():
            return 0.0
        by_host = out.reshape(self.hosts, self.local)
        host_sum = by_host.sum(axis=1)
        t = max(float(out.max()) * self.intra_out,
                float((host_sum[:, None] - by_host).max()) * self.intra_in)
        if self.hosts > 1:
            t = max(t, float(host_sum.max()) * self.host_out,
                    float((out.sum() - host_sum).max()) * self.host_in)
        return self.const_s + t

    def even(self, per_rank: float) -> float:
        """The id all-to-all (every rank sends the same)."""
        if per_rank <= 0:
            return 0.0
        return self.time(np.full(self.world, float(per_rank)))

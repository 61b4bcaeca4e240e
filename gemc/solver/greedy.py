"""The greedy baseline: largest table first onto the least-loaded ranks, on gemc's cost model.

Its ordering is borrowed from TorchRec's GreedyProposer + GreedyPerfPartitioner, but it is
not TorchRec's planner (other estimators, no storage reservation, no proposer search): real
TorchRec plans price 3-5x better than greedy's under gemc's own model, so "vs greedy" is not
"vs TorchRec"; ``benchmarks/vs_torchrec.py`` compares with TorchRec's actual planner.

Dense regions stay data parallel (DDP), as TorchRec leaves them, unless the average rank
would not fit: then the largest regions switch to FSDP, largest first, until it does.
Tables are taken largest first (bytes). Each table's sharding options are tried in order
of their estimated cost ("perf": the compute of all its shards plus the time to send their
pooled outputs, or to all-reduce a data-parallel table's gradients), as TorchRec's
proposer orders them; the first whose shards fit goes onto the least-loaded ranks (by
perf) that have room, as the plan is checked (``evaluate.memory_with``: the lookups'
gradients in, so a plan greedy fits is one its prediction fits). If none fits, the table takes its smallest-shard option and the
plan is refused, naming the rank.

Greedy is also the CP-SAT planner's hint, so CP-SAT starts from it and can only improve.
"""

from __future__ import annotations

import numpy as np

from gemc.cost_model.step_model import replica_all_reduce_s
from gemc.cost_model.types import TableCost
from gemc.sharding import REPLICATED_DENSE, dense_strategy

from .candidates import TableOption, least_bytes, table_options
from .evaluate import Pricer, add_table, dense_bytes, dense_memory, empty_loads, memory_with
from .problem import Assignment, DenseChoice, Problem, TableChoice


def _perf(problem: Problem, o: TableOption, comm_s_per_byte: float) -> float:
    """TorchRec-style total cost of an option, summed over its shards."""
    if o.replicated:
        if problem.world == 1:
            return o.compute_s
        ar = replica_all_reduce_s(o.dp_grad_bytes, problem.topology, problem.calibration)
        return problem.world * o.compute_s + ar
    return o.ranks * (o.compute_s + o.out_bytes * comm_s_per_byte)


def greedy(problem: Problem, pricer: Pricer | None = None) -> Assignment:
    pricer = pricer or Pricer(problem)
    world, topo = problem.world, problem.topology
    # a KiB per item below the cap: the CP-SAT model rounds memory up to KiB per item, and
    # greedy is its hint, which must stay feasible there
    cap = problem.cap_bytes - 1024 * (len(problem.tables) + len(problem.regions) + 16)
    local = topo.gpus_per_host
    comm_s_per_byte = max(pricer.a2a.intra_out, pricer.a2a.host_out)
    proposals: dict[str, list[TableOption]] = {}
    for t in problem.tables:
        opts = table_options(problem, t)
        proposals[t.fqn] = sorted(opts, key=lambda o: (_perf(problem, o, comm_s_per_byte),
                                                       o.memory))
    a = Assignment(dense={r.name: DenseChoice(REPLICATED_DENSE) for r in problem.regions})
    tables_avg = sum(least_bytes(opts) for opts in proposals.values()) / world
    for r in sorted(problem.regions, key=lambda r: (-r.params, r.name)):
        if dense_bytes(problem, pricer, a.dense) + tables_avg <= cap:
            break
        if world > 1 and r.params > 0 and problem.can_place(r.name) \
                and problem.offers(dense_strategy("fsdp")):
            a.dense[r.name] = DenseChoice("fsdp")

    # each rank's bytes as the plan will be checked (evaluate): the dense part and the
    # tables placed so far, their lookups' gradients in
    dense = dense_memory(problem, pricer, a.dense)
    loads = empty_loads(world)
    load = np.zeros(world)

    def size(t: TableCost) -> tuple:
        return (-t.rows * t.dim * t.storage_bytes, t.fqn)

    for t in sorted(problem.tables, key=size):
        choice, chosen = None, None
        for o in proposals[t.fqn]:
            ranks = _place(o, memory_with(loads, dense, o) <= cap, load, world, local)
            if ranks is not None:
                choice, chosen = TableChoice(o.sharding, ranks, o.grid), o
                break
        if choice is None:  # fits nowhere: the smallest shards, and the error names the rank
            chosen = min(proposals[t.fqn], key=lambda o: (o.memory, o.ranks))
            ranks = _place(chosen, np.ones(world, dtype=bool), memory_with(loads, dense, chosen),
                           world, local)
            assert ranks is not None
            choice = TableChoice(chosen.sharding, ranks, chosen.grid)
        add_table(loads, chosen, choice.ranks)
        load[list(choice.ranks)] += chosen.compute_s + chosen.out_bytes * comm_s_per_byte
        a.tables[t.fqn] = choice
    return a


def _place(o: TableOption, room: np.ndarray, load: np.ndarray, world: int,
           local: int) -> tuple[int, ...] | None:
    """The least-loaded ranks with room for the option's shards (lowest rank on ties):
    single ranks for table-wise and column-wise shards, whole hosts for the others."""
    if o.uniform:
        return tuple(range(world)) if room.all() else None
    if o.width == 1:
        free = np.flatnonzero(room)
        if len(free) < o.pieces:
            return None
        best = free[np.lexsort((free, load[free]))][: o.pieces]
        return tuple(sorted(int(r) for r in best))
    blocks = world // o.width
    ok = room.reshape(blocks, o.width).all(axis=1)
    if ok.sum() < o.pieces:
        return None
    block_load = np.where(ok, load.reshape(blocks, o.width).max(axis=1), np.inf)
    chosen = sorted(np.lexsort((np.arange(blocks), block_load))[: o.pieces].tolist())
    return tuple(r for b in chosen for r in range(b * o.width, (b + 1) * o.width))

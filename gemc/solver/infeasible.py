"""When no plan fits: which constraint binds, by how much, and what would fix it.

Two checks. Before solving, a lower bound no placement can beat: every rank holds the
dense part at its smallest (each region's least-memory strategy) and, on average, the
tables at their smallest total (each table's least-memory sharding, summed over the
ranks it occupies, divided by the world). After solving, the best assignment found
names the rank that is over, its largest tables and its dense share.
"""

from __future__ import annotations

import math

from gemc.errors import GemcUserError

from .candidates import RegionClass, TableClass
from .evaluate import Evaluation, Pricer
from .problem import Assignment, Problem, as_gb

MAX_NAMED_TABLES = 5


class PlanInfeasibleError(GemcUserError):
    """No plan of this model fits in the GPUs' memory on this topology."""


def _dense_floor(problem: Problem, regions: list[RegionClass]) -> tuple[float, str]:
    """Smallest dense bytes per rank, and the region whose activations weigh most."""
    total = float(problem.options.workspace_bytes)
    heaviest, heaviest_bytes = "", -1.0
    for rc in regions:
        best = min(rc.options, key=lambda o: o.memory + o.transient + o.ckpt_peak)
        total += len(rc.members) * best.memory
        if rc.region.activation_bytes > heaviest_bytes:
            heaviest, heaviest_bytes = rc.members[0], float(rc.region.activation_bytes)
    return total, heaviest


def _tables_floor(tables: list[TableClass]) -> float:
    """Smallest total table bytes over all ranks (each table at its cheapest sharding)."""
    return sum(len(tc.members) * min(o.memory * o.ranks for o in tc.options) for tc in tables)


def _fixes(problem: Problem, regions: list[RegionClass], tables: list[TableClass],
           planner: str | None = None) -> str:
    topo, cap = problem.topology, problem.cap_bytes
    dense, _ = _dense_floor(problem, regions)
    act = sum(len(rc.members) * rc.region.activation_bytes for rc in regions)
    fixes = []
    need = _tables_floor(tables) / (cap - dense) if dense < cap else math.inf
    if planner is not None and need <= problem.world:
        fixes.append(f"the tables fit on average (about {math.ceil(need)} GPUs' worth): "
                     + ("a longer --time-limit for CP-SAT to find a packing" if planner == "cpsat"
                        else "--planner cpsat, which balances memory across ranks"))
    if dense < cap and need > problem.world:
        gpus = max(problem.world + topo.gpus_per_host,
                   topo.gpus_per_host * math.ceil(need / topo.gpus_per_host))
        hosts = math.ceil(gpus / topo.gpus_per_host)
        fixes.append(f"more GPUs (the tables alone need about {math.ceil(need)}; try "
                     f"--topology {topo.gpu.name}:{hosts}x{topo.gpus_per_host})")
    elif dense < cap:
        fixes.append("more GPUs (more room per rank for shards that do not split evenly)")
    else:
        fixes.append("more GPUs do not help: the dense part alone needs "
                     f"{as_gb(dense)} per rank even fully sharded")
    if act > 0:
        fixes.append(f"a smaller batch (saved activations take {as_gb(act)} per rank and "
                     "scale with the local batch: --set batch_size=...)")
    fixes.append("another precision (bf16 weights and optimizer state halve their bytes)")
    if not problem.settings.allow_checkpoint:
        saved = sum(len(rc.members) * max(0, rc.region.activation_bytes - rc.region.boundary_bytes)
                    for rc in regions if rc.region.name)
        peak = max((rc.region.activation_bytes for rc in regions if rc.region.name), default=0)
        if saved - peak > 0:
            fixes.append(f"activation checkpointing (would save about {as_gb(saved - peak)} "
                         "per rank; planner setting allow_checkpoint)")
    return "; or ".join(fixes)


def check_lower_bound(problem: Problem, regions: list[RegionClass],
                      tables: list[TableClass]) -> None:
    """Raise before solving when no placement whatsoever can fit."""
    cap, topo = problem.cap_bytes, problem.topology
    dense, heaviest = _dense_floor(problem, regions)
    every = (f"every rank of {topo.spec} ({topo.gpu.name}: {as_gb(topo.gpu.hbm_bytes)} HBM, "
             f"{as_gb(cap)} usable after the CUDA context and a "
             f"{problem.settings.memory_reserve:.0%} reserve)")
    if dense > cap:
        raise PlanInfeasibleError(
            f"no plan fits: the dense part alone needs {as_gb(dense)} per GPU with every "
            f"region at its smallest strategy (parameters, gradients, optimizer state and "
            f"saved activations; the largest activations in region '{heaviest or '(root)'}'), "
            f"over the {as_gb(cap)} usable by {as_gb(dense - cap)}",
            where=every, fix=_fixes(problem, regions, tables))
    for tc in tables:
        smallest = min(o.memory for o in tc.options)
        if dense + smallest > cap:
            raise PlanInfeasibleError(
                f"table {tc.members[0]} does not fit: its smallest shard needs "
                f"{as_gb(smallest)} on top of the {as_gb(dense)} of dense state every rank "
                f"holds, over the {as_gb(cap)} usable by {as_gb(dense + smallest - cap)}",
                where=every, fix=_fixes(problem, regions, tables))
    per_rank = dense + _tables_floor(tables) / problem.world
    if per_rank > cap:
        raise PlanInfeasibleError(
            f"no plan fits: the tables need at least {as_gb(per_rank - dense)} per GPU on "
            f"average (each at its smallest sharding, {as_gb(_tables_floor(tables))} in all) "
            f"on top of {as_gb(dense)} of dense state, over the {as_gb(cap)} usable by "
            f"{as_gb(per_rank - cap)}",
            where=every, fix=_fixes(problem, regions, tables))


def error_from_evaluation(problem: Problem, assignment: Assignment, ev: Evaluation,
                          pricer: Pricer, regions: list[RegionClass],
                          tables: list[TableClass], *, planner: str, proven: bool
                          ) -> PlanInfeasibleError:
    """The named error for the best assignment a planner found, which is over the cap."""
    rank = int(ev.memory.argmax())
    on_rank = []
    for t in problem.tables:
        choice = assignment.tables[t.fqn]
        if rank in choice.ranks:
            on_rank.append((pricer.table(t, choice).memory, t.fqn, choice.sharding))
    on_rank.sort(key=lambda x: (-x[0], x[1]))
    named = ", ".join(f"{fqn} ({s}, {as_gb(b)})" for b, fqn, s in on_rank[:MAX_NAMED_TABLES])
    if len(on_rank) > MAX_NAMED_TABLES:
        rest = sum(b for b, _, _ in on_rank[MAX_NAMED_TABLES:])
        named += f" and {len(on_rank) - MAX_NAMED_TABLES} more ({as_gb(rest)})"
    tables_b = sum(b for b, _, _ in on_rank)
    how = ("CP-SAT proved that no assignment fits" if proven
           else "CP-SAT's best assignment in its time limit" if planner == "cpsat"
           else f"the {planner} planner's assignment")
    return PlanInfeasibleError(
        f"no plan fits in memory ({how}): rank {rank} needs "
        f"{as_gb(float(ev.memory[rank]))} of {as_gb(ev.cap)} usable, "
        f"{as_gb(ev.over_bytes)} over; its tables: {named or 'none'} ({as_gb(tables_b)}), "
        f"dense state and activations {as_gb(float(ev.memory[rank]) - tables_b)}",
        where=f"rank {rank} of {problem.topology.spec}",
        fix=_fixes(problem, regions, tables, None if proven else planner))

"""When no plan fits: which constraint binds, by how much, and what would fix it.

Two checks. Before solving, a lower bound no placement can beat: every rank holds the
dense part at its smallest (each region's least-memory strategy) and, on average, the
tables at their smallest total (each table's least-memory sharding, summed over the
ranks it occupies, divided by the world). After solving, the best assignment found
names the rank that is over, its largest tables and its dense share.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import replace

from gemc.cost_model.topology import Topology
from gemc.errors import GemcUserError

from .candidates import RegionClass, TableClass, region_classes, table_classes
from .evaluate import Evaluation, Pricer
from .problem import Assignment, Problem, as_gb

MAX_NAMED_TABLES = 5


class PlanInfeasibleError(GemcUserError):
    """No plan of this model fits in the GPUs' memory on this topology."""


class SolverCrashError(GemcUserError):
    """CP-SAT's child process died (a native abort) and no heuristic plan fits: a named
    error with what to try, instead of a process killed by SIGABRT without a word."""


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


def _gradients_floor(problem: Problem, regions: list[RegionClass],
                     tables: list[TableClass]) -> tuple[float, float]:
    """(the least bytes the mean rank holds at the end of the backward, the eager lookups'
    gradients among them): each part at its smallest, the activations given back
    (``memory.lookup_gradient_extra``: the gradients land in the room they leave). The
    gradients are a row per id a rank's tables look up, as many as the local batch sends
    whatever the sharding: more GPUs do not shrink them. Why: DLRM xl's sparse gradients
    take ~100 GB a rank (BENCHMARKS.md, issue 21), which the steady-state floors above do
    not see."""
    dense = float(problem.options.workspace_bytes) + sum(
        len(rc.members) * min(o.memory - o.activations for o in rc.options) for rc in regions)
    late = sum(len(tc.members) * min((o.memory + o.grad_held - o.activations) * o.ranks
                                     for o in tc.options) for tc in tables)
    grads = sum(len(tc.members) * min(o.grad_held * o.ranks for o in tc.options
                                      if not o.replicated or problem.world == 1)
                if any(not o.replicated or problem.world == 1 for o in tc.options) else 0.0
                for tc in tables)
    return dense + late / problem.world, grads / problem.world


MAX_HOSTS = 8192  # the largest topology the fix search tries


def _with_hosts(problem: Problem, hosts: int) -> Problem:
    """The same problem on ``hosts`` hosts of the same kind (tables' per-rank bytes change
    with the world: each rank's pooled outputs are for the global batch)."""
    t = problem.topology
    topo = Topology(t.gpu, hosts, t.gpus_per_host, nvlink_bandwidth=t.nvlink_bandwidth,
                    network=t.network, latency_us=t.latency_us)
    return replace(problem, topology=topo)


def _classes(problem: Problem) -> tuple[list[RegionClass], list[TableClass]]:
    return region_classes(problem), table_classes(problem)


def violation(problem: Problem, regions: list[RegionClass] | None = None,
               tables: list[TableClass] | None = None) -> str | None:
    """Which memory floor no placement can beat, or None: the cheap feasibility test."""
    regions = region_classes(problem) if regions is None else regions
    tables = table_classes(problem) if tables is None else tables
    cap = problem.cap_bytes
    dense, _ = _dense_floor(problem, regions)
    if dense > cap:
        return "dense"
    if any(dense + min(o.memory for o in tc.options) > cap for tc in tables):
        return "table"
    if dense + _tables_floor(tables) / problem.world > cap:
        return "tables"
    if _gradients_floor(problem, regions, tables)[0] > cap:
        return "gradients"
    return None


def _heuristic_fits(problem: Problem) -> bool:
    """Whether greedy or naive finds a plan under the cap (CP-SAT is never worse)."""
    from .evaluate import Pricer, evaluate
    from .greedy import greedy
    from .naive import naive

    pricer = Pricer(problem)
    return any(evaluate(problem, a, pricer).feasible
               for a in (greedy(problem, pricer), naive(problem)))


def _fitting_hosts(problem: Problem) -> tuple[int, bool] | None:
    """The fewest hosts (more than now) where the memory floor holds, checked again, and
    whether a heuristic plan was found to fit there (if not, the next few sizes are tried
    for one that does). None when no size up to ``MAX_HOSTS`` passes the floor: the
    per-rank need grows with the world as fast as the room does."""
    hosts = problem.topology.hosts
    lo, hi = hosts, None
    step = max(1, hosts // 8)
    h = hosts + step
    while h <= MAX_HOSTS:  # grow until it fits, then bisect (the floor is monotone enough)
        if violation(_with_hosts(problem, h)) is None:
            hi = h
            break
        lo, h = h, h + 2 * (h - lo)
    if hi is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if violation(_with_hosts(problem, mid)) is None:
            hi = mid
        else:
            lo = mid
    for h in sorted({hi, hi + 1, math.ceil(hi * 1.1), math.ceil(hi * 1.25)}):
        if violation(_with_hosts(problem, h)) is None and _heuristic_fits(_with_hosts(problem, h)):
            return h, True
    return hi, False


def batch_flag(entrypoint: str | None) -> str | None:
    """``--set NAME=...`` for the entrypoint's own batch parameter, or None if it takes
    none (a fix must name a parameter the entrypoint accepts)."""
    if not entrypoint:
        return None
    try:
        from gemc.entrypoint import load_entrypoint

        params = inspect.signature(load_entrypoint(entrypoint)).parameters
    except Exception:  # the fix is advice: an entrypoint that no longer loads gives none
        return None
    names = [n for n, p in params.items() if "batch" in n.lower()
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return f"--set {names[0]}=..." if names else None


def _fixes(problem: Problem, regions: list[RegionClass], tables: list[TableClass],
           planner: str | None = None) -> str:
    """Only fixes that are true: sizes are checked with the same floor (and a heuristic
    plan), flags are ones the CLI and the entrypoint take."""
    topo, cap = problem.topology, problem.cap_bytes
    dense, _ = _dense_floor(problem, regions)
    act = sum(len(rc.members) * rc.region.activation_bytes for rc in regions)
    fixes = []
    need = _tables_floor(tables) / (cap - dense) if dense < cap else math.inf
    if planner is not None and need <= problem.world:
        fixes.append(f"the tables fit on average (about {math.ceil(need)} GPUs' worth): "
                     + ("a longer --time-limit for CP-SAT to find a packing" if planner == "cpsat"
                        else "--planner cpsat, which balances memory across ranks"))
    if dense >= cap:
        fixes.append("more GPUs do not help: the dense part alone needs "
                     f"{as_gb(dense)} per rank even fully sharded")
    else:
        found = _fitting_hosts(problem)
        g = topo.gpus_per_host
        if found is None:
            largest = _with_hosts(problem, MAX_HOSTS)
            why = ("every rank's pooled outputs grow with the world as fast as the room does"
                   if violation(largest) != "gradients" else
                   "the table lookups' gradients, a row per id of a rank's local batch, take "
                   f"{as_gb(_gradients_floor(largest, *_classes(largest))[1])} per rank at "
                   "any GPU count")
            fixes.append(f"more GPUs do not help up to {MAX_HOSTS} hosts: {why}")
        else:
            hosts, checked = found
            where = (f"--topology {topo.gpu.name}:{hosts}x{g}"
                     if re.fullmatch(r"[A-Za-z0-9]+:\d+x\d+", topo.spec) else
                     f"a topology file with hosts: {hosts}")
            fixes.append(f"more GPUs: {where} ({hosts * g} GPUs; "
                         + ("checked: a heuristic plan fits there)" if checked else
                            "the memory bound holds there; no heuristic plan was found to fit, "
                            "CP-SAT may)"))
    if act > 0:
        flag = batch_flag(problem.entrypoint)
        fixes.append(f"a smaller batch (saved activations take {as_gb(act)} per rank and "
                     "scale with the local batch: "
                     + (f"{flag})" if flag else "the entrypoint takes no batch parameter; "
                        "make its example inputs smaller)"))
    opt = problem.options.table_optimizer
    if opt not in ("rowwise_adagrad", "sgd"):
        lean = replace(problem, options=replace(problem.options, table_optimizer="rowwise_adagrad"))
        if violation(lean) is None:
            fixes.append(f"--table-optimizer rowwise_adagrad (one state value per row instead "
                         f"of {opt}'s per element: checked, the memory bound holds then)")
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

    def refuse(what: str, over: float) -> PlanInfeasibleError:
        return PlanInfeasibleError(f"{what}, over the {as_gb(cap)} usable by {as_gb(over)}",
                                   where=every, fix=_fixes(problem, regions, tables))

    if dense > cap:
        raise refuse(
            f"no plan fits: the dense part alone needs {as_gb(dense)} per GPU with every "
            f"region at its smallest strategy (parameters, gradients, optimizer state and "
            f"saved activations; the largest activations in region '{heaviest or '(root)'}')",
            dense - cap)
    for tc in tables:
        smallest = min(o.memory for o in tc.options)
        if dense + smallest > cap:
            raise refuse(
                f"table {tc.members[0]} does not fit: its smallest shard needs "
                f"{as_gb(smallest)} on top of the {as_gb(dense)} of dense state every rank "
                "holds", dense + smallest - cap)
    per_rank = dense + _tables_floor(tables) / problem.world
    if per_rank > cap:
        raise refuse(
            f"no plan fits: the tables need at least {as_gb(per_rank - dense)} per GPU on "
            f"average (each at its smallest sharding, {as_gb(_tables_floor(tables))} in all) "
            f"on top of {as_gb(dense)} of dense state", per_rank - cap)
    late, grads = _gradients_floor(problem, regions, tables)
    if late > cap:
        raise refuse(
            f"no plan fits: at the end of the backward the mean rank holds at least "
            f"{as_gb(late)}, of which {as_gb(grads)} are its table lookups' gradients (a "
            f"row per id its local batch looks up on the sparse route, the sort buffers of "
            f"the owners' fused update on the batched one, in the room the activations "
            f"leave)",
            late - cap)


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
    grads = float(ev.lookup_grads[rank]) if ev.lookup_grads is not None else 0.0
    grads_part = (f", its lookups' gradients beyond the activations' room {as_gb(grads)} "
                  "(a row per id its tables look up on the sparse route, the fused update's "
                  "sort buffers on the batched one, as many as the global batch sends them)"
                  if grads > 0 else "")
    how = ("CP-SAT proved that no assignment fits" if proven
           else "CP-SAT's best assignment in its time limit" if planner == "cpsat"
           else f"the {planner} planner's assignment")
    return PlanInfeasibleError(
        f"no plan fits in memory ({how}): rank {rank} needs "
        f"{as_gb(float(ev.memory[rank]))} of {as_gb(ev.cap)} usable, "
        f"{as_gb(ev.over_bytes)} over; its tables: {named or 'none'} ({as_gb(tables_b)}), "
        f"dense state and activations {as_gb(float(ev.memory[rank]) - tables_b - grads)}"
        f"{grads_part}",
        where=f"rank {rank} of {problem.topology.spec}",
        fix=_fixes(problem, regions, tables, None if proven else planner))

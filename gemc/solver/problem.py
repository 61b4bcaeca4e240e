"""What the planners decide, and how the decision is read from and written to the graph.

A planner sees a :class:`Problem` (the regions and tables as the cost model's plain
``RegionCost`` / ``TableCost``, priced from the graph's typed facts,
``graph_summary.RegionFacts`` / ``TableFacts``; the topology, the step model's options,
the memory cap)
and returns an :class:`Assignment` (a :class:`DenseChoice` per region, a
:class:`TableChoice` per table). The conversion from the graph goes through the same
functions the plan builder and ``gemc.costing`` use, so the numbers a planner optimises
are the numbers the plan's ``predicted`` block is computed from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import fx

from gemc import ir
from gemc.context import PassContext
from gemc.cost_model.step_model import predict_step, routed_tables
from gemc.cost_model.topology import Topology
from gemc.cost_model.types import RegionCost, StepOptions, StepPrediction, TableCost
from gemc.costing import (
    host_s,
    priced_activations,
    region_boundary_bytes,
    region_costs,
    step_launches,
    table_costs,
    with_call_syncs,
)
from gemc.graph_summary import graph_facts, runs_graph_mode
from gemc.ir import OpKind
from gemc.sharding import REPLICATED_DENSE, DenseStrategy, runner_executes

GB = 1e9


@dataclass(frozen=True)
class SolverSettings:
    """Knobs of the planners; defaults are what ``gemc compile`` uses.

    ``time_limit_s`` is CP-SAT's *deterministic* time (its own work counter, about a second
    of one core on an idle machine), so the same inputs give the same plan on any machine
    and any load; ``wall_limit_factor`` x that in wall seconds (at least ``wall_limit_min_s``)
    is only a safety net (when it is what stops the search, the plan says so: it may then
    differ from run to run).
    ``None`` (the default) sizes it by the tables to place (``budget_s``).
    ``memory_reserve`` is the share of HBM kept free for fragmentation and what the memory
    model does not see, on top of the CUDA context (``GPUSpec.usable_hbm_bytes``).
    """

    time_limit_s: float | None = None
    workers: int = 2
    seed: int = 0
    gap_limit: float = 1e-3        # stop once within 0.1% of the bound
    memory_reserve: float = 0.05
    # offer only what the runner executes (gemc.sharding.runner_executes); False: also the
    # strategies it refuses (tensor parallel, sharded regions next to graph-mode kernels),
    # for cost-model studies of plans that cannot run yet
    runner_only: bool = True
    allow_checkpoint: bool = False
    max_placement_vars: int = 6_000
    packing_slack: float = 0.03   # memory a bin of several ranks keeps free for packing
    wall_limit_factor: float = 6.0
    wall_limit_min_s: float = 30.0  # the safety net's floor (short budgets on loaded boxes)
    # extra budget (a share of time_limit_s, on top of it) for the lexicographic second
    # objective (memory balance: the fullest rank's bytes, the step held at the first
    # solution's); 0: off
    balance_share: float = 0.0
    # memory balance after the plan is found (``planners.balanced_plan``): the share of its
    # step a better-balanced plan may cost (headroom for activations and fragmentation
    # the memory model does not see); 0: the step is never traded
    balance_tolerance: float = 0.02
    # the memory-balance target, max / mean rank memory (``local_search.cap_memory``): a
    # plan above it is searched again with every rank under ``balance_ratio`` x the least
    # mean its tables allow, and that plan kept if it costs at most
    # ``balance_cap_tolerance`` of the step (more than ``balance_tolerance``: a plan at the
    # target, not just an emptier fullest rank); 0: no cap search. 0.1 since the owners'
    # fused lookup (s14): DLRMv2 x 40 at 64 ranks then plans at 52.66 ms and 1.71, and the
    # cap search reaches 1.29 for +7.1% (56.38 ms, still 29% under the 79.11 ms the same
    # tables planned at before, at 1.25); under 0.05 the 1.71 plan was kept
    balance_ratio: float = 1.3
    balance_cap_tolerance: float = 0.1
    # table moves the local search prices (``local_search``), before CP-SAT and after it:
    # a count, not a clock, so plans stay reproducible
    search_moves: int = 5_000

    def __post_init__(self) -> None:
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"time limit must be > 0 seconds, got {self.time_limit_s}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if not 0 <= self.balance_tolerance < 1:
            raise ValueError(f"balance_tolerance must be in [0, 1), got {self.balance_tolerance}")
        if not (self.balance_ratio == 0 or self.balance_ratio >= 1):
            raise ValueError(f"balance_ratio must be 0 (off) or >= 1, got {self.balance_ratio}")
        if not 0 <= self.balance_cap_tolerance < 1:
            raise ValueError("balance_cap_tolerance must be in [0, 1), got "
                             f"{self.balance_cap_tolerance}")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"memory_reserve must be in [0, 1), got {self.memory_reserve}")


# CP-SAT's deterministic budget when none is given: BUDGET_MAX_S from BUDGET_FULL_TABLES
# tables up, proportionally fewer below, never under BUDGET_MIN_S. Measured on DLRMv2
# (BENCHMARKS.md, issue 19): its 26 tables planned as well in 0.25 s as in 2 (the local
# search's hint is near CP-SAT's best at that size, and 2 s cost 7-9 s of wall on two
# cores), its tables x40 (1,040) were 14-32% slower at 512 and 4,096 ranks in 0.25 s.
BUDGET_MIN_S = 0.25
BUDGET_MAX_S = 2.0
BUDGET_FULL_TABLES = 512


def default_budget_s(tables: int) -> float:
    """Deterministic seconds for CP-SAT on ``tables`` tables (see BUDGET_MAX_S)."""
    return max(BUDGET_MIN_S, BUDGET_MAX_S * min(1.0, tables / BUDGET_FULL_TABLES))


@dataclass(frozen=True)
class DenseChoice:
    """A dense region's strategy. ``shard_group``: HSDP's group inside a host, TP's degree
    (0 for DDP and for FSDP over the whole world)."""

    strategy: str = REPLICATED_DENSE
    shard_group: int = 0
    checkpoint: bool = False

    def placement(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.strategy}
        if self.shard_group:
            out["shard_group"] = self.shard_group
        if self.checkpoint:
            out["checkpoint"] = True
        return out

    def label(self) -> str:
        s = self.strategy + (f"/{self.shard_group}" if self.shard_group else "")
        return s + ("+ckpt" if self.checkpoint else "")


@dataclass(frozen=True)
class TableChoice:
    """A table's sharding and the ranks holding its shards, in shard order.
    ``grid`` is ``(column blocks, row shards per block)`` for grid sharding."""

    sharding: str
    ranks: tuple[int, ...]
    grid: tuple[int, int] | None = None

    def placement(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sharding": self.sharding, "ranks": list(self.ranks)}
        if self.grid is not None:
            out["grid"] = list(self.grid)
        return out


@dataclass
class Assignment:
    dense: dict[str, DenseChoice] = field(default_factory=dict)
    tables: dict[str, TableChoice] = field(default_factory=dict)


@dataclass(frozen=True)
class Problem:
    """Everything a planner needs; no torch.fx inside, so tests can build one by hand."""

    regions: tuple[RegionCost, ...]
    tables: tuple[TableCost, ...]
    topology: Topology
    calibration: Any = None
    options: StepOptions = field(default_factory=StepOptions)
    settings: SolverSettings = field(default_factory=SolverSettings)
    # regions whose strategy the plan can carry (they own compute nodes); others stay DDP
    placeable: frozenset[str] | None = None
    # the model's entrypoint (FILE.py:FUNC): an infeasibility fix names its own parameters
    entrypoint: str | None = None
    # the plan's kernels put the runner in graph mode (graph_summary.runs_graph_mode): on
    # several ranks it then executes replicated regions only
    graph_mode: bool = False
    # exposed host seconds of a plan whose tables are these (sharded, on their routes) at
    # this device step (gemc.costing.host_s over the graph's launches), or None (a problem
    # built by hand: no host term). Why: the tables' routes set the step's launches (an
    # eager replica ~40, a shard in its owners' fused kernel 2), so on a host-bound step
    # the plan with the least device time may not be the fastest (host_step_s)
    host_s: Callable[[list[TableCost], float], float] | None = field(
        default=None, compare=False, repr=False)

    @property
    def world(self) -> int:
        return self.topology.world_size

    @property
    def cap_bytes(self) -> float:
        """Per-GPU memory a plan may use: usable HBM minus the reserve."""
        gpu = self.topology.gpu
        return float(gpu.usable_hbm_bytes) - self.settings.memory_reserve * gpu.hbm_bytes

    @property
    def budget_s(self) -> float:
        """CP-SAT's deterministic seconds: the user's limit, else sized by the tables."""
        given = self.settings.time_limit_s
        return given if given is not None else default_budget_s(len(self.tables))

    def can_place(self, region: str) -> bool:
        return self.placeable is None or region in self.placeable

    def offers(self, strategy: DenseStrategy) -> bool:
        """Whether the planners may give a region ``strategy``: what the runner executes
        for this plan (``runner_executes``), unless the settings admit the rest."""
        return not self.settings.runner_only or runner_executes(
            strategy, world_size=self.world, graph_mode=self.graph_mode)


def problem_from_graph(
    gm: fx.GraphModule, ctx: PassContext, settings: SolverSettings | None = None,
    options: StepOptions | None = None,
) -> Problem:
    """The regions and tables of an annotated graph (after predict-time): its facts
    (``graph_summary.graph_facts``, what the plan builder records) priced by
    ``gemc.costing``, as the plan's ``predicted`` block will price them: the same saved
    activations per region and the same activation workspace (``priced_activations``) on
    top of ``options``' own, so the memory a plan is fitted in is the memory it predicts."""
    facts = graph_facts(gm, ctx.param_dtypes)
    acts = priced_activations(gm, ctx.calibration)
    costs = region_costs(facts.regions, acts.saved, region_boundary_bytes(gm))
    placeable = frozenset(
        str(n.meta.get(ir.REGION, ""))
        for n in gm.graph.nodes
        if n.op == "call_function" and ir.kind_of(n) is not OpKind.VIEW
        and not n.meta.get(ir.TABLE)
    )
    calibration = ctx.calibration
    step_options = with_call_syncs(gm, acts.options(options or StepOptions()))

    def host_of(tables: list[TableCost], device_s: float) -> float:
        launches, per_launch = step_launches(gm, tables, calibration,
                                             ctx.topology.world_size)
        return host_s(tables, ctx.topology, step_options, calibration,
                      launches=launches["total"], device_s=device_s, per_launch_s=per_launch)

    return Problem(
        regions=tuple(replace(r, strategy=REPLICATED_DENSE, shard_group=0, checkpoint=False) for r in costs),
        tables=tuple(table_costs(facts.tables)),
        topology=ctx.topology,
        calibration=ctx.calibration,
        options=step_options,
        settings=settings or SolverSettings(),
        placeable=placeable,
        entrypoint=ctx.entrypoint,
        graph_mode=runs_graph_mode(gm),
        host_s=host_of,
    )


def apply_assignment(gm: fx.GraphModule, assignment: Assignment,
                     table_cost: Mapping[str, dict[str, float]] | None = None) -> None:
    """Write ``gemc.placement`` the way place-default does (the plan builder reads it);
    ``table_cost`` adds the planner's per-shard estimate of each table (``cost``)."""
    for node in gm.graph.nodes:
        facts = node.meta.get(ir.TABLE)
        if facts is not None:
            placement = assignment.tables[facts["fqn"]].placement()
            if table_cost and facts["fqn"] in table_cost:
                placement["cost"] = table_cost[facts["fqn"]]
            node.meta[ir.PLACEMENT] = placement
        elif node.op == "call_function" and ir.kind_of(node) is not OpKind.VIEW:
            region = str(node.meta.get(ir.REGION, ""))
            node.meta[ir.PLACEMENT] = assignment.dense.get(region, DenseChoice()).placement()


def chosen_regions(problem: Problem, assignment: Assignment) -> list[RegionCost]:
    out = []
    for r in problem.regions:
        c = assignment.dense.get(r.name, DenseChoice())
        out.append(replace(r, strategy=c.strategy, shard_group=c.shard_group,
                           checkpoint=c.checkpoint))
    return out


def chosen_tables(problem: Problem, assignment: Assignment) -> list[TableCost]:
    out = []
    for t in problem.tables:
        c = assignment.tables[t.fqn]
        out.append(replace(t, sharding=c.sharding, ranks=c.ranks))
    return out


def host_step_s(problem: Problem, assignment: Assignment, device_s: float) -> float:
    """The plan's step with the host's exposed time (the plan's ``predicted`` step): the
    device step ``device_s`` plus :attr:`Problem.host_s` of its tables on their routes."""
    if problem.host_s is None:
        return device_s
    tables = routed_tables(chosen_tables(problem, assignment), problem.world,
                           problem.options.table_optimizer)
    return device_s + problem.host_s(tables, device_s)


def predict(problem: Problem, assignment: Assignment) -> StepPrediction:
    """The cost model's own prediction of an assignment (the reference ``evaluate`` matches;
    slow at thousands of ranks, see the solver's notes)."""
    return predict_step(chosen_regions(problem, assignment), chosen_tables(problem, assignment),
                        problem.topology, calibration=problem.calibration,
                        options=problem.options)


def ranks_by_host(topology: Topology) -> list[list[int]]:
    """Ranks of each host in torchrun order (host-major, then local index = rail)."""
    g = topology.gpus_per_host
    return [list(range(h * g, (h + 1) * g)) for h in range(topology.hosts)]


def describe_ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    if len(rs) > 6:
        return f"{len(rs)} ranks ({rs[0]}..{rs[-1]})"
    return ", ".join(map(str, rs))


def as_gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"


def table_index(problem: Problem) -> Mapping[str, TableCost]:
    return {t.fqn: t for t in problem.tables}

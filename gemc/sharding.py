"""Table sharding types, one :class:`Sharding` object each: its shards, the shape each holder
keeps, how its lookups communicate, and where the solver may place it.

One object per type, in the core, used by the plan builder and the plan validator (the
shards), the cost model (the shape a holder keeps, whether the table is replicated,
whether a shard returns only its rows' share of an unpooled lookup), the solver (the
candidate placements of a table of a given width on a given topology, and the placement
shape of each) and the runner (whether a table is a local replica), so no layer keeps a
list of type names or an ``if`` per type of its own. A new type is one more entry in
:data:`DECLARED` (or, from outside gemc, :func:`register`); see ``docs/architecture.md``
("Where a new sharding type goes").

Dense strategies likewise, one :class:`DenseStrategy` each (:data:`DENSE_DECLARED`): how a
region's parameters are held, the collectives the cost model prices, the shard groups the
solver may offer and whether the runner executes it ("Dense strategies" in the same doc).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

PARAM_GROUPS = ("none", "world", "host", "tensor")
"""Which ranks split a dense region's parameters: none (every rank holds them whole), the
whole world (or the plan's ``shard_group``), the GPUs of one host (``shard_group``, the
other hosts holding replicas), or a tensor-parallel group of ``shard_group`` ranks."""
DENSE_COMMS = ("all_reduce", "gather_scatter", "sequence_parallel")
"""A dense strategy's collectives per step, as the cost model prices them: the gradients'
bucketed all-reduce; an all-gather of the parameters (forward, again in backward) and a
reduce-scatter of the gradients, plus an all-reduce of the shard across replicas when the
group is smaller than the world; or a sequence-parallel all-gather + reduce-scatter of the
activation (forward and backward, on the critical path) and an all-reduce of the shard
across replicas."""
TP_DEGREES = (2, 4, 8)
"""The tensor-parallel degrees the solver may offer (dividing a host's GPUs)."""

SPLITS = ("none", "rows", "columns", "grid")
"""How a type cuts a table: not at all (one whole shard per holder), into row ranges, into
column ranges, or into a grid (column blocks, each cut into row ranges)."""
PLACEMENTS = ("one_rank", "every_rank", "distinct_ranks", "one_host", "host_grid")
"""Where the solver may put a type's ranks: one rank; every rank (nothing to place); ``k``
ranks placed one by one; the GPUs of one host (consecutive ranks); ``c`` hosts of ``L``
row shards each (``grid = (c, L)``)."""

DISTINCT_RANK_COUNTS = (2, 4, 8, 16)
"""The rank counts a ``distinct_ranks`` candidate may take (at most the world)."""
MIN_SHARD_DIM = 8
"""A column split is offered only where every shard keeps at least this many columns (and
the columns split evenly). 8 fp32 columns are one 32-byte sector, the smallest piece a
gather moves; narrower shards (or narrower storage) pay whole sectors anyway
(cost_model.kernels.row_sector_waste prices it). The runner's kernel pads its tile to 16
lanes and masks the rest, so an 8-wide shard loads no more than its own bytes."""


@dataclass(frozen=True)
class Candidate:
    """One placement of a table the solver may price: over ``ranks`` ranks, and for a grid
    its ``(column blocks, row shards per block)``."""

    ranks: int
    grid: tuple[int, int] | None = None


def split_even(total: int, parts: int) -> list[tuple[int, int]]:
    """(offset, size) of ``parts`` contiguous pieces, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    out, offset = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def _shard(rank: int, r0: int, nr: int, c0: int, nc: int) -> dict[str, Any]:
    return {"rank": rank, "row_offset": r0, "rows": nr, "col_offset": c0, "cols": nc}


@dataclass(frozen=True)
class Sharding:
    """One table sharding type.

    ``split``: how the table is cut (:data:`SPLITS`). ``replicated``: every rank holds the
    whole table and looks it up locally; its gradient goes into the step's one all-reduce
    of every replica (no all-to-all). Otherwise each rank's lookups go to the shards' holders and the pooled
    outputs come back through the all-to-all (the communication every other type shares).
    ``placement``: the shape of the ranks a solver candidate takes (:data:`PLACEMENTS`).
    """

    name: str
    split: str
    placement: str
    replicated: bool = False

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"sharding {self.name}: split {self.split!r} not in {SPLITS}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"sharding {self.name}: placement {self.placement!r} not in "
                             f"{PLACEMENTS}")
        if self.replicated and (self.split != "none" or self.placement != "every_rank"):
            raise ValueError(f"sharding {self.name}: a replicated table is whole on every "
                             "rank (split 'none', placement 'every_rank')")

    @property
    def row_split(self) -> bool:
        """Whether a shard holds a range of the rows (then an unpooled lookup's shard
        returns only the rows it holds, not a partial sum for every bag)."""
        return self.split in ("rows", "grid")

    def shards(self, ranks: list[int], rows: int, dim: int,
               grid: list[int] | tuple[int, int] | None = None) -> list[dict[str, Any]]:
        """Concrete shards: [{"rank", "row_offset", "rows", "col_offset", "cols"}, ...]."""
        if self.split == "none":
            held = ranks if self.replicated else ranks[:1]
            return [_shard(r, 0, rows, 0, dim) for r in held]
        if self.split == "rows":
            return [_shard(r, r0, nr, 0, dim)
                    for r, (r0, nr) in zip(ranks, split_even(rows, len(ranks)))]
        if self.split == "columns":
            return [_shard(r, 0, rows, c0, nc)
                    for r, (c0, nc) in zip(ranks, split_even(dim, len(ranks)))]
        n_col, n_row = grid if grid else (len(ranks), 1)
        if n_col * n_row != len(ranks):
            raise ValueError(f"grid {grid} does not match {len(ranks)} ranks")
        out = []
        for ci, (c0, nc) in enumerate(split_even(dim, n_col)):
            group = ranks[ci * n_row : (ci + 1) * n_row]
            out += [_shard(r, r0, nr, c0, nc)
                    for r, (r0, nr) in zip(group, split_even(rows, n_row))]
        return out

    @staticmethod
    def _wide_grid(dim: int, hosts: int, gpus_per_host: int) -> list[int]:
        """The side of the one square grid offered beyond a host a column block, if any:
        ``k * gpus_per_host`` column blocks of as many row shards (``k`` hosts each, ``k``
        >= 2, on ``k * k * gpus_per_host`` <= ``hosts`` hosts), the largest cutting
        ``dim`` into blocks of at least :data:`MIN_SHARD_DIM` columns. Why: at 4,096 ranks
        DLRMv2's pooling-100 40M-row table's finest shard was the 8 x 8 grid piece, 0.35
        GB with 0.29 GB of sparse gradient and row update on a 1.43-GB dense part: over
        1.3 x the mean rank whatever the rest did (BENCHMARKS.md, issue 19, s13-balance2);
        a 16 x 16 piece is 0.09 + 0.09 GB."""
        if gpus_per_host <= 1:
            return []
        sides = [k * gpus_per_host for k in range(2, hosts + 1)
                 if k * k * gpus_per_host <= hosts and dim % (k * gpus_per_host) == 0
                 and dim // (k * gpus_per_host) >= MIN_SHARD_DIM]
        return sides[-1:]

    def shard_shape(self, rows: int, dim: int, holders: int) -> tuple[float, float]:
        """(rows, dim) of the part each of ``holders`` ranks keeps, as the cost model prices
        it: equal parts (the whole table if not split). A grid's shape is the one the
        solver offers: ``round(sqrt(holders))`` column blocks."""
        if self.split == "none":
            return float(rows), float(dim)
        if self.split == "rows":
            return rows / holders, float(dim)
        if self.split == "columns":
            return float(rows), dim / holders
        cols = self.column_blocks(holders)
        return rows / (holders / cols), dim / cols

    def column_blocks(self, holders: int) -> int:
        """Into how many column ranges the table is cut over ``holders`` ranks, as
        :meth:`shard_shape` prices it (a grid: ``round(sqrt(holders))``). Why it matters
        beyond the shape: every column range looks up the same rows, so each id of a batch
        goes to one holder per range (the runner's exchange sends it to every owner of its
        row range), and the id all-to-all carries that many copies."""
        if self.split == "columns":
            return holders
        if self.split == "grid":
            return max(1, int(round(holders ** 0.5)))
        return 1

    def label(self, ranks: int, grid: tuple[int, int] | None = None) -> str:
        """A candidate's name in the solver's reports: the type, with its column count
        where that varies between candidates (``column_wise/4``) or its grid
        (``grid/2x8``)."""
        if self.split == "columns":
            return f"{self.name}/{ranks}"
        if self.split == "grid" and grid:
            return f"{self.name}/{grid[0]}x{grid[1]}"
        return self.name

    def pieces_and_width(self, ranks: int, world: int, gpus_per_host: int,
                         grid: tuple[int, int] | None = None) -> tuple[int, int]:
        """A solver candidate over ``ranks`` ranks as (placement units, consecutive ranks
        per unit): see ``gemc.solver.candidates``."""
        if self.placement == "one_rank":
            return 1, 1
        if self.placement == "distinct_ranks":
            return ranks, 1
        if self.placement == "one_host":
            return 1, gpus_per_host
        if self.placement == "host_grid":
            if grid is None:
                raise ValueError(f"sharding {self.name}: a candidate needs its grid")
            return grid[0], grid[1]
        return 1, world

    def candidates(self, dim: int, hosts: int, gpus_per_host: int) -> tuple[Candidate, ...]:
        """The placements the solver may offer a table ``dim`` columns wide on ``hosts``
        hosts of ``gpus_per_host`` GPUs, by :attr:`placement`: one rank; every rank (more
        than one); :data:`DISTINCT_RANK_COUNTS` ranks; one host, or a grid of ``c`` hosts of
        ``gpus_per_host`` row shards each, on several hosts of several GPUs. A grid's ``c``
        is the largest with ``round(sqrt(c * gpus_per_host)) == c``, the shape
        :meth:`shard_shape` prices (8 hosts of 8 GPUs: 8 x 8), and on enough hosts one
        square grid of several hosts a column block (:meth:`_wide_grid`: 16 x 16 from 32
        hosts of 8). A column split keeps only the counts that cut ``dim`` evenly into
        shards of at least :data:`MIN_SHARD_DIM`."""
        world = hosts * gpus_per_host
        several = hosts > 1 and gpus_per_host > 1
        if self.placement == "one_rank":
            found = [Candidate(1)]
        elif self.placement == "every_rank":
            found = [Candidate(world)] if world > 1 else []
        elif self.placement == "distinct_ranks":
            found = [Candidate(k) for k in DISTINCT_RANK_COUNTS if k <= world]
        elif self.placement == "one_host":
            found = [Candidate(gpus_per_host)] if several else []
        else:
            columns = [c for c in range(2, hosts + 1)
                       if round(math.sqrt(c * gpus_per_host)) == c] if several else []
            found = [Candidate(c * gpus_per_host, (c, gpus_per_host)) for c in columns[-1:]]
            found += [Candidate(c * c, (c, c)) for c in self._wide_grid(dim, hosts,
                                                                      gpus_per_host)]
        if self.split == "columns":
            found = [c for c in found if dim % c.ranks == 0 and dim // c.ranks >= MIN_SHARD_DIM]
        return tuple(found)


DECLARED: tuple[Sharding, ...] = (
    Sharding("table_wise", "none", "one_rank"),
    Sharding("row_wise", "rows", "every_rank"),
    Sharding("data_parallel", "none", "every_rank", replicated=True),
    Sharding("column_wise", "columns", "distinct_ranks"),
    Sharding("table_row_wise", "rows", "one_host"),
    Sharding("grid", "grid", "host_grid"),
)
"""The built-in types. Their order is the order of the solver's candidates (part of its
determinism: CP-SAT's variables and the greedy planner's ties follow it)."""

TABLE_SHARDINGS = tuple(s.name for s in DECLARED)
"""The built-in types' names."""

_REGISTRY: dict[str, Sharding] = {}

SHARDINGS: Mapping[str, Sharding] = MappingProxyType(_REGISTRY)
"""The known types by name, in registration order (the built-in ones first): what a plan's
``tables[].sharding`` may be, what the cost model prices and what the solver offers. A
read-only view: it follows :func:`register`."""


def register(new: Sharding) -> Sharding:
    """Make a type known to every layer: the solver offers its candidates (after the
    built-in ones'), the cost model prices it, the plan validator and the runner accept
    it. A name already known is refused (two types of one name would disagree)."""
    if new.name in _REGISTRY:
        raise ValueError(f"sharding {new.name} is already registered")
    _REGISTRY[new.name] = new
    return new


def unregister(name: str) -> None:
    """Forget a registered type (a test's, after it ran); the built-in ones stay."""
    if name in TABLE_SHARDINGS:
        raise ValueError(f"sharding {name} is built in")
    del _REGISTRY[name]


for _declared in DECLARED:
    register(_declared)


def sharding(name: str) -> Sharding:
    """The type named ``name`` (a ValueError naming the known ones otherwise)."""
    found = SHARDINGS.get(name)
    if found is None:
        raise ValueError(f"unknown sharding {name!r} (known: {', '.join(SHARDINGS)})")
    return found


def make_shards(
    sharding_name: str, ranks: list[int], rows: int, dim: int, grid: list[int] | None = None
) -> list[dict[str, Any]]:
    """Concrete shards of a table sharded ``sharding_name`` over ``ranks`` (see
    :meth:`Sharding.shards`)."""
    return sharding(sharding_name).shards(ranks, rows, dim, grid)


@dataclass(frozen=True)
class DenseStrategy:
    """One dense-region strategy: how its parameters are held, what it communicates per
    step, the shard groups the solver may offer it and whether the runner executes it.

    ``group``: which ranks split the parameters (:data:`PARAM_GROUPS`). ``sharded``: the
    parameters are sharded and gathered around each use (the gathered unit and the
    prefetched one are transient memory); otherwise a non-``none`` group splits the
    computation (tensor parallel: the activation is split too). ``comm``: the collectives
    the cost model prices (:data:`DENSE_COMMS`). ``runner``: whether the runner executes
    it at all; ``graph_mode``: whether it does so next to graph-mode kernels on several
    ranks (the runner's side of :func:`runner_executes`, which the solver's search and
    the runner's refusals both read). ``title``: its name in errors.
    """

    name: str
    group: str
    comm: str
    sharded: bool = False
    runner: bool = True
    graph_mode: bool = False
    title: str = ""

    def __post_init__(self) -> None:
        if self.group not in PARAM_GROUPS:
            raise ValueError(f"dense strategy {self.name}: group {self.group!r} not in "
                             f"{PARAM_GROUPS}")
        if self.comm not in DENSE_COMMS:
            raise ValueError(f"dense strategy {self.name}: comm {self.comm!r} not in "
                             f"{DENSE_COMMS}")

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole parameters (their gradient all-reduced in
        buckets by the runner's averager, which keeps a flat copy of each bucket)."""
        return self.group == "none"

    @property
    def splits_activations(self) -> bool:
        """Whether each rank of the group keeps only its share of the activation."""
        return self.group == "tensor"

    def degree(self, shard_group: int, world: int) -> int:
        """How many ranks split the parameters, for a region planned with ``shard_group``
        (0 = the strategy's default: the whole world for a world group)."""
        if self.group == "none":
            return 1
        if self.group == "world":
            return shard_group or world
        return max(1, shard_group or 1)

    def shard_groups(self, world: int, hosts: int, gpus_per_host: int) -> tuple[int, ...]:
        """The ``shard_group`` values the solver may offer a region that can be sharded:
        0 for a replicated or world-wide strategy, a host's GPUs for a host group (on
        several hosts of several GPUs), the :data:`TP_DEGREES` that divide a host's GPUs
        for a tensor group."""
        if self.group in ("none", "world"):
            return (0,)
        if self.group == "host":
            return (gpus_per_host,) if hosts > 1 and gpus_per_host > 1 else ()
        return tuple(t for t in TP_DEGREES
                     if t <= gpus_per_host and gpus_per_host % t == 0 and t <= world)


DENSE_DECLARED: tuple[DenseStrategy, ...] = (
    DenseStrategy("ddp", "none", "all_reduce", graph_mode=True, title="data parallel"),
    DenseStrategy("fsdp", "world", "gather_scatter", sharded=True, title="fully sharded"),
    DenseStrategy("hsdp", "host", "gather_scatter", sharded=True, title="hybrid sharded"),
    DenseStrategy("tp", "tensor", "sequence_parallel", runner=False, title="tensor parallel"),
)
"""The dense strategies. Their order is the order of the solver's choices (part of its
determinism). The first is the replicated one every region may take."""

DENSE: Mapping[str, DenseStrategy] = MappingProxyType({d.name: d for d in DENSE_DECLARED})
"""The dense strategies by name: what a plan's ``regions[].strategy`` may be."""

DENSE_STRATEGIES = tuple(DENSE)
"""The dense strategies' names (defined once, here in the core)."""

REPLICATED_DENSE = DENSE_DECLARED[0].name
"""The strategy a region has unless a planner shards it."""


def runner_executes(strategy: DenseStrategy, *, world_size: int, graph_mode: bool) -> bool:
    """Whether the runner executes ``strategy`` for a region of a plan on ``world_size``
    ranks whose kernels put it in graph mode (``graph_mode``: the plan lists a kernel of a
    graph kind, ``gemc.kernel_kinds.graph_kinds``) or not: the runner's capabilities,
    declared once. Why one rule: the solver offers only what it allows
    (``SolverSettings.runner_only``) and the runner refuses the rest by it
    (``backends/torch/dense.check_strategies``, ``graph_mode.check_graph_mode``), so a
    compile never writes a plan its run refuses. In graph mode the runner trains the
    captured graph, which never calls the module hooks through which a sharded strategy
    gathers and scatters parameters; replicas' gradients it averages by post-accumulate
    hooks, which the graph's backward fires (``DenseStrategy.graph_mode``)."""
    if not strategy.runner:
        return False
    return strategy.graph_mode or not graph_mode or world_size == 1


def dense_strategy(name: str) -> DenseStrategy:
    """The dense strategy named ``name`` (a ValueError naming the known ones otherwise)."""
    found = DENSE.get(name)
    if found is None:
        raise ValueError(f"unknown dense strategy {name!r} (known: {', '.join(DENSE)})")
    return found

"""A complete assignment's step time and per-rank memory, from the priced options.

The same sums and maxima as ``cost_model.step_model.predict_step`` (tests hold the two
equal), but over options priced once and numpy vectors of ranks, so comparing planners
and checking memory stays fast at 4096 ranks, where ``predict_step`` walks every shard
of every row-wise table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gemc.cost_model.memory import lookup_gradient_extra
from gemc.cost_model.op_cost import optimizer_time
from gemc.cost_model.step_model import (
    batched_floor_s,
    exchange_cast_launch_s,
    late_gradient_peak,
    replica_all_reduce_s,
)
from gemc.cost_model.types import RegionCost, TableCost
from gemc.sharding import SHARDINGS

from .candidates import (
    AllToAll,
    DenseOption,
    TableOption,
    dense_option,
    option_of,
    summing_owners,
    table_key,
)
from .problem import Assignment, DenseChoice, Problem, TableChoice

# placements whose summing owners a Pricer remembers before it starts again (each holds
# its ranks tuple: a bound on the memory kept, never on what is priced)
SUMMING_KEPT = 4096


class Pricer:
    """Options priced on demand and remembered (identical tables share one entry)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.a2a = AllToAll.of(problem)
        self._dense: dict[tuple, DenseOption] = {}
        self._table: dict[tuple, TableOption] = {}
        self._dp_ar: dict[float, float] = {}
        self._opt: dict[float, float] = {}
        self._ids: dict[float, float] = {}
        # id(ranks) -> (ranks, sharding, candidates.summing_owners): the tuple kept alive,
        # so its id is its own. Why by id: keyed by the tuple, a choice's ranks (4,096 at
        # the largest) would be hashed again at every evaluation of every row-split table
        self._summing: dict[int, tuple[tuple[int, ...], str, int]] = {}
        # every candidate option of a class of identical tables, as the local searches
        # price them (``local_search._options_of``): shared by the planner's searches
        self.option_lists: dict[tuple, list[TableOption]] = {}

    def dense(self, region: RegionCost, choice: DenseChoice) -> DenseOption:
        key = (region.name, choice)
        o = self._dense.get(key)
        if o is None:
            o = self._dense[key] = dense_option(self.problem, region, choice)
        return o

    def dp_all_reduce(self, nbytes: float) -> float:
        """Seconds of the step's one all-reduce of the data-parallel replicas' bucket
        (``step_model.replica_all_reduce_s``, remembered)."""
        s = self._dp_ar.get(nbytes)
        if s is None:
            p = self.problem
            s = self._dp_ar[nbytes] = replica_all_reduce_s(nbytes, p.topology, p.calibration)
        return s

    def id_exchange_s(self, per_rank: float) -> float:
        """Seconds of the id all-to-all, every rank sending ``per_rank`` bytes
        (``AllToAll.even``, remembered: the searches price thousands of plans, most with
        the ids of the one before)."""
        s = self._ids.get(per_rank)
        if s is None:
            s = self._ids[per_rank] = self.a2a.even(per_rank)
        return s

    def optimizer_s(self, numel: float) -> float:
        """Seconds of the dense optimizer over ``numel`` elements per rank (remembered)."""
        s = self._opt.get(numel)
        if s is None:
            p, opts = self.problem, self.problem.options
            s = self._opt[numel] = optimizer_time(
                opts.optimizer, numel, opts.dense_dtype, p.topology.gpu, p.calibration,
                fused=opts.fused_optimizer, tensors=max(1, 2 * len(p.regions)))[0]
        return s

    def _owners(self, t: TableCost, choice: TableChoice) -> int:
        """``candidates.summing_owners`` of ``choice``, remembered by its ranks tuple."""
        if not t.pooled or not SHARDINGS[choice.sharding].row_split:
            return 1
        ranks = choice.ranks
        hit = self._summing.get(id(ranks))
        if hit is not None and hit[0] is ranks and hit[1] == choice.sharding:
            return hit[2]
        if len(self._summing) >= SUMMING_KEPT:
            self._summing.clear()
        k = summing_owners(self.problem, t, choice)
        self._summing[id(ranks)] = (ranks, choice.sharding, k)
        return k

    def table(self, t: TableCost, choice: TableChoice) -> TableOption:
        """The option of ``choice``, priced on its ranks as placed (``option_of``)."""
        key = (*table_key(t), choice.sharding, len(choice.ranks), choice.grid,
               self._owners(t, choice))
        o = self._table.get(key)
        if o is None:
            o = self._table[key] = option_of(self.problem, t, choice)
        return o


def dense_bytes(problem: Problem, pricer: Pricer, dense: dict[str, DenseChoice]) -> float:
    """Bytes every rank holds for the dense part (workspace, regions, the largest
    gathered FSDP unit and the largest recomputed region), as ``rank_memory`` counts."""
    return dense_memory(problem, pricer, dense)[0]


def dense_memory(problem: Problem, pricer: Pricer, dense: dict[str, DenseChoice]
                 ) -> tuple[float, float]:
    """(:func:`dense_bytes`, the activations among them: the room the lookups'
    gradients land in, ``memory.lookup_gradient_extra``)."""
    opts = [pricer.dense(r, dense.get(r.name, DenseChoice())) for r in problem.regions]
    ckpt = max((o.ckpt_peak for o in opts), default=0.0)
    return (float(problem.options.workspace_bytes) + sum(o.memory for o in opts)
            + max((o.transient for o in opts), default=0.0) + ckpt,
            sum(o.activations for o in opts) + ckpt)


@dataclass
class Evaluation:
    step_s: float
    breakdown: dict[str, float]
    memory: np.ndarray        # bytes per rank
    sparse: np.ndarray        # embedding seconds per rank
    out: np.ndarray           # pooled all-to-all bytes sent per rank
    shards: np.ndarray        # table shards per rank
    cap: float
    # of ``memory``: what the eager lookups' gradients add (memory.lookup_gradient_extra)
    lookup_grads: np.ndarray | None = None

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s

    @property
    def over_bytes(self) -> float:
        return max(0.0, float(self.memory.max()) - self.cap)

    @property
    def feasible(self) -> bool:
        return self.over_bytes <= 0.0

    @property
    def max_over_mean(self) -> float:
        """The fullest rank's bytes over the mean rank's (1 for an empty plan): the
        memory balance ``SolverSettings.balance_ratio`` bounds."""
        mean = float(self.memory.mean())
        return float(self.memory.max()) / mean if mean > 0 else 1.0


@dataclass
class TableLoads:
    """What the tables add per rank (embedding seconds, pooled all-to-all bytes sent,
    bytes, shards) and in total (data-parallel gradient bytes and elements, id bytes)."""

    sparse: np.ndarray
    out: np.ndarray
    mem: np.ndarray
    shards: np.ndarray
    kernel_s: np.ndarray       # the rank's batched kernel: its shards' lookup seconds
    kernel_shards: np.ndarray  # and how many it runs (step_model.batched_floor_s)
    dp_grad: float = 0.0
    dp_numel: float = 0.0
    ids: float = 0.0
    # the lookup-gradient term's parts (memory.lookup_gradient_extra): the shards'
    # activations, gradients held, the largest optimizer buffer per rank (``moment``,
    # kept exact under removal by counting each buffer size: per rank for placed shards,
    # once for options on every rank), and the dense_grad lookups' landings per rank
    act: np.ndarray | None = None
    grad: np.ndarray | None = None
    moment: np.ndarray | None = None
    rank_moments: dict[int, dict[float, int]] = field(default_factory=dict)
    uniform_moments: dict[float, int] = field(default_factory=dict)
    landing: dict[int, list[tuple[float, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.mem)
        self.act = np.zeros(n) if self.act is None else self.act
        self.grad = np.zeros(n) if self.grad is None else self.grad
        self.moment = np.zeros(n) if self.moment is None else self.moment

    def gradient_extra(self, dense_activations: float) -> np.ndarray | None:
        """Bytes per rank the lookups' gradients add (None: no lookup holds one)."""
        if not self.grad.any():
            return None
        late = np.zeros(len(self.mem))
        for r, landing in self.landing.items():
            late[r] = late_gradient_peak(landing)
        return lookup_gradient_extra(self.grad, self.moment, late,
                                     self.act + dense_activations)


@dataclass(frozen=True)
class DenseSums:
    """The dense part of the step, summed once for a choice of every region's strategy."""

    fwd: float
    bwd: float
    c_fwd: float
    c_bwd: float
    c_tp: float
    f_tail: float
    b_tail: float
    numel: float
    memory: float   # every rank: workspace, regions, largest transient and recompute
    activations: float = 0.0  # of ``memory``: the saved activations


def dense_sums(problem: Problem, pricer: Pricer, dense: dict[str, DenseChoice]) -> DenseSums:
    fwd = bwd = c_fwd = c_bwd = c_tp = f_tail = b_tail = numel = 0.0
    for r in problem.regions:
        d = pricer.dense(r, dense.get(r.name, DenseChoice()))
        fwd += d.fwd_s
        bwd += d.bwd_s
        c_fwd += d.comm_fwd
        c_bwd += d.comm_bwd
        c_tp += d.comm_tp
        f_tail = max(f_tail, d.fwd_tail)
        b_tail = max(b_tail, d.bwd_tail)
        numel += d.numel
    return DenseSums(fwd, bwd, c_fwd, c_bwd, c_tp, f_tail, b_tail, numel,
                     *dense_memory(problem, pricer, dense))


def empty_loads(world: int) -> TableLoads:
    """The loads of no table on ``world`` ranks."""
    return TableLoads(np.zeros(world), np.zeros(world), np.zeros(world),
                      np.zeros(world, dtype=np.int64), np.zeros(world),
                      np.zeros(world, dtype=np.int64))


def memory_with(loads: TableLoads, dense: DenseSums | tuple[float, float],
                o: TableOption) -> np.ndarray:
    """Each rank's bytes, as ``evaluation_of`` counts them, were one shard of ``o``
    added to that rank (``dense``: the dense part's bytes and activations): the room a
    heuristic places a shard by, with the lookups' gradients in."""
    d_mem, d_act = (dense.memory, dense.activations) if isinstance(dense, DenseSums) \
        else dense
    steady = loads.mem + d_mem + o.memory
    if not o.grad_held and not loads.grad.any():
        return steady
    late = np.zeros(len(loads.mem))
    for r in set(loads.landing) | (set(range(len(late))) if o.landing else set()):
        late[r] = late_gradient_peak([*loads.landing.get(r, ()), *o.landing])
    return steady + lookup_gradient_extra(
        loads.grad + o.grad_held, np.maximum(loads.moment, o.grad_moment), late,
        loads.act + o.activations + d_act)


def table_loads(problem: Problem, tables: dict[str, TableChoice], pricer: Pricer) -> TableLoads:
    loads = empty_loads(problem.world)
    for t in problem.tables:
        choice = tables[t.fqn]
        add_table(loads, pricer.table(t, choice), choice.ranks)
    return loads


# up to this many ranks ``add_table`` adds per rank in Python: the same sums as
# ``np.add.at`` (which adds a rank listed twice twice, in order), without its call overhead
SCALAR_RANKS = 4


def add_table(loads: TableLoads, o: TableOption, ranks: tuple[int, ...], sign: int = 1) -> None:
    """Add (sign 1) or take away (sign -1) one table's option on its ranks."""
    if o.replicated:
        loads.dp_grad += sign * o.dp_grad_bytes
        loads.dp_numel += sign * o.dp_numel
    else:
        loads.ids += sign * o.ids_bytes
    kernel = int(o.in_kernel)
    if o.grad_held:
        _add_gradient(loads, o, None if o.uniform else ranks, sign)
    if o.uniform:
        loads.sparse += sign * o.compute_s
        loads.mem += sign * o.memory
        loads.act += sign * o.activations
        loads.out += sign * o.out_bytes
        loads.shards += sign
        loads.kernel_s += sign * o.kernel_s
        loads.kernel_shards += sign * kernel
        return
    if len(ranks) <= SCALAR_RANKS:  # a few ranks: scalar adds, in np.add.at's order
        for r in ranks:
            loads.sparse[r] += sign * o.compute_s
            loads.mem[r] += sign * o.memory
            loads.act[r] += sign * o.activations
            loads.out[r] += sign * o.out_bytes
            loads.shards[r] += sign
            loads.kernel_s[r] += sign * o.kernel_s
            loads.kernel_shards[r] += sign * kernel
        return
    idx = np.asarray(ranks, dtype=np.int64)  # a rank listed twice pays twice
    np.add.at(loads.sparse, idx, sign * o.compute_s)
    np.add.at(loads.mem, idx, sign * o.memory)
    np.add.at(loads.act, idx, sign * o.activations)
    np.add.at(loads.out, idx, sign * o.out_bytes)
    np.add.at(loads.shards, idx, sign)
    np.add.at(loads.kernel_s, idx, sign * o.kernel_s)
    np.add.at(loads.kernel_shards, idx, sign * kernel)


def _add_gradient(loads: TableLoads, o: TableOption, ranks: tuple[int, ...] | None,
                  sign: int) -> None:
    """The lookup-gradient parts of one table's option on its ranks (None: every rank):
    gradients held add up, the optimizer's buffer is the rank's largest (on removal, the
    next largest its other shards have), a dense_grad lookup's landings are listed."""
    m = o.grad_moment
    # removing a zero buffer never lowers a rank's largest (buffers are >= 0): no rescan
    # (a fused shard's moment is 0; rescanning every rank that held none cost 1,040 tables
    # x 4,096 ranks 15 s of the cap search)
    rescan = sign < 0 and m > 0
    if ranks is None:
        loads.grad += sign * o.grad_held
        _count(loads.uniform_moments, m, sign)
        if sign > 0:
            np.maximum(loads.moment, m, out=loads.moment)
        elif rescan and m not in loads.uniform_moments:
            for r in np.flatnonzero(loads.moment == m):
                _refresh_moment(loads, int(r))
    else:
        for r in ranks:
            loads.grad[r] += sign * o.grad_held
            held = loads.rank_moments.setdefault(r, {})
            _count(held, m, sign)
            if sign > 0:
                loads.moment[r] = max(loads.moment[r], m)
            elif rescan and loads.moment[r] == m and m not in held \
                    and m not in loads.uniform_moments:
                _refresh_moment(loads, r)
    if o.landing:
        for r in (range(len(loads.mem)) if ranks is None else ranks):
            items = loads.landing.setdefault(r, [])
            for item in o.landing:
                if sign > 0:
                    items.append(item)
                else:
                    items.remove(item)


def _count(counts: dict[float, int], key: float, sign: int) -> None:
    n = counts.get(key, 0) + sign
    if n:
        counts[key] = n
    else:
        del counts[key]


def _refresh_moment(loads: TableLoads, r: int) -> None:
    """Rank ``r``'s largest optimizer buffer from the shards it still holds."""
    loads.moment[r] = max(max(loads.rank_moments.get(r, {}), default=0.0),
                          max(loads.uniform_moments, default=0.0))


def evaluate(problem: Problem, assignment: Assignment, pricer: Pricer | None = None) -> Evaluation:
    pricer = pricer or Pricer(problem)
    return evaluation_of(problem, pricer, dense_sums(problem, pricer, assignment.dense),
                         table_loads(problem, assignment.tables, pricer))


def evaluation_of(problem: Problem, pricer: Pricer, d: DenseSums, loads: TableLoads) -> Evaluation:
    """The step and per-rank memory of a plan from its dense sums and table loads."""
    opts, world = problem.options, problem.world
    sparse = loads.sparse + batched_floor_s(loads.kernel_s, loads.kernel_shards, world)
    out = loads.out
    a2a = input_dist = cast_launch = 0.0
    # (half a byte: what adding and taking away a table may leave behind in floats)
    if world > 1 and float(out.max(initial=0.0)) > 0.5:
        a2a = 2 * pricer.a2a.time(out)
        input_dist = pricer.id_exchange_s(loads.ids)
        cast_launch = exchange_cast_launch_s(opts.exchange, problem.calibration)
    exposed_input = 0.0 if opts.pipeline_sparse else input_dist
    c_bwd, b_tail = d.c_bwd, d.b_tail
    replica_ar = pricer.dp_all_reduce(loads.dp_grad) if loads.dp_grad > 0.5 else 0.0
    sparse_max = float(sparse.max(initial=0.0))
    exposed_fwd = max(d.f_tail if d.c_fwd else 0.0, d.c_fwd - opts.overlap * d.fwd)
    exposed_bwd = max(b_tail if c_bwd else 0.0, c_bwd - opts.overlap * (d.bwd + sparse_max))
    breakdown = {
        "sparse_compute": sparse_max,
        "all_to_all": a2a,
        "exchange_cast": cast_launch,
        "input_dist": exposed_input,
        "dense_forward": d.fwd,
        "dense_backward": d.bwd,
        "exposed_forward_comm": exposed_fwd,
        "exposed_backward_comm": exposed_bwd,
        "tp_comm": d.c_tp,
        "replica_all_reduce": replica_ar,
        "optimizer": pricer.optimizer_s(d.numel + loads.dp_numel),
    }
    memory = loads.mem + d.memory
    grads = loads.gradient_extra(d.activations)
    if grads is not None:
        memory = memory + grads
    return Evaluation(sum(breakdown.values()), breakdown, memory, sparse, out,
                      loads.shards.copy(), problem.cap_bytes, grads)

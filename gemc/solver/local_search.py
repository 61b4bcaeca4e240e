"""Local search over tables: move one table at a time to the option and ranks that lower
the predicted step most, then (at the same step) the fullest rank's memory.

Why: CP-SAT's search is budget-bound on the sparse placement (a makespan over ranks and
the all-to-all's busiest rank and host): from greedy's plan (3x its optimum on DLRMv2 at
16 ranks) it needed 10 deterministic seconds, 25-70 s of wall on two shared cores, to
get near its bound. Moving single tables with the step model's exact arithmetic
(``evaluate.evaluation_of`` on incremental loads: milliseconds a move) closes most of that
gap before CP-SAT starts, so CP-SAT's short budget goes to what a one-table move cannot
see, and the same moves polish CP-SAT's expanded plan afterwards.

A move takes a table off its ranks, then for each of its options places the pieces one
by one where the step rises least (``expand.Packer.best``: the slowest rank's lookup
and the all-to-all's busiest rank or host, least-loaded on ties, only where memory is
free), prices the whole plan exactly, and keeps the best option. ``improve`` runs two
phases of such moves. First the step, ties broken by how evenly the step's per-rank and
per-host terms are spread (``spread_key``): on a plateau, where several ranks share the
maximum, no single move lowers the step, but one that unloads one of them lowers the
spread, and the next such move may then lower the step (DLRMv2 at 64 ranks: greedy's
plan searched to 4.05 ms by the step alone, to 3.38 with the spread), never filling the
fullest rank past the start's at an equal step. Then memory at
that step (``plan_key``: over the cap, step to the nanosecond, fullest rank's bytes, sum
of squared rank bytes), the planner's second objective (headroom for activations and
fragmentation). So a move never makes the step worse.

``balance`` trades step for memory within a tolerance: pieces go where memory is
emptiest among the places the step may still rise to, then the step is won back with
the fullest rank held (``planners.balanced_plan`` keeps its plan only where it pays).

``cap_memory`` searches for a plan at a max / mean target instead: the bytes above the
cap summed over ranks first (a move that unloads one of several ranks at the maximum
lowers it), then the step with that held.

``spread_sends`` spreads the pooled all-to-all's bytes over the ranks where the step and
the fullest rank stay as they are (robust to an exchange without PXN; what TorchRec's
estimator charges per rank).

Deterministic: tables in a fixed order (heaviest first), a fixed number of sweeps, and
a cap on priced moves (``SolverSettings.search_moves``, scaled down beyond
SEARCH_FULL_WORLD ranks), never a wall clock.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gemc.cost_model.types import TableCost

from .candidates import TableOption, least_bytes, table_key, table_options
from .evaluate import (
    DenseSums,
    Evaluation,
    Pricer,
    TableLoads,
    add_table,
    dense_sums,
    evaluation_of,
    table_loads,
)
from .expand import Packer
from .problem import Assignment, Problem, TableChoice


def plan_key(ev: Evaluation) -> tuple[float, int, float, float]:
    """Lower is better: over the cap, then the step (ns), then memory balance."""
    mem = ev.memory
    return (ev.over_bytes, int(round(ev.step_s * 1e9)), float(mem.max(initial=0.0)),
            float(np.square(mem / 1e9).sum()))


def spread_key(ev: Evaluation, pricer: Pricer) -> tuple[float, int, int]:
    """Lower is better: over the cap, then the step (ns), then how evenly the step's
    per-rank and per-host terms are spread (sum of squares, ns^2)."""
    a2a = pricer.a2a
    rank = ev.sparse + 2 * a2a.intra_out * ev.out
    ssq = float(np.square(np.rint(rank * 1e9)).sum())
    if a2a.hosts > 1:
        host = ev.out.reshape(a2a.hosts, a2a.local).sum(axis=1) * (2 * a2a.host_out)
        ssq += float(np.square(np.rint(host * 1e9)).sum())
    return (ev.over_bytes, int(round(ev.step_s * 1e9)), int(ssq))


class _State:
    """A plan being improved: its choices, exact loads and the packer's view of them."""

    def __init__(self, problem: Problem, pricer: Pricer, a: Assignment) -> None:
        self.p, self.pricer = problem, pricer
        self.dense: DenseSums = dense_sums(problem, pricer, a.dense)
        self.tables = dict(a.tables)
        self.loads: TableLoads = table_loads(problem, self.tables, pricer)
        self.pack = Packer(problem, pricer, self.dense.memory)
        self.option: dict[str, TableOption] = {}
        for t in problem.tables:
            o = self.option[t.fqn] = pricer.table(t, self.tables[t.fqn])
            self._pack(o, self.tables[t.fqn], 1)

    def _pack(self, o: TableOption, choice: TableChoice, sign: int) -> None:
        if o.uniform:
            self.pack.add_uniform(o, sign)
            return
        for start in choice.ranks[:: o.width]:
            self.pack.add(o, start, sign)

    def take(self, fqn: str) -> None:
        o, choice = self.option[fqn], self.tables[fqn]
        add_table(self.loads, o, choice.ranks, -1)
        self._pack(o, choice, -1)

    def put(self, fqn: str, o: TableOption, choice: TableChoice) -> None:
        add_table(self.loads, o, choice.ranks, 1)
        self._pack(o, choice, 1)
        self.option[fqn], self.tables[fqn] = o, choice

    def place(self, o: TableOption, slack: float | None = None) -> TableChoice:
        """The option's pieces where the step rises least (the table is off the plan), or
        with ``slack``, where memory is emptiest among places the step may rise to; left
        in the packer's view (``price`` takes them away again)."""
        world = self.p.world
        if o.uniform:
            self.pack.add_uniform(o, 1)
            return TableChoice(o.sharding, tuple(range(world)), o.grid)
        starts: list[int] = []
        for _ in range(o.pieces):
            start = self.pack.best(o, 0, world, starts, slack)
            self.pack.add(o, start)  # the next piece sees this one
            starts.append(start)
        self.pack.overflow = False  # a place without room is priced (over the cap) instead
        starts.sort()
        return TableChoice(o.sharding, tuple(r for s in starts for r in range(s, s + o.width)),
                           o.grid)

    def price(self, fqn: str, o: TableOption, key: Callable[[Evaluation], tuple],
              slack: float | None = None) -> tuple[TableChoice, tuple]:
        """The option placed, the plan's key with it; the table is off the plan after."""
        choice = self.place(o, slack)
        add_table(self.loads, o, choice.ranks, 1)
        k = key(self.evaluation())
        add_table(self.loads, o, choice.ranks, -1)
        self._pack(o, choice, -1)
        return choice, k

    def evaluation(self) -> Evaluation:
        return evaluation_of(self.p, self.pricer, self.dense, self.loads)

    def over(self, fqn: str, cap: float) -> bool:
        """Whether a rank holding a piece of table ``fqn`` holds more than ``cap`` bytes."""
        mem = self.loads.mem
        ranks = self.tables[fqn].ranks
        if len(ranks) >= self.p.world:
            return float(mem.max(initial=0.0)) + self.dense.memory > cap
        return any(mem[r] + self.dense.memory > cap for r in ranks)


# a priced move costs numpy work over vectors of every rank: beyond this many ranks the
# budget of moves shrinks in proportion (the same work at any size; from hundreds of
# ranks the model is fluid and CP-SAT's solution, not the hint, decides the plan: DLRMv2's
# plans at 512 and 4,096 ranks, 26 and 1,040 tables, were the same at 256 as at 512, in
# 30-40% less of the parent's CPU at 1,040 tables x 512 ranks)
SEARCH_FULL_WORLD = 256

# the slowest ranks ``_relieve`` tries, slowest first, until one's tables moved together pay
RELIEVE_RANKS = 3


def move_budget(problem: Problem, max_moves: int | None = None) -> int:
    """Priced moves allowed in one phase of the search."""
    moves = problem.settings.search_moves if max_moves is None else max_moves
    if max_moves is None and problem.world > SEARCH_FULL_WORLD:
        moves = moves * SEARCH_FULL_WORLD // problem.world
    return moves


def improve(problem: Problem, pricer: Pricer, a: Assignment, *, sweeps: int = 4,
            max_moves: int | None = None, relieve: bool = True) -> Assignment:
    """A plan no worse than ``a`` under ``plan_key`` (dense choices unchanged): first the
    step, with ties broken toward spread per-rank terms (``spread_key``), then memory
    balance at that step (``plan_key``); ``max_moves`` priced moves in each phase.
    ``relieve``: after each sweep of single moves, the slowest ranks' one-rank tables
    moved off together (``_relieve``); off, only single moves (a study's baseline)."""
    if problem.world <= 1 or not problem.tables:
        return a
    budget = move_budget(problem, max_moves)
    options = shared_options(problem, pricer)
    s = _State(problem, pricer, a)
    held = int(s.evaluation().memory.max(initial=0.0) // 2**20)

    def spread(ev: Evaluation) -> tuple[float, int, int, int]:
        # at an equal step, a move to spread the ranks' terms may not fill the fullest
        # rank past the start's: where every rank's lookup sits at its kernel's floor
        # (step_model.batched_floor_s) the step is flat over many plans, and spreading
        # alone undid CP-SAT's memory balance (16 tables x 8 ranks: 45.9 -> 55.1 GB)
        over, step, ssq = spread_key(ev, pricer)
        return (over, step, max(held, int(ev.memory.max(initial=0.0) // 2**20)), ssq)

    _sweep(s, options, sweeps, budget, spread, relieve=relieve)
    _sweep(s, options, sweeps, budget, plan_key, relieve=relieve)
    return Assignment(dense=dict(a.dense), tables=dict(s.tables))


def balance(problem: Problem, pricer: Pricer, a: Assignment, tolerance: float, *,
            sweeps: int = 4, max_moves: int | None = None) -> Assignment:
    """Memory balance with the step allowed to grow by ``tolerance`` (a share of ``a``'s
    step): the fullest rank's bytes, then the sum of squares, while the step stays
    within the limit (a plan over it keeps its step as the first key, so the search never
    goes further past it); then the step as low as it goes with the fullest rank held."""
    if problem.world <= 1 or not problem.tables:
        return a
    budget = move_budget(problem, max_moves)
    s = _State(problem, pricer, a)
    limit_s = s.evaluation().step_s * (1 + tolerance)
    limit = int(round(limit_s * 1e9))

    def spread(ev: Evaluation) -> tuple[float, int, float, float]:
        over, step, mem_max, mem_sq = plan_key(ev)
        return (over, step if step > limit else 0, mem_max, mem_sq)

    def recover(ev: Evaluation) -> tuple[float, int, int, int, float]:
        over, step, mem_max, mem_sq = plan_key(ev)
        return (over, step if step > limit else 0, int(mem_max // 2**20), step, mem_sq)

    options = shared_options(problem, pricer)
    _sweep(s, options, sweeps, budget, spread,
           lambda: max(0.0, limit_s - s.evaluation().step_s))
    # then the step back, the fullest rank's MiB held: what the spreading gave up for
    # nothing (moves that only evened out ranks below the fullest)
    _sweep(s, options, sweeps, budget, recover)
    return Assignment(dense=dict(a.dense), tables=dict(s.tables))


def sends_key(ev: Evaluation) -> tuple[int, int]:
    """Lower is better: the most pooled all-to-all bytes one rank sends (MiB), then the
    sum of squares of every rank's (how evenly the ranks' NICs would be loaded)."""
    mib = ev.out / 2**20
    return int(mib.max(initial=0.0)), int(np.square(np.rint(mib)).sum())


def spread_sends(problem: Problem, pricer: Pricer, a: Assignment, *, sweeps: int = 4,
                 max_moves: int | None = None, tolerance: float = 0.0) -> Assignment:
    """The plan with its pooled all-to-all sends spread over the ranks, at no cost in
    step and none in the fullest rank's memory: tables move only where the step does not
    rise above ``a``'s and no rank fills past ``a``'s fullest; among such places, pieces go
    to the rank sending least (``Packer.fill``), and a move is kept when the most bytes one
    rank sends drops (then their sum of squares).

    Why, on a plan spanning hosts: a table- or column-wise shard's pooled output goes to
    every rank's local batch, so (hosts - 1) / hosts of it crosses hosts wherever the
    shard sits; the step model (``collectives._all_to_all``) prices those bytes at the
    host's NICs together, because NCCL's PXN (2.12+, on by default) sends each of them
    through the host peer on the destination's rail. Where PXN does not apply (it is off,
    ``NCCL_P2P_PXN_LEVEL=0``, or the NICs are not rail-matched) a rank's cross-host bytes
    leave by its own NIC, and the rank sending most sets the exchange: DLRMv2's 16-rank
    plan sent 114 MB from one rank against a 51 MB mean, which at one NIC's 41 GB/s (the
    all-to-all rate fitted in ``collectives.CommEfficiency``) is 1.5 ms a direction where
    an even spread takes 0.7. TorchRec's estimator charges each shard's output to the
    rank holding it in the same way (``TableWiseEvaluator``: the shard's outputs at
    ``inter_host_bw``, summed per rank). So among plans the step model prices equal, the
    one whose ranks send evenly is kept. ``tolerance`` lets the step rise by that share of
    ``a``'s (the planner passes 0; a study of what a wider spread costs may pass more)."""
    if problem.world <= 1 or not problem.tables or pricer.a2a.hosts <= 1:
        return a
    budget = move_budget(problem, max_moves)
    s = _State(problem, pricer, a)
    s.pack.fill = "sends"
    start = s.evaluation()
    limit_s = start.step_s * (1 + tolerance)
    limit = int(round(limit_s * 1e9))
    held = int(start.memory.max(initial=0.0) // 2**20)
    # pieces only where a rank stays under the fullest one: the ranks sending least are
    # often the fullest (DLRMv2 x 64: the 2-way column shards of 40M-row tables, 11.9 GB
    # and one 8-column piece each), and a piece there was a move the key then refused
    s.pack.free -= max(0.0, problem.cap_bytes - float(start.memory.max(initial=0.0)))

    def key(ev: Evaluation) -> tuple[float, int, int, int, int]:
        over, step, mem_max, _ = plan_key(ev)
        return (over, step if step > limit else 0, max(held, int(mem_max // 2**20)),
                *sends_key(ev))

    options = shared_options(problem, pricer)
    _sweep(s, options, sweeps, budget, key, lambda: max(0.0, limit_s - s.evaluation().step_s))
    return Assignment(dense=dict(a.dense), tables=dict(s.tables))


def shared_options(problem: Problem, pricer: Pricer) -> dict[tuple, list[TableOption]]:
    """Where a search keeps its tables' options: the pricer's (``Pricer.option_lists``),
    so the planner's searches (the step's, the balance and cap searches, the sends')
    price each class's options once between them, not once each; a fresh dict where the
    pricer was made for another problem."""
    return pricer.option_lists if pricer.problem is problem else {}


def _options_of(problem: Problem, options: dict[tuple, list[TableOption]],
                t: TableCost) -> list[TableOption]:
    """A table's options, priced once per class of identical tables."""
    key = table_key(t)
    if key not in options:
        options[key] = table_options(problem, t)
    return options[key]


def steady_bytes(ev: Evaluation) -> np.ndarray:
    """Each rank's bytes without what the lookups' gradients add at the end of the
    step (``Evaluation.lookup_grads``): the part that adds up shard by shard, as the
    packer (``expand.Packer``) and ``mean_floor`` count it."""
    return ev.memory if ev.lookup_grads is None else ev.memory - ev.lookup_grads


def mean_floor(problem: Problem, dense_bytes: float,
               options: dict[tuple, list[TableOption]]) -> float:
    """The least mean rank memory any plan with this dense part can have: each table in
    its option of fewest bytes over all ranks (``candidates.least_bytes``). A plan whose fullest
    rank is under ``ratio`` x this has max / mean <= ``ratio`` whatever its tables do;
    measured against the plan's own mean instead, replicating a table would lower the
    ratio while only adding bytes."""
    tables = sum(least_bytes(_options_of(problem, options, t)) for t in problem.tables)
    return dense_bytes + tables / max(1, problem.world)


# the priced phase of ``cap_memory`` sweeps until a sweep moves nothing (or its move budget
# is spent), not ``sweeps`` times: its key trades step against the bytes above the cap, so
# a move early in the order changes what later tables may do. On DLRMv2 x 64 ranks four
# sweeps stopped it mid-way at 4.879 ms (+6.0% of step), converged it ended at 4.692 ms
# (+1.9%), both at max / mean 1.29 (BENCHMARKS.md, issue 19, s13)
PRICED_SWEEPS = 16


def cap_memory(problem: Problem, pricer: Pricer, a: Assignment, ratio: float, *,
               sweeps: int = 4, max_moves: int | None = None,
               penalty: float = 0.0, gradients: bool = False) -> Assignment:
    """A plan at max / mean <= ``ratio``: every rank's memory under ``ratio`` x
    ``mean_floor`` where single table moves get it there, at the lowest step they find
    with that held.

    Why a cap and not a weight: the step search's memory tie-break (``plan_key``) and
    ``balance``'s emptiest-place search move a table only while the fullest rank drops;
    where several ranks share the maximum (DLRMv2 at 64 ranks: three 40M-row tables
    column-wise over 8 ranks, 24 ranks at 4.9 GB against a 3.2 GB mean) no single move
    lowers it. Here the first key is the bytes above the cap summed over ranks, which
    every such move lowers, and pieces go only where a rank stays under the cap
    (``Packer.free`` lowered to it) where the step rises least; then the step, its
    per-rank terms spread (``spread_key``), then as ``plan_key``.

    ``penalty`` > 0 puts a phase before those: the step plus a price on the bytes above
    the cap, ``penalty`` x the start's step for every ``mean_floor`` of them, so a move
    that unloads ranks is taken where it costs little step and an expensive one waits
    (the hard phases then finish what is left over the cap). Why: with the excess first,
    the first move is the one that unloads most, whatever its step. On DLRMv2 at 64
    ranks that put the pooling-100 40M-row table in 16 column shards (1.6 ms of lookup
    each) and the capped plan lost 12.8% of step (4.418 ms); with ``penalty`` 0.025-0.075
    it kept that table on the 8x8 grid, spread the four others over 16 ranks each and
    lost 4.5% (4.092 ms, max/mean 1.07); ``planners.capped_plan`` runs it where the hard
    search alone costs more than its tolerance. That phase sweeps until it moves nothing
    (``PRICED_SWEEPS``); where its plan meets ``ratio`` by the plan's own mean, the hard
    phases do not run after it: they take any step for a MiB less above the cap. On
    DLRMv2 x 64 ranks, after four priced sweeps (4.879 ms, max / mean 1.29, 2.7 GB still
    above the cap) they moved a 4-row data-parallel table onto one rank (+2.6 ms) for a
    few MiB and ended at 8.456 ms; swept to the end, the priced phase reaches 4.692 ms.

    The bytes above the cap are the steady ones (``steady_bytes``), without what the
    lookups' sparse gradients add at the end of the step (``memory.lookup_gradient_extra``:
    not additive, the rank's largest optimizer buffer, in the room its activations
    leave), which neither ``mean_floor`` nor the packer counts. Counted against a cap
    from the floor, they were an excess no plan clears: on DLRMv2 x 64 ranks 0.51 GB a
    rank on the mean, so the plan s13 kept (4.692 ms, 1.28 with them) stood 11.8 GB
    above the cap, not 2.8, and the priced phase paid step for it (4.958 ms, +7.7%;
    5.372 ms, +16.7% before the row update's buffers were priced). Whether a plan meets
    ``ratio`` is still judged on all of its bytes (``Evaluation.max_over_mean``).
    ``gradients``: every byte against the cap raised by ``ratio`` x the start's mean
    gradient term, for a start whose ranks clear the steady cap but not the ratio
    (``planners.cap_search``'s third try).

    Returned: the fastest plan that met ``ratio`` by its own mean at the end of a phase
    (what ``planners.capped_plan`` accepts), else the last plan. The cap is ``ratio`` x the
    least mean because a plan under it meets ``ratio`` whatever it replicates; a plan
    above it may meet it too (DLRMv2 x 64 ranks: 8-way column shards of the 40M-row
    tables, 4.19 GB on a 3.26-GB mean, where the least mean is 3.13 GB)."""
    if problem.world <= 1 or not problem.tables:
        return a
    budget = move_budget(problem, max_moves)
    options = shared_options(problem, pricer)
    s = _State(problem, pricer, a)
    floor = mean_floor(problem, s.dense.memory, options)
    target = ratio * floor
    s.pack.free -= max(0.0, problem.cap_bytes - target)
    start = s.evaluation()
    if gradients and start.lookup_grads is not None:
        # every byte against a cap raised by the start's mean gradient term
        target += ratio * float(start.lookup_grads.mean())
    met: list[tuple[int, dict[str, TableChoice]]] = []  # the fastest plan meeting ratio

    def keep_if_met() -> bool:
        """Remember the plan if it meets ``ratio`` (by its own mean, as the planner
        judges it) faster than any before; whether it meets it."""
        ev = s.evaluation()
        if not (ev.feasible and ev.max_over_mean <= ratio):
            return False
        step = int(round(ev.step_s * 1e9))
        if not met or step < met[0][0]:
            met[:] = [(step, dict(s.tables))]
        return True

    def excess(ev: Evaluation) -> int:
        # the steady bytes, as the packer and ``mean_floor`` count them (see the doc)
        held = ev.memory if gradients else steady_bytes(ev)
        return int(np.maximum(held - target, 0.0).sum() // 2**20)

    def first(ev: Evaluation) -> tuple[float, int, int, int]:
        over, step, ssq = spread_key(ev, pricer)
        return (over, excess(ev), step, ssq)

    def then(ev: Evaluation) -> tuple[float, int, int, float, float]:
        over, step, mem_max, mem_sq = plan_key(ev)
        return (over, excess(ev), step, mem_max, mem_sq)

    priced_met = False
    if penalty > 0:
        # ns of step one MiB above the cap is worth (excess counts MiB)
        per_mib = penalty * start.step_s * 1e9 * 2**20 / max(1.0, floor)

        def priced(ev: Evaluation) -> tuple[float, int, int, int]:
            over, step, ssq = spread_key(ev, pricer)
            e = excess(ev)
            return (over, step + int(round(per_mib * e)), e, ssq)

        _sweep(s, options, max(sweeps, PRICED_SWEEPS), budget, priced, relieve=True)
        priced_met = keep_if_met()
    if not priced_met:
        # where the budget cannot price every table's options once, only tables on a
        # rank above the cap: moving any other cannot lower the excess, and pricing them
        # spent the budget (1,040 tables x 512 ranks: 5,000 moves, under one sweep of
        # ~9,400, left 1.56). Where it can, every table (they may still win step back)
        sweep_moves = sum(len(_options_of(problem, options, t)) for t in problem.tables)
        only = (lambda t: s.over(t.fqn, target)) if sweep_moves > budget else None
        _sweep(s, options, sweeps, budget, first, only=only, relieve=True)
        keep_if_met()
        _sweep(s, options, sweeps, budget, then, relieve=True)
        keep_if_met()
    return Assignment(dense=dict(a.dense), tables=met[0][1] if met else dict(s.tables))


def split_oversized(problem: Problem, pricer: Pricer, a: Assignment, ratio: float
                    ) -> list[Assignment]:
    """Starts for ``cap_memory``: ``a`` with every table whose shard alone is over
    ``ratio`` x the plan's mean rank (no plan holding it meets the ratio) re-sharded, all
    of them the same way, one start per sharding (type, ranks, grid) that at least halves
    each such shard, the tables placed one after the other where the step rises least;
    fastest start first. Empty where no table is that large.

    Why several: where ``cap_memory`` ends depends on the path, and from the fastest plan
    it moves the largest tables first, one at a time. On DLRMv2 x 64 ranks, once a row
    shard's partials were summed in their host (``cost_model.step_model.
    host_reduce_owners``), the fastest plan held three 40M-row tables whole and the priced
    cap search from it stopped at max / mean 1.33; from some of these starts it ends under
    1.3 and from others (the tables on a host's row shards, say) it does not, so each is
    tried (``tests/solver/test_balance.py``, the 64-rank fixture: 3.170 ms at 7.04, priced
    3.326 ms at 1.33, through these starts 3.175 ms at 1.29)."""
    if problem.world <= 1 or not problem.tables:
        return []
    options = shared_options(problem, pricer)
    s = _State(problem, pricer, a)
    cap = ratio * float(s.evaluation().memory.mean())
    large = sorted((t for t in problem.tables if s.option[t.fqn].memory > cap),
                   key=lambda t: (-s.option[t.fqn].memory, t.fqn))
    if not large:
        return []

    def kind(o: TableOption) -> tuple:
        return (o.sharding, o.ranks, o.grid)

    halved = [{kind(o): o for o in _options_of(problem, options, t)
               if not o.replicated and o.memory <= s.option[t.fqn].memory / 2}
              for t in large]
    starts: list[tuple[tuple, Assignment]] = []
    for k in (k for k in halved[0] if all(k in f for f in halved[1:])):
        trial = _State(problem, pricer, a)
        for t, f in zip(large, halved):
            trial.take(t.fqn)
            choice = trial.place(f[k])
            trial._pack(f[k], choice, -1)  # ``place`` left it in the packer's view
            trial.put(t.fqn, f[k], choice)
        starts.append((plan_key(trial.evaluation()),
                       Assignment(dense=dict(a.dense), tables=dict(trial.tables))))
    return [b for _, b in sorted(starts, key=lambda x: x[0])]


def _sweep(s: _State, options: dict[tuple, list[TableOption]], sweeps: int, budget: int,
           plan_key: Callable[[Evaluation], tuple],
           slack: Callable[[], float] | None = None,
           only: Callable[[TableCost], bool] | None = None,
           relieve: bool = False) -> None:
    """Move tables, heaviest first, while ``plan_key`` improves (at most ``budget``
    priced moves). ``slack``: how far the step may rise with the moved table off the
    plan; its pieces then go where memory is emptiest within that (``Packer.best``).
    ``only``: the tables worth moving when their turn comes (the others are not priced).
    ``relieve``: after each sweep, the slowest ranks' one-rank tables moved together
    (``_relieve``); the sweeps go on while either kind of move pays."""
    problem = s.p

    def opts_of(t: TableCost) -> list[TableOption]:
        return _options_of(problem, options, t)

    def weight(t: TableCost) -> tuple[float, str]:
        o = s.option[t.fqn]
        return (-s.pack.size(o) * len(s.tables[t.fqn].ranks), t.fqn)

    order = sorted(problem.tables, key=weight)
    best_key = plan_key(s.evaluation())
    moves = 0
    for _ in range(sweeps):
        changed = False
        for t in order:
            if moves >= budget:
                break
            if only is not None and not only(t):
                continue
            current = (s.option[t.fqn], s.tables[t.fqn])
            s.take(t.fqn)
            room = slack() if slack is not None else None
            chosen, chosen_key = current, best_key
            for o in opts_of(t):
                choice, key = s.price(t.fqn, o, plan_key, room)
                moves += 1
                if key < chosen_key:
                    chosen, chosen_key = (o, choice), key
            s.put(t.fqn, *chosen)
            if chosen_key < best_key:
                best_key, changed = chosen_key, True
        if relieve and moves < budget:  # after the single moves, several at once
            relieved, priced = _relieve(s, plan_key, best_key, budget - moves)
            moves += priced
            changed = changed or relieved < best_key
            best_key = relieved
        if not changed or moves >= budget:
            break


def _relieve(s: _State, plan_key: Callable[[Evaluation], tuple], best_key: tuple,
             budget: int) -> tuple[tuple, int]:
    """The slowest ranks' one-rank tables moved off together (the first of the
    ``RELIEVE_RANKS`` slowest ranks where it pays): smallest first, each to the other
    rank where the plan prices best (``plan_key``, exactly, on every rank), the others
    still where they were; the moves up to the one after which the plan priced best are
    kept where that beats ``best_key``, the rest put back. (the plan's key after, priced
    moves; a rank is skipped where it would take more than ``budget``, so beyond a few
    hundred ranks, where the budget is scaled down, it rarely runs).

    Why: ``_sweep`` moves one table at a time to where ``expand.Packer.best`` puts it
    (the step's terms as the packer sums them, only where its memory is free). Where the
    step is a plateau over ranks, one table off the slowest rank may not lower it while
    two do (``tests/solver/test_relieve.py``). And pricing every rank exactly finds
    places the packer passes over: DLRMv2 x 16 ranks, the cap search's plan 4.942 ->
    4.885 ms (single tables off ranks 14 and 4 into a little of the cap's excess at its
    price), under the placement bound's 4.888 (BENCHMARKS.md, s24)."""
    priced = 0
    for r in np.argsort(-s.evaluation().sparse, kind="stable")[:RELIEVE_RANKS]:
        key, n = _relieve_rank(s, int(r), plan_key, best_key, budget - priced)
        priced += n
        if key < best_key:
            return key, priced
    return best_key, priced


def _relieve_rank(s: _State, r: int, plan_key: Callable[[Evaluation], tuple],
                  best_key: tuple, budget: int) -> tuple[tuple, int]:
    """``_relieve`` on rank ``r``."""
    p = s.p
    fqns = sorted((f for f, c in s.tables.items()
                   if c.ranks == (r,) and not s.option[f].uniform and s.option[f].width == 1),
                  key=lambda f: (s.pack.size(s.option[f]), f))
    if len(fqns) < 2 or len(fqns) * (p.world - 1) > budget:
        return best_key, 0
    start = {f: s.tables[f] for f in fqns}
    kept, kept_key, priced = 0, best_key, 0
    for i, f in enumerate(fqns):
        o, c = s.option[f], s.tables[f]
        s.take(f)
        chosen: tuple[tuple, TableChoice] | None = None
        for q in range(p.world):
            if q == r:
                continue
            add_table(s.loads, o, (q,), 1)
            k = plan_key(s.evaluation())
            add_table(s.loads, o, (q,), -1)
            priced += 1
            if chosen is None or k < chosen[0]:
                chosen = (k, TableChoice(c.sharding, (q,), c.grid))
        assert chosen is not None
        s.put(f, o, chosen[1])
        if chosen[0] < kept_key:
            kept, kept_key = i + 1, chosen[0]
    for f in reversed(fqns[kept:]):
        s.take(f)
        s.put(f, s.option[f], start[f])
    return kept_key, priced

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
free), prices the whole plan exactly, and keeps the best option: the plan's order is
(memory over the cap, step to the nanosecond, fullest rank's bytes, sum of squared rank
bytes). So a move never makes the step worse, and among equal steps it spreads memory,
which is the planner's second objective (headroom for activations and fragmentation).

Deterministic: tables in a fixed order (heaviest first), a fixed number of sweeps, and
a cap on priced moves (``SolverSettings.search_moves``), never a wall clock.
"""

from __future__ import annotations

import numpy as np

from .candidates import TableOption, table_options
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

    def place(self, o: TableOption) -> TableChoice:
        """The option's pieces where the step rises least (the table is off the plan)."""
        world = self.p.world
        if o.uniform:
            return TableChoice(o.sharding, tuple(range(world)), o.grid)
        starts: list[int] = []
        for _ in range(o.pieces):
            start = self.pack.best(o, 0, world, starts)
            self.pack.add(o, start)  # the next piece sees this one
            starts.append(start)
        for start in starts:
            self.pack.add(o, start, -1)
        self.pack.overflow = False  # a place without room is priced (over the cap) instead
        starts.sort()
        return TableChoice(o.sharding, tuple(r for s in starts for r in range(s, s + o.width)),
                           o.grid)

    def evaluation(self) -> Evaluation:
        return evaluation_of(self.p, self.pricer, self.dense, self.loads)


def improve(problem: Problem, pricer: Pricer, a: Assignment, *, sweeps: int = 4,
            max_moves: int | None = None) -> Assignment:
    """A plan no worse than ``a`` under ``plan_key`` (dense choices unchanged)."""
    if problem.world <= 1 or not problem.tables:
        return a
    budget = problem.settings.search_moves if max_moves is None else max_moves
    s = _State(problem, pricer, a)
    options: dict[tuple, list[TableOption]] = {}

    def opts_of(t) -> list[TableOption]:
        key = (t.rows, t.dim, t.nnz, t.batch, t.dtype_bytes, t.pooled)
        if key not in options:
            options[key] = table_options(problem, t)
        return options[key]

    def weight(t) -> tuple[float, str]:
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
            current = (s.option[t.fqn], s.tables[t.fqn])
            s.take(t.fqn)
            chosen, chosen_key = current, best_key
            for o in opts_of(t):
                choice = s.place(o)
                s.put(t.fqn, o, choice)
                key = plan_key(s.evaluation())
                s.take(t.fqn)
                moves += 1
                if key < chosen_key:
                    chosen, chosen_key = (o, choice), key
            s.put(t.fqn, *chosen)
            if chosen_key < best_key:
                best_key, changed = chosen_key, True
        if not changed or moves >= budget:
            break
    return Assignment(dense=dict(a.dense), tables=dict(s.tables))

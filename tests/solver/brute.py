"""Every assignment of a tiny problem, for checking the planners against the true optimum."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from gemc.solver.candidates import dense_choices, table_options
from gemc.solver.problem import Assignment, Problem, TableChoice


def table_choices(problem: Problem, t) -> list[TableChoice]:
    world, local = problem.world, problem.topology.gpus_per_host
    out = []
    for o in table_options(problem, t):
        if o.uniform:
            out.append(TableChoice(o.sharding, tuple(range(world)), o.grid))
            continue
        blocks = range(0, world, o.width)
        for starts in itertools.combinations(blocks, o.pieces):
            ranks = tuple(r for s in starts for r in range(s, s + o.width))
            out.append(TableChoice(o.sharding, ranks, o.grid))
    assert local >= 1
    return out


def assignments(problem: Problem) -> Iterator[Assignment]:
    dense = [dense_choices(problem, r) for r in problem.regions]
    tables = [table_choices(problem, t) for t in problem.tables]
    for d in itertools.product(*dense):
        for ts in itertools.product(*tables):
            yield Assignment(dense={r.name: c for r, c in zip(problem.regions, d)},
                             tables={t.fqn: c for t, c in zip(problem.tables, ts)})

"""The naive baseline: FSDP for every dense region (where the runner executes it next to
the plan's kernels: ``Problem.offers``; else DDP), tables table-wise round-robin.

What a first distributed port of a model does, and the floor the other planners must
beat. Tables go to ranks 0, 1, 2, ... in name order; a table too large for one GPU takes
the sharding with the smallest shards instead, on the ranks holding the fewest shards
(there is no table-wise placement of it to be naive about), and so does a table only a
whole replica runs right (``TableCost.replicated_only``: its options are the replicated
ones). Memory is not balanced, only checked: a plan over the cap is refused.
"""

from __future__ import annotations

import numpy as np

from gemc.sharding import REPLICATED_DENSE, dense_strategy

from .candidates import table_option, table_options
from .greedy import _place
from .problem import Assignment, DenseChoice, Problem, TableChoice


def naive(problem: Problem) -> Assignment:
    world, local = problem.world, problem.topology.gpus_per_host
    a = Assignment()
    for r in problem.regions:
        shard = world > 1 and r.params > 0 and problem.can_place(r.name) \
            and problem.offers(dense_strategy("fsdp"))
        a.dense[r.name] = DenseChoice("fsdp" if shard else REPLICATED_DENSE)
    shards = np.zeros(world)
    next_rank = 0
    for t in problem.tables:
        if world == 1 or (not t.replicated_only
                          and table_option(problem, t, "table_wise", 1).memory
                          <= problem.cap_bytes):
            rank = next_rank % world
            a.tables[t.fqn] = TableChoice("table_wise", (rank,))
            shards[rank] += 1
            next_rank += 1
            continue
        o = min(table_options(problem, t), key=lambda o: (o.memory, o.ranks))
        ranks = _place(o, np.ones(world, dtype=bool), shards, world, local)
        assert ranks is not None
        a.tables[t.fqn] = TableChoice(o.sharding, ranks, o.grid)
        shards[list(ranks)] += 1
    return a

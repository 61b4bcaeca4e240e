"""Small synthetic planning problems (no capture): a handful of regions and tables."""

from __future__ import annotations

import random

from gemc.cost_model.topology import parse_topology
from gemc.cost_model.types import RegionCost, StepOptions, TableCost

from gemc.solver.problem import Problem, SolverSettings


def make_problem(topology: str = "h200:1x4", *, n_tables: int = 6, n_regions: int = 3,
                 seed: int = 0, batch: int = 2048, big: float = 1.0,
                 settings: SolverSettings | None = None, **kw) -> Problem:
    rng = random.Random(seed)
    regions = [
        RegionCost(f"r{i}", params=rng.choice([0, 10**6, 5 * 10**7]) if i else 0,
                   fwd_flops=1e12, compute_s=rng.uniform(1e-3, 2e-2),
                   activation_bytes=rng.randint(1, 8) * 10**9, boundary_bytes=10**8)
        for i in range(n_regions)
    ]
    tables = [
        TableCost(f"t{i}", rows=int(rng.choice([10**4, 10**5, 10**6, 10**7]) * big),
                  dim=rng.choice([32, 64, 128]), nnz=batch * rng.randint(1, 40), batch=batch)
        for i in range(n_tables)
    ]
    kw.setdefault("options", ADAMW_TABLES)
    return Problem(tuple(regions), tuple(tables), parse_topology(topology),
                   settings=settings or SolverSettings(time_limit_s=5), **kw)


# The problems here were sized when tables defaulted to AdamW (3x their bytes with the
# state); the runner's default, rowwise Adagrad, keeps ~1x, and memory would no longer bind.
ADAMW_TABLES = StepOptions(table_optimizer="adamw")

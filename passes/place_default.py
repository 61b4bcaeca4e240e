"""place-default: a simple, always-feasible-when-possible placement, used until the solver runs.

Dense regions are replicated (DDP). Tables go table-wise, round-robin over the ranks in
order of size (largest first), except tables too large for one GPU's share of memory,
which go row-wise over every rank, and tables only a whole replica runs right
(collect-tables' ``replicated`` reasons: read outside their lookups, max pooling), which
are replicated (``data_parallel``) on every rank. The plan says ``"planner": "default"`` so nobody
mistakes this for an optimised placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.ir import OpKind
from gemc.sharding import REPLICATED_DENSE

# A table whose weights plus row-wise optimizer state exceed this share of one GPU's HBM
# is split row-wise instead of being placed whole on one rank.
TABLE_WISE_MAX_HBM_SHARE = 0.25


def _table_bytes(facts: dict, elt: int = 4) -> int:
    return int(facts["rows"]) * (int(facts["dim"]) * elt + 4)  # + one Adagrad scalar per row


@dataclass(frozen=True)
class PlaceDefault:
    """Annotates ``gemc.placement``: {"strategy": "ddp"} on dense compute nodes and
    {"sharding": ..., "ranks": [...]} on embedding nodes."""

    name: ClassVar[str] = "place-default"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "collect-tables", "assign-regions")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        world = int(ctx.topology.world_size) if ctx.topology is not None else 1
        hbm = float(ctx.topology.gpu.hbm_bytes) if ctx.topology is not None else float("inf")
        tables: dict[str, dict] = {}
        for node in gm.graph.nodes:
            facts = node.meta.get(ir.TABLE)
            if facts is not None:
                tables.setdefault(facts["fqn"], facts)
        order = sorted(tables.values(), key=lambda f: (-_table_bytes(f), f["fqn"]))
        placement: dict[str, dict] = {}
        next_rank = 0
        for facts in order:
            if facts.get("replicated"):
                placement[facts["fqn"]] = {"sharding": "data_parallel", "ranks": list(range(world))}
            elif world > 1 and _table_bytes(facts) > TABLE_WISE_MAX_HBM_SHARE * hbm:
                placement[facts["fqn"]] = {"sharding": "row_wise", "ranks": list(range(world))}
            else:
                placement[facts["fqn"]] = {"sharding": "table_wise", "ranks": [next_rank % world]}
                next_rank += 1
        for node in gm.graph.nodes:
            facts = node.meta.get(ir.TABLE)
            if facts is not None:
                node.meta[ir.PLACEMENT] = placement[facts["fqn"]]
            elif node.op == "call_function" and ir.kind_of(node) is not OpKind.VIEW:
                node.meta[ir.PLACEMENT] = {"strategy": REPLICATED_DENSE}
        return PassResult(gm, True)

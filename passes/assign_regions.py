"""assign-regions: the owning module of every node, at the granularity that gets a strategy.

A region is the outermost submodule whose forward ran the node (``blocks.0``,
``interaction``, ``heads.ctr``...): the unit FSDP would wrap and the solver gives one
dense strategy. Parameters belong to the region whose path prefixes their FQN. Nodes run by
the root module's own forward get the root region "" (usually glue without weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.ir import outermost_path

ROOT = ""


def region_of_fqn(fqn: str, regions: set[str]) -> str:
    """The longest region that prefixes a parameter FQN (the root region if none does)."""
    parts = fqn.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in regions:
            return prefix
    return ROOT


@dataclass(frozen=True)
class AssignRegions:
    """Annotates ``gemc.region`` on every node (placeholders of weights included)."""

    name: ClassVar[str] = "assign-regions"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        regions: set[str] = set()
        for node in gm.graph.nodes:
            if node.op == "call_function":
                region = outermost_path(node)
                node.meta[ir.REGION] = region
                regions.add(region)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                continue
            fqn = node.meta.get(ir.PARAM)
            node.meta[ir.REGION] = region_of_fqn(fqn, regions) if fqn else ROOT
        return PassResult(gm, True)

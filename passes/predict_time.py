"""predict-time: the cost model's forward+backward milliseconds on every compute node.

Reads the kind, FLOPs, bytes and shape facts earlier passes wrote, prices each node on the
topology's GPU with the context's calibration (roofline when there is none) and writes
``gemc.predicted_ms``. Views and placeholders get 0. The solver sums these per region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gemc.cost_model.op_cost import node_cost
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

PREDICTED_SOURCE = ir.PREDICTED_SOURCE  # re-exported: the key is owned by gemc.ir
PRICING = ir.PRICING  # re-exported: the key is owned by gemc.ir


@dataclass(frozen=True)
class PredictTime:
    """Annotates ``gemc.predicted_ms`` (forward + backward) on every node."""

    name: ClassVar[str] = "predict-time"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "collect-tables", "count-flops-bytes")
    eager: bool = False  # price embeddings as eager PyTorch runs them (dense gradients)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        topology = ctx.topology
        if topology is None:
            raise ValueError("predict-time needs ctx.topology (a gemc.cost_model Topology)")
        gpu = topology.gpu
        calibration = ctx.calibration
        sources: set[str] = set()
        # what the plan builder needs to reprice a node at the dtype the runner runs it in
        # (gemc.graph_summary.kernel_adjusted_ms): the same GPU and calibration as here
        # and the world size (one rank: module mode compiles, cost_model.inductor_fusion)
        gm.meta[PRICING] = {"gpu": gpu, "calibration": calibration,
                            "world_size": int(getattr(topology, "world_size", 1))}
        for node in gm.graph.nodes:
            precision = node.meta.get(ir.PRECISION)
            precision = precision if isinstance(precision, str) else None
            cost = node_cost(node, gpu, calibration, dtype=precision, eager=self.eager)
            node.meta[ir.PREDICTED_MS] = cost.total_ms
            node.meta[ir.PREDICTED_SOURCE] = cost.source
            sources.add(cost.source)
        if calibration is None and "roofline" in sources and hasattr(ctx, "warn"):
            ctx.warn(f"predict-time: no calibration for {gpu.name}; op times are roofline "
                     "estimates at typical efficiencies (run gemc calibrate on the GPU)")
        return PassResult(gm, True)

"""group-embeddings: many ``embedding_bag`` lookups -> one batched lookup with a fused optimizer.

Why: a GEM model looks up ~100 tables per step, each an ``nn.EmbeddingBag`` with its own
launches, a dense gradient the size of its table and an optimizer pass over all of it.
``gemc.backends.triton.embedding_bag.BatchedEmbeddingBag`` does every table in one launch
and applies the optimizer (row-wise Adagrad or lazy Adam) to the touched rows inside the
backward, so no dense table gradient ever exists.

Grouped: ``aten.embedding_bag`` nodes of tables (``gemc.table`` facts from collect-tables)
whose weight is used by that lookup only, with ``sum`` or ``mean`` pooling, 1-D ids and
offsets, no per-sample weights, no padding index, no ``scale_grad_by_freq``, and only
the pooled output (getitem 0) used. Lookups of equal batch size form one group (mean bags
run as sum bags weighted by ``1/len``, so one launch serves both poolings). The optimizer
is a pass option, recorded in the plan, because it runs inside the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.batched_lookup import lookup_facts
from gemc.context import PassContext

OPTIMIZERS = ("rowwise_adagrad", "adam")


def _price(nodes: list[fx.Node], facts: list[dict[str, Any]], ctx: PassContext,
           optimizer: str) -> dict[str, float] | None:
    topology = ctx.topology
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gpu, calib = topology.gpu, ctx.calibration
    before = sum(float(n.meta.get(ir.PREDICTED_MS) or 0.0) for n in nodes)
    after = 0.0
    for n, f in zip(nodes, facts):
        t = n.meta[ir.TABLE]
        fwd, bwd, _ = op_cost.embedding_time(f["rows"], f["dim"], int(t["nnz"]), f["batch"],
                                             "fp32", gpu, calib, optimizer=optimizer)
        after += fwd + bwd
    launch = calib.kernel_s if calib is not None else op_cost.DEFAULT_KERNEL_LAUNCH_S
    after -= (len(nodes) - 1) * 4 * launch  # one forward and ~3 backward launches in all
    return {"before_ms": round(before, 6), "after_ms": round(1e3 * max(after, 0.0), 6)}


@dataclass(frozen=True)
class GroupEmbeddings:
    """Annotates grouped lookups (and their getitems) with ``gemc.group``; the group's last
    node gets ``gemc.kernel`` (kind, tables, batch, optimizer and its settings)."""

    name: ClassVar[str] = "group-embeddings"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "collect-tables")
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1.0e-8
    weight_decay: float = 0.0

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"group-embeddings: optimizer must be one of {OPTIMIZERS}")
        by_batch: dict[int, list[tuple[fx.Node, dict[str, Any]]]] = {}
        for node in gm.graph.nodes:
            if ir.GROUP in node.meta:
                continue
            facts = lookup_facts(node)
            if facts is not None:
                by_batch.setdefault(facts["batch"], []).append((node, facts))
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for count, batch in enumerate(sorted(by_batch)):
            found = by_batch[batch]
            gid = f"batched_embedding_bag_{count}"
            members = sorted({m for node, _ in found for m in (node, *node.users)},
                             key=order.__getitem__)
            for m in members:
                m.meta[ir.GROUP] = gid
            price = _price([n for n, _ in found], [f for _, f in found], ctx, self.optimizer)
            members[-1].meta[ir.KERNEL] = {
                "id": gid, "kind": "batched_embedding_bag", "tables": len(found),
                "batch": batch, "optimizer": self.optimizer, "lr": self.lr, "eps": self.eps,
                "weight_decay": self.weight_decay, **(price or {})}
        return PassResult(gm, bool(by_batch))

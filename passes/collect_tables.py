"""collect-tables: the embedding tables, as the sharding solver and the kernels see them.

An embedding node reads a weight placeholder; we record that table's FQN, rows, dim, the
lookups per batch (nnz), the bags per batch (batch) and the pooling, on the node. A table
read by two nodes (shared embeddings) keeps one FQN, so it is sharded once.

The runner shards a table by swapping the module that owns it (``emb`` for
``emb.weight``), so only lookups made by that module's own call see the whole table:

* a weight no owning module looks up (``F.embedding(ids, self.table)`` on an
  ``nn.Parameter``), or one tied to another name (``out.weight = emb.weight``: the swap
  would leave the other name on the old tensor), is no table: it stays a dense parameter,
  priced as a gather (a warning says so, and how to have it sharded);
* a table the model also reads otherwise (DeepCTR's L2 penalty
  ``sum(w ** 2 for w in self.embedding_dict.parameters())``, a lookup from another
  module) would see only its rank's shard there, silently;
* a ``mode="max"`` bag: the runner pools a max only over a whole local table (a row
  shard's partial maxima do not add up);

the last two are marked ``replicated`` (the reasons, with the lines that read it) and only
a replicated placement is offered for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gemc.passes.classify_ops import op_name
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.data_dependent import source_line
from gemc.ir import OpKind

_POOLING = {0: "sum", 1: "mean", 2: "max"}


def _arg(node: fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def table_facts(node: fx.Node) -> dict[str, object] | None:
    weight, indices = node.args[0], node.args[1]
    if not isinstance(weight, fx.Node) or not isinstance(indices, fx.Node):
        return None
    w_shape = ir.shape_of(weight)
    i_shape = ir.shape_of(indices)
    if w_shape is None or i_shape is None or len(w_shape) != 2:
        return None
    nnz = 1
    for s in i_shape:
        nnz *= s
    fqn = weight.meta.get(ir.PARAM, weight.name)
    facts: dict[str, object] = {"fqn": fqn, "rows": w_shape[0], "dim": w_shape[1], "nnz": nnz}
    if "embedding_bag" in op_name(node):
        offsets = node.args[2]
        n_offsets = ir.shape_of(offsets)[0] if isinstance(offsets, fx.Node) else 0
        include_last = bool(_arg(node, 7, "include_last_offset", False))
        facts["batch"] = n_offsets - 1 if include_last else n_offsets
        facts["mode"] = _POOLING.get(int(_arg(node, 4, "mode", 0)), "sum")
        facts["weighted"] = _arg(node, 6, "per_sample_weights", None) is not None
    else:  # plain embedding: one row per index, no pooling (e.g. a sequence's item ids)
        facts["batch"] = nnz
        facts["mode"] = "none"
        facts["weighted"] = False
    return facts


def _owner_call(node: fx.Node, fqn: str) -> bool:
    """``node`` is a lookup made by the call of the module owning ``fqn`` (its ``.weight``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack or not fqn.endswith(".weight"):
        return False
    path = list(stack.values())[-1][0]
    return path == fqn[: -len(".weight")]


def _other_reads(weight: fx.Node, fqn: str) -> list[str]:
    """Where the model reads ``weight`` other than by its owning module's lookups."""
    return sorted({source_line(u) or u.name for u in weight.users
                   if not (ir.kind_of(u) is OpKind.EMBEDDING and _owner_call(u, fqn))})


@dataclass(frozen=True)
class CollectTables:
    """Annotates ``gemc.table`` on every embedding node."""

    name: ClassVar[str] = "collect-tables"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        changed = False
        for node in gm.graph.nodes:
            if ir.kind_of(node) is OpKind.EMBEDDING:
                facts = table_facts(node)
                if facts is None:
                    ctx.warn(
                        f"collect-tables: embedding node {node.name} has no weight placeholder; "
                        "it is priced as a dense gather and its table is not sharded"
                    )
                    continue
                fqn = str(facts["fqn"])
                tied = ctx.param_aliases.get(fqn, ())
                if tied or not _owner_call(node, fqn):
                    why = (f"is tied to {', '.join(tied)} (sharding it would leave that name "
                           "on the unsharded tensor)" if tied else
                           f"is looked up by {node.name} ({source_line(node) or 'forward'}) "
                           "outside a call of the nn.Embedding/nn.EmbeddingBag owning it")
                    ctx.warn(
                        f"collect-tables: '{fqn}' {why}: it stays a dense parameter "
                        "(replicated, not sharded); to shard it, hold it in one "
                        "nn.Embedding, untied, and call that module"
                    )
                    continue
                others = _other_reads(node.args[0], fqn)
                if others:
                    facts["replicated"] = [f"read at {line}" for line in others]
                    ctx.warn(
                        f"collect-tables: table '{fqn}' is also read outside its lookups "
                        f"({', '.join(others)}): a shard would see only its rows there, so "
                        "it is only placed data_parallel (a full replica on every rank); to "
                        "shard it, read it only through its module's lookups (e.g. penalise "
                        "the looked-up rows)"
                    )
                if facts["mode"] == "max":
                    facts.setdefault("replicated", []).append("mode='max'")
                    ctx.warn(
                        f"collect-tables: table '{fqn}' max-pools (mode='max'): the runner "
                        "pools a max only over a whole table, so it is only placed "
                        "data_parallel (a full replica on every rank), with a dense gradient"
                    )
                node.meta[ir.TABLE] = facts
                changed = True
        return PassResult(gm, changed)

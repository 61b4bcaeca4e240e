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
* a frozen table (``requires_grad=False``: pretrained content vectors) stays the model's
  dense module too: the sharded tables' optimizers would train it;
* a table whose lookup changes its training beyond gather-and-pool stays a dense parameter
  too (the module is left as written, its gradient all-reduced like any dense weight):
  ``scale_grad_by_freq`` divides each row's gradient by its count in *that rank's* batch,
  which a shard owner pooling every rank's ids together cannot count, but DDP over the
  dense module reproduces exactly; ``max_norm`` renormalises the looked-up rows in place
  during forward (``embedding_renorm_``), which one rank's dense copy does exactly, while
  on several ranks each replica would renormalise only its own batch's rows and the
  replicas would drift apart (as under eager DDP): that is a named error at compile;
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

import torch
from gemc.passes.classify_ops import op_name
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.data_dependent import source_line
from gemc.errors import UnsupportedOpError
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


_ALIASES = ("detach", "alias", "view", "_unsafe_view", "contiguous")


def renormed_weights(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Weight placeholder -> the ``embedding_renorm_`` that rewrites its rows in place
    (``nn.Embedding(max_norm=...)``: torch renorms a detached alias of the weight)."""
    out: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) != "embedding_renorm_":
            continue
        source = node.args[0]
        while isinstance(source, fx.Node) and source.op == "call_function" \
                and op_name(source) in _ALIASES:
            source = source.args[0]
        if isinstance(source, fx.Node) and source.op == "placeholder":
            out.setdefault(source, node)
    return out


def _dense_only(node: fx.Node, renorm: fx.Node | None) -> str | None:
    """Why the lookup ``node`` must stay the model's own dense module, or None."""
    weight = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if isinstance(weight, torch.Tensor) and not weight.requires_grad:
        return ("is frozen (requires_grad=False, e.g. nn.Embedding.from_pretrained(..., "
                "freeze=True)), where a sharded table and its fused optimizer update every "
                "row a step looks up")
    # aten.embedding and aten.embedding_bag alike take it fourth
    if _arg(node, 3, "scale_grad_by_freq", False):
        return ("uses scale_grad_by_freq (each row's gradient divided by its count in one "
                "rank's batch, which a shard pooling every rank's ids cannot count)")
    if renorm is not None:
        return (f"uses max_norm={renorm.args[2]} (its forward renormalises the looked-up "
                "rows in place, which the sharded lookups do not)")
    return None


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


def _refuse_renorm_on_ranks(renorm: fx.Node, fqn: str, ctx: PassContext) -> None:
    """``max_norm`` trains exactly on one rank only: named, with what would do instead."""
    world = ctx.topology.world_size if ctx.topology is not None else 1
    if world <= 1:
        return
    raise UnsupportedOpError(
        f"table '{fqn}' is an nn.Embedding with max_norm={renorm.args[2]}: its forward "
        f"renormalises the looked-up rows of the weight in place, and on {world} ranks "
        "each replica would renormalise only its own batch's rows, so the replicas (and "
        "the loss) would drift from training on the whole batch",
        where=f"{source_line(renorm) or renorm.name} (embedding_renorm_ of {fqn})",
        fix="compile for one GPU, or drop max_norm and bound the rows in the model "
            "differentiably (e.g. F.normalize the looked-up rows, or add a norm penalty "
            "on them to the loss)")


@dataclass(frozen=True)
class CollectTables:
    """Annotates ``gemc.table`` on every embedding node."""

    name: ClassVar[str] = "collect-tables"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        changed = False
        renormed = renormed_weights(gm)
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
                renorm = renormed.get(node.args[0])
                dense_only = _dense_only(node, renorm)
                if dense_only is not None:
                    if renorm is not None:
                        _refuse_renorm_on_ranks(renorm, fqn, ctx)
                    ctx.warn(
                        f"collect-tables: '{fqn}' {dense_only}: it stays the model's dense "
                        "nn.Embedding (replicated on every rank, not sharded; its gradient, "
                        "if any, goes to the dense optimizer); to shard it, change what "
                        "this names")
                    continue
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

"""count-flops-bytes: forward FLOPs and bytes moved of every node.

These two numbers are what the roofline cost model prices and what MFU is measured
against, so they follow the usual conventions: a multiply-add is 2 FLOPs; attention counts
both of its GEMMs (4·B·H·L·S·E, halved when causal); bytes are the tensors a kernel must
read and write if it runs alone (fusion later removes the intermediate traffic). Views move
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext
from gemc.ir import OpKind

# FLOPs per output element of ops that are not GEMMs (rough, by kind).
_FLOPS_PER_ELEMENT = {
    OpKind.POINTWISE: 1,
    OpKind.NORM: 5,
    OpKind.LOSS: 6,
}


def _input_nodes(node: fx.Node) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    for arg in node.all_input_nodes:
        seen.setdefault(arg, None)
    return list(seen)


def node_flops(node: fx.Node, kind: OpKind) -> int:
    out = ir.tensor_vals(node)
    out_numel = int(out[0].numel()) if out else 0
    if kind is OpKind.GEMM:
        p = node.meta.get(ir.GEMM)
        return 2 * p["batch"] * p["m"] * p["n"] * p["k"] if p else 0
    if kind is OpKind.ATTENTION:
        p = node.meta.get(ir.ATTENTION)
        if not p:
            return 0
        flops = 4 * p["batch"] * p["heads"] * p["q_len"] * p["kv_len"] * p["head_dim"]
        return flops // 2 if p["causal"] else flops
    if kind is OpKind.EMBEDDING:
        table = node.meta.get(ir.TABLE)
        if table:
            return table["nnz"] * table["dim"]  # one add per gathered element (pooling)
        return out_numel
    if kind is OpKind.REDUCTION:
        return sum(int(v.numel()) for a in _input_nodes(node) for v in ir.tensor_vals(a))
    return _FLOPS_PER_ELEMENT.get(kind, 0) * out_numel


def node_bytes(node: fx.Node, kind: OpKind) -> int:
    if kind in (OpKind.VIEW, OpKind.INPUT, OpKind.PARAM, OpKind.OUTPUT):
        return 0
    written = ir.nbytes(node)
    if kind is OpKind.EMBEDDING:
        table = node.meta.get(ir.TABLE)
        if table:
            weight_elt = (
                ir.tensor_vals(node.args[0])[0].element_size()
                if isinstance(node.args[0], fx.Node)
                else 4
            )
            gathered = table["nnz"] * table["dim"] * weight_elt
            indices = sum(ir.nbytes(a) for a in _input_nodes(node)[1:])
            return gathered + indices + ir.nbytes(ir.tensor_vals(node)[:1])
    read = sum(ir.nbytes(a) for a in _input_nodes(node))
    return read + written


@dataclass(frozen=True)
class CountFlopsBytes:
    """Annotates ``gemc.flops`` and ``gemc.bytes`` (forward) on every node."""

    name: ClassVar[str] = "count-flops-bytes"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops", "collect-tables")

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        for node in gm.graph.nodes:
            kind = ir.kind_of(node) or OpKind.OTHER
            node.meta[ir.FLOPS] = int(node_flops(node, kind))
            node.meta[ir.BYTES] = int(node_bytes(node, kind))
        return PassResult(gm, True)

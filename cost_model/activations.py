"""Which forward tensors autograd keeps for the backward, read off an annotated graph.

A rule per op kind of what its backward formula needs (PyTorch's derivatives.yaml): GEMMs
keep their inputs, attention keeps Q, K, V, the output and the log-sum-exp, norms keep the
input (and per-row statistics), ReLU/exp/sigmoid/tanh keep their output, other nonlinear
pointwise ops and products keep their inputs, losses keep input and target, indexing keeps
its indices; additions, views, concatenations and reductions by sum keep nothing. Views
are resolved to the tensor they alias, so a tensor is counted once; parameters are never
activations.
"""

from __future__ import annotations

from collections import defaultdict

from torch import fx

from gemc import ir
from gemc.ir import OpKind

_KEEP_OUTPUT = ("relu", "exp", "sigmoid", "tanh", "softmax", "threshold", "hardtanh")
_KEEP_NOTHING = ("add", "sub", "neg", "cat", "stack", "sum", "mean", "clone", "copy",
                 "to_copy", "_to_copy", "contiguous", "fill", "zeros", "ones", "full",
                 "arange", "empty", "detach", "alias", "lift_fresh")


def _op(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[0].lower()


def _base(node: fx.Node) -> fx.Node:
    """The tensor a view aliases (follows view chains)."""
    seen = 0
    while ir.kind_of(node) is OpKind.VIEW and node.all_input_nodes and seen < 64:
        node = node.all_input_nodes[0]
        seen += 1
    return node


def _saved_inputs(node: fx.Node, kind: OpKind) -> list[fx.Node]:
    op = _op(node)
    inputs = list(node.all_input_nodes)
    if kind in (OpKind.GEMM, OpKind.NORM, OpKind.LOSS, OpKind.EMBEDDING, OpKind.INDEX):
        return inputs
    if kind is OpKind.ATTENTION:
        return inputs[:3] + [node]
    if kind is OpKind.POINTWISE or kind is OpKind.OTHER:
        if any(op.startswith(k) for k in _KEEP_NOTHING):
            return []
        if any(k in op for k in _KEEP_OUTPUT):
            return [node]
        return inputs
    if kind is OpKind.REDUCTION:
        return [] if any(op.startswith(k) for k in ("sum", "mean")) else inputs
    return []


def saved_activation_bytes(gm: fx.GraphModule) -> dict[str, int]:
    """Bytes saved for backward per region (gemc.region, '' when unannotated), plus
    'inputs': the batch tensors themselves."""
    saved: dict[fx.Node, str] = {}
    inputs = 0
    for node in gm.graph.nodes:
        kind = ir.kind_of(node)
        if node.op == "placeholder":
            if kind is not OpKind.PARAM and not node.meta.get(ir.PARAM):
                inputs += ir.nbytes(node)
            continue
        if node.op != "call_function" or kind is None:
            continue
        dt = ir.dtype_of(node)
        if dt is not None and not dt.is_floating_point:
            continue  # no gradient flows through integer ops
        for t in _saved_inputs(node, kind):
            b = _base(t)
            if b.op == "placeholder" or ir.kind_of(b) is OpKind.PARAM:
                continue  # batch inputs are counted once above; params are not activations
            saved.setdefault(b, str(node.meta.get(ir.REGION, "")))
    out: dict[str, int] = defaultdict(int)
    for b, region in saved.items():
        out[region] += ir.nbytes(b)
    out["inputs"] = inputs
    return dict(out)

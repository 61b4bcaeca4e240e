"""The one place that owns the names gemc writes into ``node.meta``.

Passes read and write annotations only through these keys and helpers, so a name is
spelled once and a dump, the plan and every pass agree on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch
from torch import fx

PREFIX = "gemc."
KIND = PREFIX + "kind"  # OpKind value
FLOPS = PREFIX + "flops"  # forward FLOPs of the node (int)
BYTES = PREFIX + "bytes"  # bytes read + written by the node in the forward (int)
REGION = PREFIX + "region"  # owning module path ("" for the root module)
GROUP = PREFIX + "group"  # fusion group id
PRECISION = PREFIX + "precision"  # chosen compute precision
PLACEMENT = PREFIX + "placement"  # parallel placement of the node's region or table
PREDICTED_MS = PREFIX + "predicted_ms"  # cost model's forward+backward time
PREDICTED_SOURCE = PREFIX + "predicted_source"  # "calibrated" | "fitted" | "roofline" | "free"
PROVENANCE = PREFIX + "provenance"  # "<pass name>: <source module>" of created nodes
TABLE = PREFIX + "table"  # embedding table facts (dict) on embedding nodes
GEMM = PREFIX + "gemm"  # {"batch", "m", "n", "k"} on gemm nodes (forward GEMM)
ATTENTION = PREFIX + "attention"  # {"batch", "heads", "q_len", "kv_len", "head_dim",
#                                    "causal", "masked"} on attention nodes
PARAM = PREFIX + "param"  # parameter / buffer FQN on placeholders that are weights
# a lifted tensor constant's name (a plain tensor attribute, a tensor made in the forward)
# on its placeholder: a value fixed for the run, as a buffer's is
CONSTANT = PREFIX + "constant"
KERNEL = PREFIX + "kernel"  # facts of a kernel group (dict: id, kind, predicted before/after,
#                             kind-specific facts), on the group's last node
PACKED = PREFIX + "packed"  # {"id", "dims": [batch dim, sequence dim], "zeroed"} per node
PACKED_REGION = PREFIX + "packed_region"  # a packed token region's facts, on its source node
PACKED_SKIPPED = PREFIX + "packed_skipped"  # why an attention's history stays padded
# the captured size of a node whose length depends on the batch's values (``u0``), on a node
# whose ``val`` gemc.data_dependent gave the upper-bound shape: no kernel may bake it in
BOUNDED = PREFIX + "bounded"
# gm.meta: the GPU, calibration and world size predict-time priced with
PRICING = PREFIX + "pricing"
# gm.meta: the plan document emit-plan (the pipeline's last pass) built from the graph
PLAN = PREFIX + "plan"
# gm.meta: the table optimizer the placement priced (parallelize); on several ranks it
# decides which tables' owners look them up fused (gemc.table_lookup.sharded_route)
TABLE_OPTIMIZER = PREFIX + "table_optimizer"


class OpKind(str, Enum):
    """What a node does, at the granularity the cost model and the solver care about."""

    INPUT = "input"
    PARAM = "param"
    OUTPUT = "output"
    GEMM = "gemm"
    ATTENTION = "attention"
    EMBEDDING = "embedding"
    NORM = "norm"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    VIEW = "view"
    INDEX = "index"  # gathers, scatters, index_put: memory bound, data dependent
    LOSS = "loss"
    COMM = "comm"
    OTHER = "other"


def packed_regions(gm: fx.GraphModule) -> dict[Any, dict[str, Any]]:
    """Each packed token region's facts (:data:`PACKED_REGION`, on its source nodes) once,
    by the region's id."""
    return {f["id"]: f for n in gm.graph.nodes
            if isinstance(f := n.meta.get(PACKED_REGION), dict) and "id" in f}


def tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    """The tensors a node produces (its FakeTensor ``val``, flattened)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    vals = tensor_vals(node)
    return tuple(int(s) for s in vals[0].shape) if vals else None


def stride_of(node: fx.Node) -> tuple[int, ...] | None:
    """The strides of the node's (first) tensor as the capture saw them: eager's layout."""
    vals = tensor_vals(node)
    try:
        return tuple(int(s) for s in vals[0].stride()) if vals else None
    except (TypeError, RuntimeError):  # a symbolic stride, or a layout without strides
        return None


def dtype_of(node: fx.Node) -> torch.dtype | None:
    vals = tensor_vals(node)
    return vals[0].dtype if vals else None


def nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return int(t.numel()) * t.element_size()
    if isinstance(t, fx.Node):
        return sum(nbytes(v) for v in tensor_vals(t))
    if isinstance(t, (list, tuple)):
        return sum(nbytes(v) for v in t)
    return 0


def _module_fqn(path: str) -> str:
    # strict export writes L['self'].blocks[0]; non-strict writes blocks.0. Keep the latter.
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path


def module_path(node: fx.Node) -> str:
    """The innermost module a captured node ran in, as an fqn ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [p for p, _ in stack.values() if p]
    return _module_fqn(paths[-1]) if paths else ""


def innermost_scope(path: str, scopes: Iterable[str]) -> str | None:
    """The innermost of ``scopes`` (module fqns) whose module contains ``path``, or None:
    the precision scope a node of that module runs in (scopes nest: the inner one wins),
    read by the runner that applies the scopes and the pass that plans around them."""
    best = None
    for scope in scopes:
        if (path == scope or path.startswith(scope + ".")) and (
                best is None or len(scope) > len(best)):
            best = scope
    return best


def outermost_path(node: fx.Node) -> str:
    """The outermost module (below the root) a captured node ran in ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [p for p, _ in stack.values() if p]
    return _module_fqn(paths[0]) if paths else ""


def ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """``nodes`` and every node they depend on (through any argument)."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """An ``aten.scaled_dot_product_attention`` node's arguments by name, positional or
    keyword (absent ones None)."""
    args = list(node.args) + [None] * (len(SDPA_ARGS) - len(node.args))
    return {n: node.kwargs.get(n, args[i]) for i, n in enumerate(SDPA_ARGS)}


def kind_of(node: fx.Node) -> OpKind | None:
    value = node.meta.get(KIND)
    return OpKind(value) if value is not None else None


def gemc_meta(node: fx.Node) -> dict[str, Any]:
    """All gemc annotations of a node, keys without the prefix, in a stable order."""
    return {k[len(PREFIX) :]: node.meta[k] for k in sorted(node.meta) if k.startswith(PREFIX)}

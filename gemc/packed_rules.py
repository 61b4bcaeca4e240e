"""Which nodes of a packed token region run on the packed tokens, and which run padded.

Both runners (the Inductor graph's emitter, ``backends/triton/inductor_graph.py``, and the
interpreter, ``backends/triton/graph_runner.py``) compute a region node on the region's
packed tokens only when the op has a packed rule: it is pointwise (or a ``cat``), or it
acts per token on a packed first argument (:data:`FIRST_ONLY`, :data:`SIZED`). Any other
op (an SDPA no gemc kernel took, a table lookup answered by its module) runs on the padded
tensor, its inputs scattered out and its output gathered back: exact, but at the padded
size. The cost model reads the same rule (:func:`on_tokens`), so a region is priced,
in time and in memory, at the size each of its nodes runs at. Why: MMoE's causal
self-attention inside its region ran padded while the plan priced it packed, one part of
the plan's 2.2 GB under MMoE's H200 peak (BENCHMARKS.md, eleventh session).
"""

from __future__ import annotations

import operator
from collections.abc import Container, Mapping
from typing import Any

import torch
from torch import fx

from gemc.fusion_spec import elementwise
from gemc.ir import GROUP

aten = torch.ops.aten

SIZED = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                   aten.expand.default})
"""Ops whose size argument names the batch and sequence sizes: rewritten to (1, T)."""
FIRST_ONLY = frozenset({
    aten.linear.default, aten.layer_norm.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.flatten.using_ints, aten.unflatten.int,
    aten.unbind.int, aten.split.Tensor, aten.chunk.default, aten.clone.default,
    aten.contiguous.default, aten.select.int, aten.dropout.default,
    aten._to_copy.default, aten.to.dtype, aten.alias.default, aten.detach.default,
    aten.sum.dim_IntList, aten.mean.dim, operator.getitem,
})
"""Ops that act per token when their first argument is packed (the rest are weights,
dims or dtypes)."""


def is_pointwise(node: fx.Node) -> bool:
    """An elementwise op (or ``cat``): runs on packed tokens whatever its inputs are."""
    return elementwise(node) or node.target is aten.cat.default


def runs_packed(node: fx.Node, packed: Container[fx.Node]) -> bool:
    """Whether the runners compute region node ``node`` on the packed tokens (``packed``:
    the region's nodes). False: it runs on the padded tensor and is gathered back."""
    if is_pointwise(node):
        return True
    first = node.args[0] if node.args else None
    return (node.target in FIRST_ONLY or node.target in SIZED) \
        and isinstance(first, fx.Node) and first in packed


def source_names(region: Mapping[str, Any]) -> set[str]:
    """The nodes a region's facts (``gemc.packed_region``) name as its sources: the padded
    tensors the runners build the tokens from (HSTU's q, k and v: three), which run on the
    tokens whatever their op."""
    return {str(f["padded_from"]) for f in region.get("sources") or [region]
            if "padded_from" in f}


def on_tokens(node: fx.Node, members: Container[fx.Node], sources: Container[str]) -> bool:
    """Whether region node ``node`` runs on the region's tokens in the runners: a member of
    a gemc kernel (it runs on the tokens in place), a source named in ``sources``
    (:func:`source_names`), or an op with a packed rule (:func:`runs_packed`)."""
    return node.meta.get(GROUP) is not None or node.name in sources \
        or runs_packed(node, members)

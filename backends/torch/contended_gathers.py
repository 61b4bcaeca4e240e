"""Graph mode: gathers from small parameter tables by many indices go through
``gemc::gather_rows``, whose backward adds up per block instead of per index.

Why (backends/triton/small_table_gather.py has the kernel): the captured graph's
``index_select`` / ``embedding`` / ``weight[index]`` on a table of a few hundred rows with
one index per token pair backpropagates as one atomic add per index, which serialises when
the indices pile onto a few rows; on the H200 that one scatter was 89% of the HSTU zoo
model's step. Which gathers qualify is read from the graph, not from names: a parameter
placeholder with at most :data:`MAX_ROWS` rows of at most :data:`MAX_ROW_ELEMS` elements,
indexed on its first dimension by at least :data:`MIN_IDS_PER_ROW` ids per row. The
embedding tables (the plan's sparse tables) are never taken: they have their own paths.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import fx

from gemc import ir

__all__ = ["MAX_ROWS", "MAX_ROW_ELEMS", "MIN_IDS_PER_ROW", "route_contended_gathers"]

MAX_ROWS = 4096
MAX_ROW_ELEMS = 16
MIN_IDS_PER_ROW = 64  # below this, one atomic per id meets little contention

aten = torch.ops.aten


def _weight_and_index(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The (weight, index) of a plain row gather, else None."""
    args, kwargs = node.args, node.kwargs
    if node.target is aten.index_select.default:
        if len(args) == 3 and args[1] == 0 and not kwargs:
            return args[0], args[2]  # type: ignore[return-value]
    elif node.target is aten.embedding.default:
        extra = list(args[2:]) + list(kwargs.values())
        # padding_idx, scale_grad_by_freq, sparse: only the defaults are a plain gather
        if len(args) >= 2 and all(a in (-1, False) for a in extra):
            return args[0], args[1]  # type: ignore[return-value]
    elif node.target is aten.index.Tensor:
        if len(args) == 2 and isinstance(args[1], (list, tuple)) and len(args[1]) == 1 \
                and isinstance(args[1][0], fx.Node):
            return args[0], args[1][0]  # type: ignore[return-value]
    return None


def _qualifies(weight: fx.Node, index: fx.Node, tables: Collection[str]) -> bool:
    if weight.op != "placeholder" or weight.meta.get(ir.PARAM) in (None, *tables):
        return False
    w, ix = weight.meta.get("val"), index.meta.get("val")
    if not isinstance(w, torch.Tensor) or not isinstance(ix, torch.Tensor):
        return False
    if not w.is_floating_point() or w.dim() < 1 or ix.dtype not in (torch.int32, torch.int64):
        return False
    rows = int(w.shape[0])
    row_elems = int(w.numel()) // max(rows, 1)
    return 0 < rows <= MAX_ROWS and row_elems <= MAX_ROW_ELEMS \
        and int(ix.numel()) >= MIN_IDS_PER_ROW * rows


def route_contended_gathers(gm: fx.GraphModule, tables: Collection[str],
                            in_kernels: Collection[str] = ()) -> list[dict[str, Any]]:
    """Retarget every qualifying gather of ``gm`` to ``gemc::gather_rows`` (in place; the
    placeholders must carry ``ir.PARAM``), except nodes a kernel replaces (``in_kernels``).
    Returns one record per gather taken."""
    from gemc.backends.triton import small_table_gather  # noqa: F401  (registers the op)

    taken = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.name in in_kernels:
            continue
        found = _weight_and_index(node)
        if found is None or not _qualifies(*found, tables):
            continue
        weight, index = found
        node.target = torch.ops.gemc.gather_rows.default
        node.args, node.kwargs = (weight, index), {}
        taken.append({"node": node.name, "param": weight.meta[ir.PARAM],
                      "rows": int(weight.meta["val"].shape[0]),
                      "ids": int(index.meta["val"].numel())})
    if taken:
        gm.recompile()
    return taken

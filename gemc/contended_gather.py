"""Which gathers the runner sends through ``gemc::gather_rows`` (one rule for the runner and
the cost model).

Why shared: the runner (backends/torch/contended_gathers.py) retargets these gathers to a
kernel whose backward sums per block of ids instead of one atomic per id, and the cost model
prices that backward at the kernel's measured rate (cost_model/op_cost.py); a rule copied
into each would drift. A qualifying gather reads a small parameter table (at most
:data:`MAX_ROWS` rows of at most :data:`MAX_ROW_ELEMS` elements) on its first dimension by
at least :data:`MIN_IDS_PER_ROW` ids per row: HSTU's relative attention bias. Read from the
graph, never from names.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import fx

from gemc import ir

__all__ = ["MAX_ROWS", "MAX_ROW_ELEMS", "MIN_IDS_PER_ROW", "contended_gather",
           "qualifies", "weight_and_index"]

MAX_ROWS = 4096
MAX_ROW_ELEMS = 16
MIN_IDS_PER_ROW = 64  # below this, one atomic per id meets little contention

aten = torch.ops.aten


def weight_and_index(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
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


def qualifies(weight: fx.Node, index: fx.Node, tables: Collection[str]) -> bool:
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


def contended_gather(node: fx.Node, tables: Collection[str] = ()) -> tuple[fx.Node, fx.Node] | None:
    """(weight, index) of ``node`` when the runner sends it through ``gemc::gather_rows``,
    else None."""
    found = weight_and_index(node) if node.op == "call_function" else None
    return found if found is not None and qualifies(*found, tables) else None



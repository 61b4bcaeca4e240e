"""Which ``embedding_bag`` lookups one batched embedding kernel can take over, and their facts.

Why in the core: the group-embeddings pass groups the lookups these facts accept, and the
batched lookup's plan entry (``gemc.backends.triton.kinds.embeddings``) lists the same
facts per table for the runner; both read this one rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from gemc import ir

aten = torch.ops.aten
_POOLING = {0: "sum", 1: "mean"}


def lookup_facts(node: fx.Node) -> dict[str, Any] | None:
    """The table lookup a batched kernel can take over, or None."""
    if node.target not in (aten.embedding_bag.padding_idx, aten.embedding_bag.default):
        return None
    table = node.meta.get(ir.TABLE)
    args = list(node.args) + [None] * (9 - len(node.args))
    names = ("weight", "indices", "offsets", "scale_grad_by_freq", "mode", "sparse",
             "per_sample_weights", "include_last_offset", "padding_idx")
    a = {name: node.kwargs.get(name, args[i]) for i, name in enumerate(names)}
    weight, ids, offsets = a["weight"], a["indices"], a["offsets"]
    if table is None or not isinstance(weight, fx.Node) or weight.op != "placeholder":
        return None
    if len(weight.users) != 1 or ir.dtype_of(weight) != torch.float32:
        return None
    if a["scale_grad_by_freq"] or a["per_sample_weights"] is not None:
        return None
    if a["padding_idx"] is not None and a["padding_idx"] >= 0:
        return None
    mode = _POOLING.get(a["mode"] if a["mode"] is not None else 1)
    if mode is None or not all(isinstance(x, fx.Node) and len(ir.shape_of(x) or ()) == 1
                               for x in (ids, offsets)):
        return None
    used = [u for u in node.users if u.args[1] != 0 and len(u.users) > 0]
    pooled = [u for u in node.users if u.args[1] == 0]
    if used or len(pooled) != 1:
        return None
    last = bool(a["include_last_offset"])
    rows, dim = ir.shape_of(weight)
    batch = ir.shape_of(offsets)[0] - (1 if last else 0)
    return {"fqn": table["fqn"], "rows": int(rows), "dim": int(dim), "pooling": mode,
            "node": node.name, "output": pooled[0].name, "weight": weight.name,
            "ids": ids.name, "offsets": offsets.name, "include_last_offset": last,
            "batch": int(batch)}

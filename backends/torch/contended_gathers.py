"""Graph mode: gathers from small parameter tables by many indices go through
``gemc::gather_rows``, whose backward adds up per block instead of per index.

Why (backends/triton/small_table_gather.py has the kernel): the captured graph's
``index_select`` / ``embedding`` / ``weight[index]`` on a table of a few hundred rows with
one index per token pair backpropagates as one atomic add per index, which serialises when
the indices pile onto a few rows; on the H200 that one scatter was 89% of the HSTU zoo
model's step. Which gathers qualify is read from the graph, not from names: a parameter
placeholder with at most :data:`MAX_ROWS` rows of at most :data:`MAX_ROW_ELEMS` elements,
indexed on its first dimension by at least :data:`MIN_IDS_PER_ROW` ids per row (the rule
lives in gemc/contended_gather.py, shared with the cost model, which prices these
backwards at the kernel's rate). The embedding tables (the plan's sparse tables) are
never taken: they have their own paths.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import fx

from gemc import ir
from gemc.contended_gather import MAX_ROW_ELEMS, MAX_ROWS, MIN_IDS_PER_ROW, contended_gather

__all__ = ["MAX_ROWS", "MAX_ROW_ELEMS", "MIN_IDS_PER_ROW", "route_contended_gathers"]


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
        found = contended_gather(node, tables)
        if found is None:
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

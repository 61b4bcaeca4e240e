"""Data-dependent sizes in a captured graph, priced at their upper bound.

``loss[label >= 0].mean()`` (a loss only where a label is present), ``nonzero`` and
``masked_select`` make tensors whose length depends on the batch's values: torch.export
keeps them as *unbacked* symbols (``u0``) with a range, e.g. ``[0, B]`` for a mask over
``B`` samples. gemc's passes price, group and place nodes by concrete sizes, and a
symbol without a value cannot become one (``GuardOnDataDependentSymNode``). The graph
itself stays as captured (the runner executes the model's own ops, so the numbers are
the model's); only the sizes the compiler reasons with become the symbol's upper bound,
the worst case every batch fits in: a conservative price for time and memory. The nodes
are named in the plan's warnings (where a mask keeps few samples, the prediction is high)
and marked ``gemc.bounded``: no generated kernel takes them (its sizes would be the bound's,
not the batch's), Inductor compiles them with the run's real sizes.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gemc import ir
from gemc.errors import CaptureError


def _upper(size: int | torch.SymInt, node: fx.Node, entrypoint: str) -> int:
    if not isinstance(size, torch.SymInt):
        return int(size)
    shape_env = size.node.shape_env
    bound = shape_env.bound_sympy(size.node.expr).upper
    if not bound.is_finite:
        raise CaptureError(
            f"the size {size} of node {node.name} ({node.target}) depends on the batch's "
            "values and has no upper bound gemc can price",
            where=source_line(node) or f"{entrypoint} -> model.forward",
            fix="keep the shape fixed: e.g. torch.where(mask, loss, 0).sum() / "
            "mask.sum().clamp(min=1) instead of loss[mask].mean()",
        )
    return int(bound)


def source_line(node: fx.Node) -> str | None:
    """``file:line`` of the model's code that made ``node`` (its innermost frame)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return None
    parts = lines[-1].split('"')
    line = lines[-1].split("line ")[-1].split(",")[0]
    return f"{parts[1]}:{line}" if len(parts) > 2 else lines[-1]


def bound_unbacked_sizes(gm: fx.GraphModule, entrypoint: str) -> list[str]:
    """Give every value with a data-dependent size its upper-bound shape (in place);
    returns one description per such node, for the plan's warnings."""
    sites: list[str] = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not free_unbacked_symbols(val):
            continue
        shape = [_upper(s, node, entrypoint) for s in val.shape]
        with val.fake_mode:
            node.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
        node.meta[ir.BOUNDED] = str(tuple(val.shape))
        where = source_line(node) or "model.forward"
        sites.append(f"{node.name} ({node.target}, {where}): size {tuple(val.shape)} "
                     f"priced at its upper bound {tuple(shape)}")
    return sites

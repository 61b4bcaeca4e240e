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
and marked ``gemc.bounded``: no fused kernel (passes/fuse) takes them, its sizes would be
the bound's, not the batch's; Inductor compiles them with the run's real sizes. A lookup
over such ids (``emb(ids[ids != 0])``) may still join the batched embedding kernel, which
reads its ids' count at run time.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gemc import ir
from gemc.errors import CaptureError, users_file


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
    """``file:line`` of the model's code that made ``node``: the innermost frame of its
    stack trace in the user's files (``nn.EmbeddingBag.forward`` is torch's, its caller's
    line is the model's)."""
    frames = []
    for text in (node.meta.get("stack_trace") or "").splitlines():
        parts = text.strip().split('"')
        if text.strip().startswith("File ") and len(parts) > 2:
            frames.append((parts[1], parts[2].split("line ")[-1].split(",")[0]))
    mine = [f for f in frames if users_file(f[0])] or frames
    return f"{mine[-1][0]}:{mine[-1][1]}" if mine else None


def bound_unbacked_sizes(gm: fx.GraphModule, entrypoint: str) -> list[str]:
    """Give every value with a data-dependent size its upper-bound shape (in place);
    returns one description per such node, for the plan's warnings."""
    sites: list[str] = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        many = isinstance(val, (list, tuple))
        vals = list(val) if many else [val]
        if not any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v) for v in vals):
            continue
        sizes = [str(tuple(v.shape)) for v in vals if isinstance(v, torch.Tensor)]
        vals = [_bounded(v, node, entrypoint) for v in vals]
        node.meta["val"] = type(val)(vals) if many else vals[0]
        node.meta[ir.BOUNDED] = ", ".join(sizes)
        bounds = ", ".join(str(tuple(v.shape)) for v in vals if isinstance(v, torch.Tensor))
        where = source_line(node) or "model.forward"
        sites.append(f"{node.name} ({node.target}, {where}): size {', '.join(sizes)} "
                     f"priced at its upper bound {bounds}")
    return sites


def _bounded(val: object, node: fx.Node, entrypoint: str) -> object:
    """``val`` with every data-dependent size at its upper bound (others as they are)."""
    if not isinstance(val, torch.Tensor) or not free_unbacked_symbols(val):
        return val
    shape = [_upper(s, node, entrypoint) for s in val.shape]
    with val.fake_mode:
        return torch.empty(shape, dtype=val.dtype, device=val.device)

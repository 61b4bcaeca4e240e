"""fold-transposed-linear: a Linear over the token axis without materialising the transpose.

Why: interaction layers mix *tokens*, not features: Wukong's linear compression and its
low-rank FM projection apply an ``nn.Linear`` to ``x.transpose(1, 2)`` (``[B, d, n]``, the
token count last). ATen's linear flattens its input to ``[B * d, n]``, which a transposed
view cannot give without a copy: on the H200 the GEM h200 preset pays 15 strided copies of
the Wukong activations per step for it (~0.29 ms each, forward and backward: eager and the
runner alike), plus strided adds where the transposed gradient meets the other uses of
``x``. The same product is ``W @ x`` per batch, i.e. ``bmm(W.expand(B, ...), x)`` on the
contiguous ``x``, read in place (a batch stride of 0 for ``W``); its transpose is the
linear's output, and the consumers here transpose it straight back.

Matched: ``aten.linear(t, W, b)`` with ``t = transpose(x, -1, -2)`` (any rank >= 3, the
last two dims swapped), ``W`` 2-D, not already in a group. Each becomes a one-node
``transposed_linear`` group; the runner (``backends/triton/graph_runner``) computes it as
above, casting ``W`` to the autocast dtype before the expand (as ``F.linear`` would cast it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from gemc import ir
from gemc.context import PassContext

aten = torch.ops.aten


def transposed_input(node: fx.Node) -> fx.Node | None:
    """``x`` of ``linear(transpose(x, -1, -2), W, b)``, or None."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    t, w = node.args[0], node.args[1]
    if not (isinstance(t, fx.Node) and t.target is aten.transpose.int):
        return None
    shape, wshape = ir.shape_of(t), ir.shape_of(w)
    if shape is None or wshape is None or len(shape) < 3 or len(wshape) != 2:
        return None
    rank = len(shape)
    if {int(d) % rank for d in t.args[1:3]} != {rank - 1, rank - 2}:
        return None
    return t.args[0] if isinstance(t.args[0], fx.Node) else None


def _price(node: fx.Node, ctx: PassContext) -> dict[str, float] | None:
    """Before: the linear plus the copy of its transposed input, forward and backward (the
    weight gradient reads it again); after: the linear alone."""
    topology = ctx.topology
    if topology is None:
        return None
    from gemc.cost_model import op_cost

    gemm = float(node.meta.get(ir.PREDICTED_MS) or 0.0)
    copy, _ = op_cost.memory_time(2 * ir.nbytes(node.args[0]), topology.gpu,
                                  ctx.calibration, "copy")
    return {"before_ms": round(gemm + 1e3 * 2 * copy, 6), "after_ms": round(gemm, 6)}


@dataclass(frozen=True)
class FoldTransposedLinear:
    """Marks each match as a one-node ``transposed_linear`` group (``gemc.group`` and
    ``gemc.kernel``)."""

    name: ClassVar[str] = "fold-transposed-linear"
    requires: ClassVar[tuple[str, ...]] = ("classify-ops",)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        count = 0
        for node in gm.graph.nodes:
            if ir.GROUP in node.meta or transposed_input(node) is None:
                continue
            gid = f"transposed_linear_{count}"
            count += 1
            node.meta[ir.GROUP] = gid
            node.meta[ir.KERNEL] = {"id": gid, "kind": "transposed_linear",
                                    **(_price(node, ctx) or {})}
        return PassResult(gm, count > 0)

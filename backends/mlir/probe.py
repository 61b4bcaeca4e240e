"""Which ops torch-mlir cannot lower, and why: each op probed on its own.

A whole-graph lowering stops at the first op it cannot legalize and says nothing about the
rest, so each distinct op is cut out alone (with the ``getitem``s that read a multi-result
op, as the whole graph has them) and lowered to linalg. Ops are probed once per signature
(target, input ranks and dtypes, constant arguments): shapes rarely decide whether a
pattern applies, and GEM-scale graphs repeat the same op hundreds of times.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from gemc.backends.mlir.extract import extract_subgraph
from gemc.backends.mlir.lower import LINALG, LoweringError, lower_graph, new_context
from torch import fx


@dataclass(frozen=True)
class Unsupported:
    """An op that does not reach linalg: the stage it fails to reach and MLIR's reason."""

    op: str
    stage: str
    reason: str
    nodes: tuple[str, ...]

    def line(self) -> str:
        shown = ", ".join(self.nodes[:6]) + (
            f", ... ({len(self.nodes)})" if len(self.nodes) > 6 else ""
        )
        return f"{self.op}\tstage={self.stage}\tnodes={shown}\treason={self.reason}"


def op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__name__", str(target))


def _signature(node: fx.Node) -> str:
    def describe(a: object) -> str:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                return f"{val.dtype}:{val.dim()}"
            return type(val).__name__
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(describe(x) for x in a) + "]"
        return repr(a)

    args = ",".join(describe(a) for a in node.args)
    kwargs = ",".join(f"{k}={describe(v)}" for k, v in sorted(node.kwargs.items()))
    return f"{op_name(node)}({args};{kwargs})"


def short_reason(message: str) -> str:
    """MLIR's message without the op's full printed form (which repeats the types)."""
    text = message.split("; see current operation")[0]
    cut = text.find(": %")
    if cut > 0:
        text = text[:cut]
    return " ".join(text.split())[:300]


def find_unsupported(
    gm: fx.GraphModule, nodes: Iterable[fx.Node] | None = None
) -> list[Unsupported]:
    """Probe every computing node of ``nodes`` (default: the whole graph); one entry per op
    that fails, naming every node of that op whose signature failed."""
    chosen = list(nodes) if nodes is not None else list(gm.graph.nodes)
    verdicts: dict[str, tuple[str, str] | None] = {}
    context = new_context()
    failing: dict[str, tuple[str, str, list[str]]] = {}
    for node in chosen:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        sig = _signature(node)
        if sig not in verdicts:
            verdicts[sig] = _probe(gm, node, context)
        verdict = verdicts[sig]
        if verdict is None:
            continue
        stage, reason = verdict
        entry = failing.setdefault(op_name(node), (stage, reason, []))
        entry[2].append(node.name)
    return [
        Unsupported(op=op, stage=stage, reason=reason, nodes=tuple(names))
        for op, (stage, reason, names) in sorted(failing.items())
    ]


def _probe(gm: fx.GraphModule, node: fx.Node, context: object) -> tuple[str, str] | None:
    """None if the op alone lowers to linalg, else (stage not reached, reason)."""
    readers = [u for u in node.users if u.target is operator.getitem]
    try:
        sub = extract_subgraph(gm, [node, *readers])
    except ValueError as exc:
        return "extract", str(exc)
    lowered = lower_graph(sub.gm, until=LINALG, context=context)
    if lowered.error is None:
        return None
    return lowered.error.stage, describe(lowered.error)


def describe(error: LoweringError) -> str:
    """One line: MLIR's first diagnostic, and the torch ops left unconverted when that
    diagnostic names a constant rather than the op that failed."""
    reason = short_reason(error.messages[0])
    if error.leftover and not any(op in reason for op in error.leftover):
        reason += f" (left unconverted: {', '.join(error.leftover[:4])})"
    return reason
